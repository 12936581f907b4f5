"""Mixture of experts and expert parallelism over `ep`.

model.moe_*, jaxpar/models/moe.py and jaxpar/parallel/expert_parallel.py: the router's rules against hand-derived cases,
the token dispatch against a per-token numpy sum, and every layout against one device, drops included.
"""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.core.errors import UserError
from jaxpar.parallel.expert_dispatch import local_experts, ragged_experts
from jaxpar.core.model.experts import row_capacity
from jaxpar.models.moe import route
from tests.helpers import (
    ROOT,
    assert_both_frameworks_give_hf_answers,
    assert_hf_round_trip_through_a_jaxpar_run,
    assert_params_close,
    hf_oracle,
    run_steps,
    tiny_config,
)

# Mixtral's shape (llama blocks, experts instead of the MLP) plus a shared expert and the balance loss; llama has no
# attention biases, whose key bias has no true gradient and drifts on rounding noise over 20 steps. The schema's
# learning rate, not the tiny tests' 1e-2: at 1e-2 even dp=8 (no ep) drifts from one device by 1.2e-5 in parameters
# over 20 steps (2e-6 over 10; measured), the model amplifying float32 rounding; at 3e-3 5e-7 over 20.
MOE = (
    "model.family=llama",
    "model.n_kv_head=2",
    "model.moe_experts=8",
    "model.moe_top_k=2",
    "model.moe_shared_experts=1",
    "model.moe_d_ff=16",
    "model.moe_aux_loss=0.01",
    "train.steps=20",
    "optim.lr=3e-3",
    "optim.min_lr=3e-4",
)


def _route(logits, *overrides):
    cfg = tiny_config(*overrides).model
    return [np.asarray(a) for a in route(jnp.asarray(logits, jnp.float32)[None], cfg)]


def test_capacity_keeps_a_rows_first_claims_and_counts_the_rest():
    # 2 experts, top-1, capacity factor 1: each expert takes ceil(1 x 1 x 4 / 2) = 2 of the row's 4 tokens
    logits = [[1, 0], [1, 0], [1, 0], [0, 1]]
    ids, weights, kept, stats = _route(
        logits, "model.moe_experts=2", "model.moe_top_k=1", "model.moe_capacity_factor=1.0"
    )
    assert ids[0, :, 0].tolist() == [0, 0, 0, 1]
    assert kept[0, :, 0].tolist() == [True, True, False, True]  # the third token to expert 0 finds it full
    np.testing.assert_allclose(weights, 1.0)  # one choice, normalised
    p = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    f = 2 / (1 * 4) * np.array([3, 1])  # DeepSeek-V3's f_e = E/(kT) x choices of e
    np.testing.assert_allclose(stats[0], [3, 1, 1, np.sum(f * p.mean(0))], rtol=1e-6)


def test_first_choices_claim_places_before_second_choices():
    # 3 experts, top-2, capacity ceil(0.75 x 2 x 2 / 3) = 1: both first choices fit, neither second one does
    # (in token order instead, token 0's second choice would take expert 1's place from token 1's first)
    ids, _, kept, stats = _route([[3, 2, 0], [2, 3, 0]], "model.moe_experts=3", "model.moe_capacity_factor=0.75")
    assert ids[0].tolist() == [[0, 1], [1, 0]]
    assert kept[0].tolist() == [[True, False], [True, False]]
    assert stats[0, 3] == 2  # dropped choices


def test_capacity_follows_the_tokens_places_when_they_are_permuted():
    """Zig-zag sequence parallelism hands the router a row in another order.

    `index` (each token's place) keeps the drops those of the natural order.
    """
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(16, 4)).astype(np.float32)
    overrides = ("model.moe_experts=4", "model.moe_capacity_factor=0.5")
    natural = _route(logits, *overrides)
    order = np.array([0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9])  # a zig-zag order of 16
    cfg = tiny_config(*overrides).model
    permuted = [np.asarray(a) for a in route(jnp.asarray(logits[order])[None], cfg, jnp.asarray(order))]
    assert natural[2][0, order].tolist() == permuted[2][0].tolist()  # the same choices kept
    assert not np.array_equal(_route(logits[order], *overrides)[2][0], permuted[2][0])  # without index: others


def test_the_balance_loss_is_one_when_every_expert_gets_its_share():
    # 4 tokens, each scoring its own expert highest by the same margin: f_e = 1, P_e = 1/4
    logits = np.eye(4) * 2.0
    *_, stats = _route(logits, "model.moe_experts=4", "model.moe_top_k=1")
    np.testing.assert_allclose(stats[0, -1], 1.0, rtol=1e-6)


def test_the_balance_bias_chooses_but_does_not_weigh():
    # scores softmax([2, 1.5, 0]) = 0.55, 0.33, 0.12; a bias of +0.3 on expert 2 makes it the choice (0.42 > 0.33),
    # and its weight stays its score: normalised over the chosen, 0.55 / (0.55 + 0.12)
    logits = np.array([[2.0, 1.5, 0.0]])
    cfg = tiny_config("model.moe_experts=3", "model.moe_bias_update=0.01").model
    ids, weights, _, stats = (
        np.asarray(a) for a in route(jnp.asarray(logits, jnp.float32)[None], cfg, None, jnp.asarray([0.0, 0.0, 0.3]))
    )
    p = np.exp(logits[0]) / np.exp(logits[0]).sum()
    assert ids[0, 0].tolist() == [0, 2]
    np.testing.assert_allclose(weights[0, 0], [p[0] / (p[0] + p[2]), p[2] / (p[0] + p[2])], rtol=1e-6)
    assert stats[0, :3].tolist() == [1, 0, 1]  # expert 2 received the choice


def test_the_balance_bias_moves_by_its_speed_towards_the_mean_load():
    from jaxpar.models.moe import update_router_bias

    cfg = tiny_config("model.moe_experts=4", "model.moe_bias_update=0.5").model  # 2 expert layers of 4 experts
    params = {"blocks": {"moe": {"router": {"bias": jnp.zeros((2, 4)), "kernel": jnp.ones(1)}}}}
    stats = jnp.asarray([3, 1, 0, 4, 2, 2, 2, 2, 7, 0.9], jnp.float32)  # per layer loads, dropped, balance
    bias = update_router_bias(params, stats, cfg)["blocks"]["moe"]["router"]["bias"]
    assert np.asarray(bias).tolist() == [[-0.5, 0.5, 0.5, -0.5], [0, 0, 0, 0]]  # layer 1: the mean load of 2


def test_the_balance_bias_follows_each_steps_loads(dataset):
    """The balance bias follows each step's expert loads.

    One expert layer: after each step the bias has moved by the speed towards the step's mean load (1/E of the choices,
    read off the records).
    """
    cfg = tiny_config(*MOE, "model.n_layer=1", "model.moe_bias_update=0.01", "train.steps=3")
    runs = [run_steps(cfg, "dp=1", dataset, steps=s, devices=jax.devices()[:1]) for s in (1, 3)]
    for run in runs:
        steps = np.sign(1 / 8 - np.asarray(run["moe_load_per_step"]))
        np.testing.assert_allclose(run["params"]["blocks.moe.router.bias"], 0.01 * steps.sum(0)[None], atol=1e-7)
    assert np.abs(runs[1]["params"]["blocks.moe.router.bias"]).max() > 0


@pytest.mark.parametrize("experts", [local_experts, ragged_experts], ids=["padded", "ragged"])
@pytest.mark.parametrize("capacity,activation", [(0, "swiglu"), (1, "swiglu"), (0, "gpt_oss")])
def test_the_dispatch_sums_each_tokens_kept_choices(capacity, activation, experts):
    """Each token's kept choices' outputs, weighted; gpt_oss's with each expert's biases and a limit that clamps.

    Through the padded buffer and through model.moe_ragged's ragged matmuls alike.
    """
    rng = np.random.default_rng(0)
    B, T, D, E, F, k = 2, 6, 8, 4, 5, 2
    x = rng.normal(size=(B, T, D)).astype(np.float32)
    gate, up, down = (rng.normal(size=s).astype(np.float32) for s in ((E, D, F), (E, D, F), (E, F, D)))
    w = {"gate": gate, "up": up, "down": down}
    if activation == "gpt_oss":
        w.update({n: rng.normal(size=(E, s)).astype(np.float32) for n, s in (("gate_bias", F), ("up_bias", F))})
        w["down_bias"] = rng.normal(size=(E, D)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:k] for _ in range(B * T)]).reshape(B, T, k)
    weights = rng.uniform(size=(B, T, k)).astype(np.float32)
    kept = rng.uniform(size=(B, T, k)) > 0.3
    if capacity:  # at most `capacity` kept choices per expert and row, as route leaves them
        kept = np.ones_like(kept)
        ids[:] = [[0, 1]] * T
        kept[:, 1:] = False
    limit, alpha = 1.5, 1.702  # |x @ gate| reaches past 1.5: the clamp acts
    y = experts(
        *map(jnp.asarray, (x, ids, weights, kept)),
        {n: jnp.asarray(a) for n, a in w.items()},
        capacity,
        (activation, limit, alpha),
    )
    sigmoid = lambda a: 1 / (1 + np.exp(-a))
    want, clamped = np.zeros_like(x), 0
    for b, t, j in np.ndindex(B, T, k):
        if kept[b, t, j]:
            e, h = ids[b, t, j], x[b, t]
            g, u = h @ gate[e], h @ up[e]
            if activation == "swiglu":
                out = (g * sigmoid(g) * u) @ down[e]
            else:  # transformers' GptOssExperts: biases, clamps, (up + 1) * glu
                g, u = g + w["gate_bias"][e], u + w["up_bias"][e]
                clamped += int(np.sum(g > limit) + np.sum(np.abs(u) > limit))
                g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
                out = ((u + 1) * g * sigmoid(alpha * g)) @ down[e] + w["down_bias"][e]
            want[b, t] += weights[b, t, j] * out
    assert activation == "swiglu" or clamped > 0
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)


_REFERENCE: dict = {}


def _reference(dataset, *extra):
    if extra not in _REFERENCE:
        _REFERENCE[extra] = run_steps(tiny_config(*MOE, *extra), "dp=1", dataset, devices=jax.devices()[:1])
    return _REFERENCE[extra]


def _devices(mesh: str):
    return jax.devices()[: math.prod(int(p.split("=")[1]) for p in mesh.split(","))]


@pytest.mark.parametrize("mesh", ["ep=4,dp=2", "ep=2,fsdp=2,tp=2", "ep=2,pp=2"])
def test_dropless_experts_on_every_layout_equal_one_device(mesh, dataset):
    ref = _reference(dataset)
    got = run_steps(tiny_config(*MOE), mesh, dataset, devices=_devices(mesh))
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5)
    np.testing.assert_allclose(got["moe_max_load"], ref["moe_max_load"], rtol=1e-5)
    assert ref["moe_dropped"] == [0.0] * 20
    assert ref["loss"][-1] < ref["loss"][0] - 0.5
    assert_params_close(got["params"], ref["params"])


# moe-tiny's balance loss and the auxiliary-loss-free bias on 4 layers: interleaved and ZB-V give pp=2 a layer per chunk
ON_EXECUTOR = ("model.n_layer=4", "model.moe_bias_update=0.001", "train.steps=4")


@pytest.mark.parametrize("mesh", ["pp=2", "pp=2,ep=2"])
@pytest.mark.parametrize(
    "schedule", ["1f1b", "interleaved", "zb_h1", "zb_v", pytest.param("dualpipev", marks=pytest.mark.slow)]
)
def test_experts_on_each_hand_scheduled_pipeline_equal_one_device(schedule, mesh, dataset):
    """The executor carries the experts' statistics.

    Each stage sums its layers' (the balance loss's gradient pulled back through every stage, each expert layer's
    loads for its bias), as one device does over the layers.
    """
    ref = _reference(dataset, *ON_EXECUTOR)
    virtual = ("parallel.pipeline_virtual_stages=2",) if schedule == "interleaved" else ()
    cfg = tiny_config(*MOE, *ON_EXECUTOR, f"parallel.pipeline_schedule={schedule}", *virtual)
    got = run_steps(cfg, mesh, dataset, devices=_devices(mesh))
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5)
    np.testing.assert_allclose(got["moe_balance"], ref["moe_balance"], rtol=1e-5)
    np.testing.assert_allclose(got["moe_max_load"], ref["moe_max_load"], rtol=1e-5)
    assert np.abs(ref["params"]["blocks.moe.router.bias"]).max() >= 0.001  # the bias moved
    assert_params_close(got["params"], ref["params"])


def test_dropped_tokens_are_counted_alike_on_every_layout(dataset):
    capacity = ("model.moe_capacity_factor=0.5",)
    assert row_capacity(tiny_config(*MOE, *capacity).model, 16) == 2  # ceil(0.5 x 2 x 16 / 8)
    ref = _reference(dataset, *capacity)
    assert min(ref["moe_dropped"]) > 0.05  # half the even share: many choices find their expert full
    assert ref["loss"] != _reference(dataset)["loss"]
    for mesh in ("ep=4,dp=2", "ep=2,pp=2,sp=2"):
        got = run_steps(tiny_config(*MOE, *capacity), mesh, dataset, devices=_devices(mesh))
        np.testing.assert_allclose(got["moe_dropped"], ref["moe_dropped"], rtol=1e-6)
        np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5)
        assert_params_close(got["params"], ref["params"])


def test_the_balance_loss_moves_the_router(dataset):
    """moe_aux_loss weighs the balance loss into the gradient.

    Weight 1 brings it close to its even value 1.0 (measured: 1.01 against 1.15 without, over the last steps of 20).
    """
    balance = {
        w: run_steps(tiny_config(*MOE, f"model.moe_aux_loss={w}"), "dp=1", dataset, devices=jax.devices()[:1])[
            "moe_balance"
        ]
        for w in (0.0, 1.0)
    }
    assert np.mean(balance[1.0][-5:]) < min(1.05, np.mean(balance[0.0][-5:]) - 0.05)


def test_ep_needs_experts_it_divides():
    from jaxpar.checks import check_layout

    sizes = dict(dp=1, fsdp=1, pp=1, ep=2, sp=1, tp=1)
    with pytest.raises(UserError, match="has none"):
        check_layout(tiny_config(), sizes)
    with pytest.raises(UserError, match="moe_experts=3 is not divisible by ep=2"):
        check_layout(tiny_config("model.moe_experts=3"), sizes)
    check_layout(tiny_config(*MOE, "parallel.pipeline_schedule=1f1b"), {**sizes, "ep": 1, "pp": 2})  # runs
    # dense first layers: the executor's stages split the expert stack alone (the dense one runs on the first)
    check_layout(
        tiny_config(*MOE, "parallel.pipeline_schedule=zb_v", "model.n_layer=6", "model.moe_first_dense=2"),
        {**sizes, "ep": 1, "pp": 2},
    )


def test_a_run_records_the_experts_load_and_says_it(dataset, tmp_path):
    from tests.helpers import metrics, run_cli

    r = run_cli(
        tmp_path,
        dataset,
        "--mesh",
        "ep=2,dp=2",
        "train.steps=2",
        "model.moe_experts=4",
        "model.moe_capacity_factor=0.5",
        env={"JAXPAR_CPU_DEVICES": "4"},
    )
    assert r.returncode == 0, r.stderr
    assert "active per token" in r.stdout and "dropped" in r.stdout and "padded all-to-all" in r.stderr
    record = metrics(tmp_path)[2]
    assert len(record["moe_load"]) == 4 and abs(sum(record["moe_load"]) - 1) < 1e-6
    assert record["moe_dropped"] > 0 and record["moe_max_load"] >= 1.0


# DeepSeek-V3's shape: dense first layers (model.moe_first_dense: two dense SwiGLU layers of width 24, then two of
# experts) and the auxiliary-loss-free balance bias beside the balance loss
FIRST_DENSE = (
    "model.n_layer=4",
    "model.moe_first_dense=2",
    "model.d_ff=24",
    "train.steps=10",
    "model.moe_bias_update=0.001",
)


@pytest.mark.parametrize("mesh", ["ep=4,dp=2", "ep=2,pp=2"])
def test_dense_first_layers_and_the_balance_bias_on_layouts_equal_one_device(mesh, dataset):
    """Both stacks split over the pipeline's stages, the experts over ep.

    The balance is the expert layers' mean; each layer's bias moves by the whole batch's loads, the same on every
    layout.
    """
    ref = _reference(dataset, *FIRST_DENSE)
    bias = ref["params"]["blocks.moe.router.bias"]
    assert np.abs(bias).max() >= 0.001 and not np.array_equal(bias[0], bias[1])  # each layer by its own loads
    assert ref["params"]["dense_blocks.mlp.gate.kernel"].shape == (2, 32, 24)
    assert ref["params"]["blocks.moe.gate"].shape == (2, 8, 32, 16)
    assert "dense_blocks.moe.router.kernel" not in ref["params"] and "blocks.mlp.gate.kernel" not in ref["params"]
    assert 0.8 < min(ref["moe_balance"]) and max(ref["moe_balance"]) < 1.5  # a mean over 2 layers (~1), not 4 (~0.5)
    got = run_steps(tiny_config(*MOE, *FIRST_DENSE), mesh, dataset, devices=_devices(mesh))
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5)
    np.testing.assert_allclose(got["moe_balance"], ref["moe_balance"], rtol=1e-5)
    assert_params_close(got["params"], ref["params"])


# dense first layers before four expert layers: interleaved and ZB-V give pp=2 an expert layer per chunk
FIRST_DENSE_ON_EXECUTOR = (
    "model.n_layer=6",
    "model.moe_first_dense=2",
    "model.d_ff=24",
    "train.steps=4",
    "model.moe_bias_update=0.001",
)


@pytest.mark.parametrize(
    "schedule",
    [
        "1f1b",
        "zb_v",
        pytest.param("interleaved", marks=pytest.mark.slow),
        pytest.param("zb_h1", marks=pytest.mark.slow),
    ],
)
def test_dense_first_layers_on_each_hand_scheduled_pipeline_equal_one_device(schedule, dataset):
    """Dense first layers on each hand-scheduled pipeline equal one device.

    The executor's first stage runs the dense stack whole after the embedding (its gradient with the embedding's), the
    stages split the expert stack; the bias's loads are counted over the expert layers. Skipped dense layers (or ones
    every stage ran) would change the loss and leave the dense weights' gradient elsewhere.
    """
    ref = _reference(dataset, *FIRST_DENSE_ON_EXECUTOR)
    virtual = ("parallel.pipeline_virtual_stages=2",) if schedule == "interleaved" else ()
    cfg = tiny_config(*MOE, *FIRST_DENSE_ON_EXECUTOR, f"parallel.pipeline_schedule={schedule}", *virtual)
    got = run_steps(cfg, "pp=2", dataset, devices=_devices("pp=2"))
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5)
    np.testing.assert_allclose(got["moe_balance"], ref["moe_balance"], rtol=1e-5)
    dense = ref["params"]["dense_blocks.mlp.gate.kernel"]
    assert dense.shape[0] == 2 and np.abs(dense - got["params"]["dense_blocks.mlp.gate.kernel"]).max() < 5e-5
    assert_params_close(got["params"], ref["params"])


def test_dense_first_layers_are_torchpars_dense_blocks(tmp_path):
    """jaxpar's two stacks against torchpar's per-layer blocks (layer i < moe_first_dense with an MLP).

    The same weights through the shared format give the same logits, statistics and greedy tokens.
    """
    import torch
    from flax import nnx

    from jaxpar.core.weights.names import flatten, model_dims, unflatten
    from jaxpar.decode import make_generate
    from jaxpar.formats import hf_mixtral
    from jaxpar.models.decoder import Decoder
    from torchpar.decode import generate
    from torchpar.models.decoder import Decoder as TorchDecoder
    from torchpar.weights import from_shared, to_shared

    cfg = tiny_config(*MOE, "model.n_layer=3", "model.moe_first_dense=1", "model.d_ff=24").model
    model = Decoder(cfg, nnx.Rngs(0))
    flat = {k: np.asarray(v) for k, v in flatten(nnx.to_pure_dict(nnx.state(model, nnx.Param))).items()}
    torch_model = TorchDecoder(cfg)
    torch_model.load_state_dict(from_shared(flat, cfg.n_layer))
    assert [hasattr(b, "moe") for b in torch_model.blocks] == [False, True, True]
    back = to_shared(torch_model.state_dict(), cfg.n_layer)
    assert sorted(back) == sorted(flat) and all(np.array_equal(back[k], flat[k]) for k in flat)
    tokens = np.random.default_rng(0).integers(0, 256, (2, 16))
    logits, stats = model.forward(jnp.asarray(tokens))
    with torch.no_grad():
        want = torch_model(torch.as_tensor(tokens)).numpy()
    np.testing.assert_allclose(np.asarray(logits), want, atol=1e-5)
    np.testing.assert_allclose(np.asarray(stats), torch_model.expert_stats.numpy(), rtol=1e-5)
    assert np.asarray(stats)[:, :8].sum() == 2 * 16 * 2 * 2  # rows x tokens x top_k x the 2 expert layers
    dims = model_dims(flat)  # what a weights file alone says of its model (conversion, sampling)
    assert (dims["n_layer"], dims["moe_first_dense"], dims["d_ff"], dims["moe_experts"]) == (3, 1, 24, 8)
    with pytest.raises(UserError, match="Mixtral has experts in every layer"):
        hf_mixtral.shared_to_hf(flat, str(tmp_path), dims)
    params = unflatten({k: jnp.asarray(v) for k, v in flat.items()})
    jax_tokens = make_generate(nnx.split(model, nnx.Param)[0])(
        params, jnp.asarray(tokens[:1, :6]), jax.random.key(0), new_tokens=8
    )
    assert np.asarray(jax_tokens).tolist() == generate(torch_model.eval(), torch.as_tensor(tokens[:1, :6]), 8).tolist()


def test_dense_first_layers_need_a_layer_of_experts_and_gpipe_stages_that_split_both():
    from jaxpar.checks import check_layout

    with pytest.raises(UserError, match="moe_first_dense=2 leaves no layer of model.n_layer=2"):
        tiny_config(*MOE, "model.moe_first_dense=2")
    sizes = dict(dp=1, fsdp=1, pp=2, ep=1, sp=1, tp=1)
    with pytest.raises(UserError, match="the gpipe schedule splits .* pp=2 must divide both"):
        check_layout(tiny_config(*MOE, "model.n_layer=4", "model.moe_first_dense=1"), sizes)
    # the hand-scheduled executor runs the dense layer whole on its first stage: only the 4 expert layers split
    for schedule in ("1f1b", "zb_v"):
        check_layout(
            tiny_config(*MOE, "model.n_layer=5", "model.moe_first_dense=1", f"parallel.pipeline_schedule={schedule}"),
            sizes,
        )


# --- Hugging Face MixtralForCausalLM <-> both frameworks -------------------------------------------------


@pytest.fixture(scope="module", params=[None, 5], ids=["whole", "window5"])
def hf_mixtral(request, tmp_path_factory):
    """A random Mixtral; with the param, each token attending to its 5 latest (rows of 24, 12 greedy tokens after 8)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
        rms_norm_eps=1e-6,
        rope_theta=500.0,
        tie_word_embeddings=False,
        sliding_window=request.param,
    )
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).eval()
    with torch.no_grad():  # large weights and norms away from 1: a mixed-up expert or router would show
        for name, p in model.named_parameters():
            p.add_(0.3 * torch.randn_like(p)) if "norm" in name else p.mul_(8.0)
    return hf_oracle(model, tmp_path_factory.mktemp("hf_mixtral"))


def test_hf_mixtral_logits_and_greedy_tokens_match_both_frameworks(hf_mixtral):
    from jaxpar.core.config.schema import load_config
    from jaxpar.tools.convert import read

    path, tokens, want, greedy = hf_mixtral
    flat, model = read("hf", str(path))
    assert (model["moe_experts"], model["moe_top_k"], model["moe_d_ff"]) == (4, 2, 24)
    assert model.get("sliding_window") == json.loads((path / "config.json").read_text())["sliding_window"]
    cfg = load_config(None, [f"model.{k}={v}" for k, v in model.items()] + ["data.seq_len=24"]).model
    assert_both_frameworks_give_hf_answers(flat, cfg, tokens, want, greedy, "Mixtral")


def test_mixtral_round_trip_through_a_jaxpar_run_is_bit_exact(hf_mixtral, tmp_path):
    import transformers

    assert_hf_round_trip_through_a_jaxpar_run(hf_mixtral, tmp_path, transformers.MixtralForCausalLM)


def test_a_killed_expert_parallel_run_resumes_exactly(dataset, tmp_path):
    """ep-sharded experts and their Adam moments through an orbax checkpoint.

    SIGKILL after step 3 of 6 on ep=2,dp=2, resumed: every loss and gradient norm bit-equal to the uninterrupted
    run.
    """
    from tests.helpers import assert_resumes_exactly

    assert_resumes_exactly(
        tmp_path,
        dataset,
        [
            "--mesh",
            "ep=2,dp=2",
            "model.moe_experts=4",
            "model.moe_top_k=2",
            "model.moe_capacity_factor=1.0",
            "train.steps=6",
            "checkpoint.every=2",
        ],
        kill_after=3,
    )


def _deepseek_v3(*extra: str):
    """configs/deepseek-v3-tiny.yaml narrowed for a test: one dense first layer, 4 expert layers, MTP depth 1."""
    from jaxpar.core.config.schema import load_config

    overrides = [
        "model.n_layer=5",
        "model.mtp_depth=1",
        "model.d_model=64",
        "model.d_ff=128",
        "model.moe_d_ff=32",
        "data.seq_len=16",
        "train.global_batch_size=8",
        "train.steps=3",
        "optim.warmup_steps=1",
        "data.val_fraction=0.1",
        "train.matmul_precision=highest",
    ]
    return load_config(f"{ROOT}/configs/deepseek-v3-tiny.yaml", overrides + list(extra))


def _eval_loss(cfg, mesh: str, flat: dict) -> float:
    """The eval step's loss of `flat` parameters on `mesh`, over one fixed batch of random tokens."""
    from jaxpar.core.weights.names import unflatten
    from jaxpar.layout import Layout
    from jaxpar.mesh import make_mesh
    from jaxpar.core.config.mesh_spec import parse_mesh
    from jaxpar.step import make_eval_step

    layout = Layout(cfg, make_mesh(parse_mesh(mesh), _devices(mesh)))
    params = jax.device_put(unflatten(flat), layout.state_shardings["params"])
    batch = np.random.default_rng(0).integers(1, 256, layout.batch_shape).astype(np.int32)
    return float(make_eval_step(layout)(params, jax.device_put(batch, layout.batch_sharding)))


@pytest.mark.parametrize("schedule", ["1f1b", "zb_v"])
def test_deepseek_v3_s_shape_on_a_hand_scheduled_pipeline_equals_one_device(schedule, dataset):
    """DeepSeek-V3's shape on pp=2,ep=2: one dense first layer, which no even pipeline split can take, and MTP.

    The executor's first stage runs the dense layer whole, the stages split the 4 expert layers; evaluation (GPipe's
    forward over pp) runs the dense stack whole too. Training and the eval loss equal one device's.
    """
    ref = run_steps(_deepseek_v3(), "dp=1", dataset, devices=jax.devices()[:1])
    cfg = _deepseek_v3(f"parallel.pipeline_schedule={schedule}")
    got = run_steps(cfg, "pp=2,ep=2", dataset, devices=_devices("pp=2,ep=2"))
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5)
    assert ref["params"]["dense_blocks.mlp.gate.kernel"].shape[0] == 1 and any(
        k.startswith("mtp") for k in ref["params"]
    )
    assert_params_close(got["params"], ref["params"])
    want = _eval_loss(_deepseek_v3(), "dp=1", ref["params"])
    assert _eval_loss(cfg, "pp=2,ep=2", ref["params"]) == pytest.approx(want, rel=1e-5)
