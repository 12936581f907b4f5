"""Sliding-window attention (model.sliding_window) in every family, both frameworks and jaxpar's layouts.

The banded attention equals attention written out key by key; the step's attention FLOPs shrink with the window;
jaxpar equals torchpar and one device equals every layout (dp x tp, sp with all_gather and ulysses, zig-zag or not,
packed documents, the pipelines); decoding with a KV cache equals the full forward; ring attention is refused in one
line. transformers' Qwen3 with a window is the oracle in tests/jaxpar/test_hf_qwen3.py; torchpar's backends in
tests/torchpar/test_qwen3_runs.py.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxpar.core.errors import UserError
from jaxpar.core.weights.names import flatten, unflatten
from tests.helpers import assert_params_close, run_steps, tiny_config

WINDOW = ("model.sliding_window=6",)  # rows of 16: blocks of 4, each query block reads 3 of the 4
FAMILIES = {
    "gpt2": WINDOW,
    "llama": WINDOW + ("model.family=llama", "model.n_kv_head=2", "model.d_ff=48", "model.tie_embeddings=false"),
    "mla": WINDOW + ("model.attention=mla", "model.q_latent_dim=16", "model.kv_latent_dim=8", "model.rope_head_dim=4"),
}
# gpt-oss's alternation: layers 0 and 2 slide, 1 and 3 attend to the whole row (jaxpar runs them in cycles of two)
ALTERNATING = ("model.full_attention_every=2", "model.n_layer=4")
FAMILIES["llama_alternating"] = FAMILIES["llama"] + ALTERNATING


def _reference_attention(q, k, v, window):
    """softmax over each query's allowed keys, one query at a time, in numpy float64."""
    b, T, h, d = q.shape
    out = np.zeros((b, T, h, d))
    for i in range(T):
        keys = range(max(0, i - window + 1), i + 1)
        s = np.einsum("bhd,bkhd->bhk", q[:, i], k[:, list(keys)]) / math.sqrt(d)
        w = np.exp(s - s.max(-1, keepdims=True))
        out[:, i] = np.einsum("bhk,bkhd->bhd", w / w.sum(-1, keepdims=True), v[:, list(keys)])
    return out


@pytest.mark.parametrize("T,window", [(16, 4), (16, 6), (15, 4), (12, 7), (64, 8), (16, 1)])
def test_banded_attention_is_attention_over_the_window(T, window):
    from jaxpar.ops import banded_attention, causal_attention

    rng = np.random.default_rng(T * window)
    q, k, v = (rng.standard_normal((2, T, 3, 8)).astype(np.float32) for _ in range(3))
    want = _reference_attention(q, k, v, window)
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(banded_attention(*map(jnp.asarray, (q, k, v)), window), want, atol=1e-5)
        masked = causal_attention(*map(jnp.asarray, (q, k, v)), jnp.arange(T), jnp.arange(T), window=window)
    np.testing.assert_allclose(masked, want, atol=1e-5)  # the mask the permuted and partial sequences take


def test_fewer_queries_than_keys_take_the_band_of_their_positions():
    """Queries 0..4 against keys 0..7 without positions (each query at its own index): the first rows of the whole."""
    from jaxpar.ops import causal_attention

    q, k, v = (jnp.asarray(np.random.default_rng(i).standard_normal((2, 8, 3, 8)), jnp.float32) for i in range(3))
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(
            causal_attention(q[:, :5], k, v, window=3), causal_attention(q, k, v, window=3)[:, :5], atol=1e-6
        )


def test_the_steps_attention_flops_shrink_with_the_window():
    """Rows of 64 with a window of 8: blocks of 8, two per query block, so a quarter of the causal scores' work."""
    from jaxpar.cost.jaxpr_flops import matmul_flops
    from jaxpar.cost.loss_and_grad import loss_and_grad_program

    def attention_flops(*overrides):
        cfg = tiny_config("data.seq_len=64", "model.max_seq_len=64", *overrides)
        traced, params, batch = loss_and_grad_program(cfg, {"dp": 1}, jax.devices()[:1])
        return matmul_flops(jax.make_jaxpr(traced)(params, batch).jaxpr, scope="causal_attention")

    full, banded = attention_flops(), attention_flops("model.sliding_window=8")
    assert full > 0 and banded == pytest.approx(full / 4, rel=1e-6), (banded, full)


@pytest.mark.parametrize("family", FAMILIES)
def test_jaxpar_and_torchpar_give_the_same_loss_and_gradients(family):
    from jaxpar.loss import loss_fn as jax_loss
    from jaxpar.models.decoder import Decoder as JaxDecoder
    from torchpar.models.decoder import Decoder, next_token_loss
    from torchpar.weights import from_shared, to_shared

    cfg = tiny_config(*FAMILIES[family])
    torch_model = Decoder(cfg.model)
    torch_model.init_weights(0)
    params = to_shared(torch_model.state_dict(), cfg.model.n_layer)
    batch = jnp.asarray(np.random.default_rng(0).integers(0, 256, (4, cfg.data.seq_len + 1)), jnp.int32)

    def jaxpar_loss(model_cfg):
        graphdef, state = nnx.split(nnx.eval_shape(lambda: JaxDecoder(model_cfg, nnx.Rngs(0))))
        nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, unflatten(params)))
        with jax.default_matmul_precision("highest"):
            return jax.jit(jax.value_and_grad(lambda s: jax_loss(nnx.merge(graphdef, s), batch)))(state)

    jloss, jgrads = jaxpar_loss(cfg.model)
    whole = tiny_config(*FAMILIES[family], "model.sliding_window=0", "model.full_attention_every=0").model
    # the window acts (float32 noise on the loss: ~1e-7; half the tiny layers sliding move it ~8e-5)
    assert abs(float(jaxpar_loss(whole)[0]) - float(jloss)) > 2e-5
    if cfg.model.full_attention_every:  # and the full layers do not slide
        every_layer = tiny_config(*FAMILIES[family], "model.full_attention_every=0").model
        assert abs(float(jaxpar_loss(every_layer)[0]) - float(jloss)) > 2e-5
    jgrads = {k: np.asarray(v) for k, v in flatten(nnx.to_pure_dict(jgrads)).items()}
    model = Decoder(cfg.model)
    model.load_state_dict(from_shared(params, cfg.model.n_layer))
    tbatch = torch.from_numpy(np.array(batch)).long()
    loss = next_token_loss(model(tbatch[:, :-1]), tbatch[:, 1:])
    loss.backward()
    np.testing.assert_allclose(loss.item(), float(jloss), rtol=1e-6)
    grads = to_shared({n: p.grad for n, p in model.named_parameters()}, cfg.model.n_layer)
    assert set(grads) == set(jgrads)
    for name, g in grads.items():
        np.testing.assert_allclose(np.asarray(g), jgrads[name], atol=1e-5 * max(np.abs(jgrads[name]).max(), 1e-3))


LAYOUTS = [
    ("dp=2,tp=2", ()),
    ("sp=2", ("parallel.sequence_attention=all_gather",)),  # zig-zag: the band by the permuted positions
    ("sp=2", ("parallel.sequence_attention=all_gather", "parallel.sequence_zigzag=false", "data.document_mask=true")),
    ("sp=2", ("parallel.sequence_attention=ulysses",)),
    ("pp=2", ("parallel.pipeline_schedule=gpipe",)),
    ("pp=2", ("parallel.pipeline_schedule=1f1b",)),
    ("pp=2", ("parallel.pipeline_schedule=zb_v", "model.n_layer=4")),
    # the alternation: each stack, and each pipeline chunk, whole cycles of a sliding and a full layer
    ("dp=2,tp=2", ALTERNATING),
    ("sp=2", ("parallel.sequence_attention=ulysses", *ALTERNATING)),
    ("pp=2", ("parallel.pipeline_schedule=gpipe", *ALTERNATING)),
    ("pp=2", ("parallel.pipeline_schedule=zb_v", "model.full_attention_every=2", "model.n_layer=8")),
]
_REFERENCES: dict = {}


@pytest.mark.slow  # each model's one-device reference trains before its first layout
@pytest.mark.parametrize("mesh,extra", LAYOUTS, ids=[m + "".join(f"-{e.split('=')[1]}" for e in x) for m, x in LAYOUTS])
def test_every_layout_equals_one_device(mesh, extra, dataset):
    model_keys = FAMILIES["llama"] + tuple(e for e in extra if e.startswith(("model.", "data.")))
    if model_keys not in _REFERENCES:
        _REFERENCES[model_keys] = run_steps(tiny_config(*model_keys), "dp=1", dataset, devices=jax.devices()[:1])
    ref = _REFERENCES[model_keys]
    n = math.prod(int(p.split("=")[1]) for p in mesh.split(","))
    got = run_steps(tiny_config(*FAMILIES["llama"], *extra), mesh, dataset, devices=jax.devices()[:n])
    assert ref["loss"][-1] < ref["loss"][0] - 0.1, "the reference run should learn something"
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5)
    assert_params_close(got["params"], ref["params"])


def test_ring_attention_with_a_window_is_refused_in_one_line():
    from jaxpar.checks import divisibility

    sizes = {"dp": 1, "fsdp": 1, "tp": 1, "pp": 1, "sp": 2, "ep": 1}
    with pytest.raises(UserError, match="model.sliding_window=6 with parallel.sequence_attention=ring") as e:
        divisibility(tiny_config(*WINDOW, "parallel.sequence_attention=ring"), sizes)
    assert "\n" not in str(e.value)
    divisibility(tiny_config(*WINDOW, "parallel.sequence_attention=ulysses"), sizes)  # the others run
    sinks = tiny_config("model.family=llama", "model.attention_sinks=true", "parallel.sequence_attention=ring")
    with pytest.raises(UserError, match="model.attention_sinks=true with parallel.sequence_attention=ring"):
        divisibility(sinks, sizes)


@pytest.mark.parametrize(
    "layers,extra,share",
    [
        (3, (), "3 layers are not whole"),
        (4, ("parallel.pipeline_schedule=zb_v",), "4 layers in 4 pipeline chunks"),
        (8, ("parallel.pipeline_schedule=gpipe",), None),
    ],
)
def test_layers_that_are_not_whole_cycles_are_refused_in_one_line(layers, extra, share):
    from jaxpar.checks import divisibility

    cfg = tiny_config(*FAMILIES["llama_alternating"], f"model.n_layer={layers}", *extra)
    sizes = {"dp": 1, "fsdp": 1, "tp": 1, "pp": 2 if extra else 1, "sp": 1, "ep": 1}
    if share is None:
        divisibility(cfg, sizes)  # gpipe: 4 layers a stage, two cycles
        return
    with pytest.raises(UserError, match=f"model.full_attention_every=2: .*{share}") as e:
        divisibility(cfg, sizes)
    assert "\n" not in str(e.value)
