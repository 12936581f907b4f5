"""data.document_mask: each document in a packed row is read as if it were alone.

In a packed row each document is read as if it were alone (attention within it, positions restarting at its
end-of-document token) on every attention path -- one device, GSPMD dp/tp, each sp strategy, the pipeline executor,
GPipe's forward (evaluation on a pipeline), the KV-cache decoder -- and in torchpar; training (and evaluation) on a mesh
equals one device; the settings that cannot honour it are refused in one line.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxpar.context import use
from jaxpar.core.config.contract import Run, check_contract
from jaxpar.core.errors import UserError
from jaxpar.core.config.mesh_spec import parse_mesh
from jaxpar.core.weights.names import flatten, unflatten
from jaxpar.decode import make_generate
from jaxpar.layout import Layout
from jaxpar.loss import split_rows, token_order
from jaxpar.mesh import make_mesh
from jaxpar.models.decoder import Decoder, abstract_model
from jaxpar.models.head import cross_entropy
from jaxpar.parallelize import parallel_context
from jaxpar.step import loss_and_grad, make_eval_step
from parity_tests.compare import split_key_bias
from tests.helpers import make_dataset, run_steps, tiny_config
from torchpar.decode import generate as torch_generate
from torchpar.models.decoder import Decoder as TorchDecoder
from torchpar.weights import from_shared

EOD = 0  # the byte tokenizer's end-of-document token
VARIANTS = {
    "gpt2": (),
    "llama": ("model.family=llama", "model.n_kv_head=2"),
    "mla": ("model.attention=mla", "model.q_latent_dim=16", "model.kv_latent_dim=8", "model.rope_head_dim=4"),
}


def packed_documents(seed: int):
    """Three documents of a 16-token row: a fragment, then two that start with the end-of-document token."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 256, 5), np.r_[EOD, rng.integers(1, 256, 6)], np.r_[EOD, rng.integers(1, 256, 3)]]


def batch_of_packed_rows(rows: int = 2):
    """[rows, 17] (inputs and targets of 16 tokens) and each row's documents."""
    docs = [packed_documents(seed) for seed in range(rows)]
    return np.stack([np.r_[np.concatenate(d), EOD] for d in docs]).astype(np.int32), docs


def model_and_params(variant: str, *overrides: str):
    cfg = tiny_config("data.document_mask=true", *VARIANTS[variant], *overrides)
    model = Decoder(cfg.model, nnx.Rngs(3))
    return cfg, model, (abstract_model(cfg.model)[0], nnx.state(model, nnx.Param).to_pure_dict())


def alone(model, docs) -> np.ndarray:
    """Logits [rows, 16, vocab]: each document run by itself, positions from 0, joined back into its row."""
    return np.stack([np.concatenate([np.asarray(model(jnp.asarray(d)[None]))[0] for d in row]) for row in docs])


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_document_of_a_packed_row_reads_as_if_alone(variant):
    cfg, model, _ = model_and_params(variant)
    batch, docs = batch_of_packed_rows()
    rows = split_rows(jnp.asarray(batch), eod=EOD)
    masked = np.asarray(model(rows.inputs, rows.positions, rows.segments))
    want = alone(model, docs)
    np.testing.assert_allclose(masked, want, atol=1e-6, rtol=0)
    assert np.max(np.abs(np.asarray(model(rows.inputs)) - want)) > 1e-3  # without the mask documents see each other


def layout_logits(cfg, mesh: str, params, batch) -> np.ndarray:
    """The packed rows' logits computed under a layout's parallel context (zig-zag order undone)."""
    sizes = parse_mesh(mesh)
    layout = Layout(cfg, make_mesh(sizes, jax.devices()[: math.prod(sizes.values())]))
    graphdef, order = abstract_model(cfg.model)[0], token_order(cfg, layout.mesh, batch.shape[1] - 1)

    @jax.jit
    def logits(params, batch):
        with use(parallel_context(layout)):
            rows = split_rows(batch, order, EOD)
            out = nnx.merge(graphdef, params)(rows.inputs, rows.positions, rows.segments)
        return out if order is None else out[:, np.argsort(order)]

    return np.asarray(
        logits(
            jax.device_put(params, layout.device_shardings["params"]),
            jax.device_put(jnp.asarray(batch), layout.batch_sharding),
        )
    )


@pytest.mark.parametrize(
    "mesh,overrides",
    [
        ("dp=2,tp=2", ()),
        ("sp=2", ("parallel.sequence_attention=ring",)),
        ("sp=2", ("parallel.sequence_attention=all_gather",)),
        ("sp=2", ("parallel.sequence_attention=ulysses",)),
        ("sp=2", ("parallel.sequence_attention=ring", "parallel.sequence_zigzag=false")),
    ],
    ids=["dp=2,tp=2", "sp=2-ring", "sp=2-all_gather", "sp=2-ulysses", "sp=2-ring-natural-order"],
)
def test_sharded_attention_keeps_documents_apart(mesh, overrides):
    cfg, model, (_, params) = model_and_params("llama", *overrides)
    batch, docs = batch_of_packed_rows()
    got = layout_logits(cfg, mesh, params, batch)
    np.testing.assert_allclose(got, alone(model, docs), atol=1e-6, rtol=0)


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_pipeline_stages_keep_documents_apart(schedule):
    """The executor's loss of packed rows is the cross-entropy of each document's own logits."""
    cfg, model, (_, params) = model_and_params(
        "gpt2", "model.n_layer=4", f"parallel.pipeline_schedule={schedule}", "parallel.pipeline_microbatches=2"
    )
    batch, docs = batch_of_packed_rows(4)
    want = float(cross_entropy(jnp.asarray(alone(model, docs)), jnp.asarray(batch[:, 1:])))
    layout = Layout(cfg, make_mesh({"pp": 2}, jax.devices()[:2]))
    value_and_grad, context = loss_and_grad(layout)
    with use(context):
        loss, _ = jax.jit(value_and_grad)(
            jax.device_put(params, layout.device_shardings["params"]),
            jax.device_put(jnp.asarray(batch), layout.batch_sharding),
        )
    np.testing.assert_allclose(float(loss), want, rtol=1e-6)
    unmasked = float(cross_entropy(model(jnp.asarray(batch[:, :-1])), jnp.asarray(batch[:, 1:])))
    assert abs(unmasked - want) > 1e-4  # the check above could tell a pipeline that ignored the mask


def torch_twin(cfg, model) -> TorchDecoder:
    flat = {k: torch.tensor(np.asarray(v)) for k, v in flatten(nnx.state(model, nnx.Param).to_pure_dict()).items()}
    twin = TorchDecoder(cfg.model, EOD)
    twin.load_state_dict(from_shared(flat, cfg.model.n_layer))
    return twin.eval()


@pytest.mark.parametrize("variant", VARIANTS)
def test_torchpar_reads_packed_rows_as_jaxpar_does(variant):
    cfg, model, _ = model_and_params(variant)
    batch, docs = batch_of_packed_rows()
    with torch.no_grad():
        got = torch_twin(cfg, model)(torch.tensor(batch[:, :-1], dtype=torch.long)).numpy()
    np.testing.assert_allclose(got, alone(model, docs), atol=1e-6, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_decoding_inside_a_packed_row_continues_the_last_document_alone(variant):
    """Decoding inside a packed row continues the last document alone.

    Greedy continuation of [document A, EOD, prompt B] equals that of [EOD, prompt B], in both frameworks (a model with
    large weights, so that its greedy tokens vary).
    """
    cfg, model, (graphdef, params) = model_and_params(variant, "model.init_std=0.5", "model.max_seq_len=48")
    a, b, _ = packed_documents(7)
    packed, own = np.r_[a, b][None].astype(np.int32), b[None].astype(np.int32)
    generate = make_generate(graphdef, EOD)
    want = np.asarray(generate(params, jnp.asarray(own), jax.random.key(0), new_tokens=24))
    np.testing.assert_array_equal(
        np.asarray(generate(params, jnp.asarray(packed), jax.random.key(0), new_tokens=24)), want
    )
    unmasked = make_generate(graphdef)(params, jnp.asarray(packed), jax.random.key(0), new_tokens=24)
    assert not np.array_equal(np.asarray(unmasked), want)
    twin = torch_twin(cfg, model)
    for prompt in (packed, own):
        np.testing.assert_array_equal(torch_generate(twin, torch.tensor(prompt, dtype=torch.long), 24).numpy(), want)


@pytest.fixture(scope="module")
def documents_data(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("documents") / "docs.bin", document_length=8)


@pytest.fixture(scope="module")
def one_device(documents_data):
    return run_steps(
        tiny_config("data.document_mask=true", "train.steps=20"), "dp=1", documents_data, devices=jax.devices()[:1]
    )


@pytest.mark.parametrize(
    "mesh,overrides",
    [
        ("dp=2,tp=2", ()),
        ("pp=2", ("parallel.pipeline_schedule=1f1b",)),
        ("sp=2", ("parallel.sequence_attention=ring",)),
        ("sp=2", ("parallel.sequence_attention=all_gather",)),
        ("sp=2", ("parallel.sequence_attention=ulysses",)),
    ],
    ids=["dp=2,tp=2", "pp=2-1f1b", "sp=2-ring", "sp=2-all_gather", "sp=2-ulysses"],
)
def test_masked_training_on_a_mesh_equals_one_device(mesh, overrides, documents_data, one_device):
    n = math.prod(parse_mesh(mesh).values())
    got = run_steps(
        tiny_config("data.document_mask=true", "train.steps=20", *overrides),
        mesh,
        documents_data,
        devices=jax.devices()[:n],
    )
    np.testing.assert_allclose(got["loss"], one_device["loss"], rtol=1e-5)
    # the key bias has no true gradient (softmax ignores it): Adam moves it by rounding noise alone
    got_p, ref_p = (split_key_bias(p) for p in (got["params"], one_device["params"]))
    for name in (k for k in ref_p if k != "blocks.attn.qkv.bias[key]"):
        np.testing.assert_allclose(got_p[name], ref_p[name], atol=5e-5, rtol=0, err_msg=name)


# 4 layers: interleaved and ZB-V run two chunks a stage on pp=2; 16 rows in 4 microbatches, more than the fewest every
# split divides (pp=2,dp=2: 2 rows of each microbatch on each data rank)
DEEP = (
    "data.document_mask=true",
    "model.n_layer=4",
    "optim.lr=3e-3",
    "optim.min_lr=3e-4",
    "train.steps=6",
    "train.global_batch_size=16",
    "parallel.pipeline_microbatches=4",
)
HAND_SCHEDULED = {"1f1b": (), "interleaved": ("parallel.pipeline_virtual_stages=2",), "zb_h1": (), "zb_v": ()}


def evaluated(cfg, mesh: str, flat_params: dict) -> float:
    """The eval step's loss (on a pipeline layout: GPipe's forward) of parameters on packed rows of short documents."""
    sizes = parse_mesh(mesh)
    layout = Layout(cfg, make_mesh(sizes, jax.devices()[: math.prod(sizes.values())]))
    batch = batch_of_packed_rows(cfg.train.global_batch_size)[0]
    return float(
        make_eval_step(layout)(
            jax.device_put(unflatten(flat_params), layout.device_shardings["params"]),
            jax.device_put(jnp.asarray(batch), layout.batch_sharding),
        )
    )


@pytest.fixture(scope="module")
def deep_one_device(documents_data):
    """The masked one-device run and its evaluation; the unmasked run's losses and evaluation."""
    run = lambda *extra: run_steps(tiny_config(*DEEP, *extra), "dp=1", documents_data, devices=jax.devices()[:1])
    masked = run()
    evaluate = lambda *extra: evaluated(tiny_config(*DEEP, *extra), "dp=1", masked["params"])
    return {
        **masked,
        "eval": evaluate(),
        "unmasked": run("data.document_mask=false")["loss"],
        "eval_unmasked": evaluate("data.document_mask=false"),
    }


@pytest.mark.parametrize(
    "mesh,schedule", [(mesh, schedule) for mesh in ("pp=2", "pp=2,dp=2") for schedule in HAND_SCHEDULED]
)
def test_masked_training_and_evaluation_on_each_hand_scheduled_pipeline_equal_one_device(
    mesh, schedule, documents_data, deep_one_device
):
    """What a run on the schedule computes.

    Each step's loss and the parameters (on the executor: each microbatch's positions and segment ids ride with its
    tokens), then the evaluation of the trained parameters (the eval step's GPipe forward: they travel with the
    microbatch's activations).
    """
    ref = deep_one_device
    # masks change these short documents' losses: the checks below could tell a mask that was ignored
    assert np.max(np.abs(np.subtract(ref["unmasked"], ref["loss"]))) > 1e-3
    assert abs(ref["eval_unmasked"] - ref["eval"]) > 1e-4  # (rel=1e-5 below: ~5e-5)
    cfg = tiny_config(*DEEP, f"parallel.pipeline_schedule={schedule}", *HAND_SCHEDULED[schedule])
    got = run_steps(cfg, mesh, documents_data, devices=jax.devices()[: math.prod(parse_mesh(mesh).values())])
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5)
    got_p, ref_p = (split_key_bias(p) for p in (got["params"], ref["params"]))
    for name in (k for k in ref_p if k != "blocks.attn.qkv.bias[key]"):  # the key bias: see the test above
        np.testing.assert_allclose(got_p[name], ref_p[name], atol=1e-5, rtol=0, err_msg=name)
    assert evaluated(cfg, mesh, got["params"]) == pytest.approx(ref["eval"], rel=1e-5)


@pytest.mark.parametrize(
    "overrides,trainer,backend,mesh",
    [
        (("model.attention=dilated", "model.segment_lengths=8,16", "model.dilation_rates=1,2"), "jaxpar", "", {}),
        (("parallel.pipeline_schedule=gpipe",), "jaxpar", "", {"pp": 2}),  # GPipe (auto picks another: documents)
        ((), "torchpar", "pipeline", {"pp": 2}),
    ],
)
def test_where_documents_cannot_be_kept_apart_the_setting_is_refused(overrides, trainer, backend, mesh):
    cfg = tiny_config("data.document_mask=true", *overrides)
    with pytest.raises(UserError, match=r"^data.document_mask=true .*") as e:
        check_contract(Run(cfg, trainer, backend, mesh))
    assert "\n" not in str(e.value)
