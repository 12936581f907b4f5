"""Model variants (model.attention = mla | dilated, model.linear = sketched).

Every layout equals one device, jaxpar equals torchpar, MLA equals DeepSeek-V2's equations, dilated attention equals
causal attention in its degenerate case and a brute-force union softmax, and sketches are derived.
"""

import hashlib
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxpar.core.weights.names import flatten, unflatten
from tests.helpers import assert_params_close, run_steps, tiny_config
from jaxpar.core.config.mesh_spec import parse_mesh
from jaxpar.models.dilated import dilated_attention
from jaxpar.models.decoder import Decoder as JaxGPT
from jaxpar.loss import loss_fn as jax_loss
from jaxpar.models.mla import MLAttention, kv_cache_width
from jaxpar.core.model.layer_rules import sketch_matrix
from torchpar.weights import from_shared, shared_shapes, to_shared
from torchpar.models.decoder import Decoder, next_token_loss

VARIANTS = {
    "mla": ("model.attention=mla", "model.q_latent_dim=16", "model.kv_latent_dim=8", "model.rope_head_dim=4"),
    "dilated": ("model.attention=dilated", "model.segment_lengths=4,8,16", "model.dilation_rates=1,2,4"),
    "sketched": ("model.linear=sketched", "model.sketch_ratio=0.5"),
    "sketched_sign": ("model.linear=sketched", "model.sketch=sign", "model.sketch_ratio=0.25"),
    # the llama family (GQA, untied head; tests/jaxpar/test_llama.py), and with the dilated attention core
    "llama": ("model.family=llama", "model.n_kv_head=2", "model.tie_embeddings=false", "model.d_ff=64"),
    # Qwen3's attention: heads wider than d_model / n_head, each query and key head RMS-normalised
    "qwen3": ("model.family=llama", "model.n_kv_head=2", "model.head_dim=12", "model.qk_norm=true", "model.d_ff=48"),
    # gpt-oss's attention: biases on every projection, a sink logit per head, a sliding window
    "llama_sinks": (
        "model.family=llama",
        "model.n_kv_head=2",
        "model.d_ff=48",
        "model.attention_bias=true",
        "model.attention_sinks=true",
        "model.sliding_window=6",
    ),
    # gpt-oss's experts: biases, the clamped activation (a limit the tiny model's values pass), the router's logit bias
    "gpt_oss_moe": (
        "model.family=llama",
        "model.n_kv_head=2",
        "model.moe_experts=4",
        "model.moe_d_ff=16",
        "model.moe_expert_bias=true",
        "model.moe_activation=gpt_oss",
        "model.moe_swiglu_limit=0.05",
        "model.attention_bias=true",
        "model.attention_sinks=true",
    ),
    "llama_dilated": (
        "model.family=llama",
        "model.n_kv_head=1",
        "model.d_ff=48",
        "model.attention=dilated",
        "model.segment_lengths=4,8,16",
        "model.dilation_rates=1,2,4",
    ),
}
# the framework twins also hold block-sparse dilated attention (tests/jaxpar/test_block_sparse.py): 32 tokens,
# rows of 16 selected tokens in both pairs, blocks of 2, a quarter kept
TWINS = {
    **VARIANTS,
    "dilated_sparse": (
        "data.seq_len=32",
        "model.attention=dilated",
        "model.segment_lengths=16,32",
        "model.dilation_rates=1,2",
        "model.sparsity_block=2",
        "model.sparsity_ratio=0.25",
    ),
}
MESHES = ["dp=8", "dp=2,tp=4", "fsdp=8"]


_REFERENCES: dict = {}


def _reference(variant, dataset):
    if variant not in _REFERENCES:
        _REFERENCES[variant] = run_steps(tiny_config(*VARIANTS[variant]), "dp=1", dataset, devices=jax.devices()[:1])
    return _REFERENCES[variant]


def _n(mesh: str) -> int:
    return math.prod(parse_mesh(mesh).values())


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("variant", ["mla", "dilated", "sketched"])
def test_variant_layout_matches_single_device(variant, mesh, dataset):
    ref = _reference(variant, dataset)
    got = run_steps(tiny_config(*VARIANTS[variant]), mesh, dataset, devices=jax.devices()[: _n(mesh)])
    assert ref["loss"][-1] < ref["loss"][0] - 0.1, "the reference run should learn something"
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5)
    np.testing.assert_allclose(got["grad_norm"], ref["grad_norm"], rtol=1e-4)
    assert_params_close(got["params"], ref["params"])


ONE_F_ONE_B = ("parallel.pipeline_schedule=1f1b", "parallel.sequence_attention=all_gather")


@pytest.mark.parametrize(
    "variant,schedule",
    [(v, ()) for v in ("mla", "dilated", "sketched")]
    + [(v, ONE_F_ONE_B) for v in ("mla", "sketched")],  # dilated + sp + 1f1b: refused
    ids=["mla-gpipe", "dilated-gpipe", "sketched-gpipe", "mla-1f1b", "sketched-1f1b"],
)
def test_variant_pipeline_and_sequence_parallel_match_single_device(variant, schedule, dataset):
    """Stages over pp carry the variant's parameters (and the sketches ride along the layer stack)."""
    ref = _reference(variant, dataset)
    mesh = "pp=2,sp=2,tp=2"
    got = run_steps(tiny_config(*VARIANTS[variant], *schedule), mesh, dataset, devices=jax.devices()[: _n(mesh)])
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5)
    assert_params_close(got["params"], ref["params"])


@pytest.mark.parametrize("mesh", ["sp=4", "dp=2,sp=4"])
def test_dilated_sequence_parallel_matches_single_device(mesh, dataset):
    """Segments of 4 fit a shard (16 / sp=4) and stay local; those of 8 and 16 span shards."""
    ref = _reference("dilated", dataset)
    got = run_steps(tiny_config(*VARIANTS["dilated"]), mesh, dataset, devices=jax.devices()[: _n(mesh)])
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5)
    assert_params_close(got["params"], ref["params"])


# --- jaxpar vs torchpar: same loss and gradients from the same weights -------------------------------


def _loss_alone(out):
    """loss_fn's loss; with experts it returns (loss, the experts' statistics)."""
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("variant", list(TWINS))
def test_variant_same_loss_and_gradients_as_torchpar(variant):
    cfg = tiny_config(*TWINS[variant])
    torch_model = Decoder(cfg.model)
    torch_model.init_weights(0)
    params = to_shared(torch_model.state_dict(), cfg.model.n_layer)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: JaxGPT(cfg.model, nnx.Rngs(0))))
    shapes = {".".join(map(str, path)): tuple(v.get_value().shape) for path, v in nnx.to_flat_state(state)}
    assert shapes == shared_shapes(cfg.model)
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, unflatten(params)))
    batch = np.random.default_rng(0).integers(0, 256, (4, cfg.data.seq_len + 1)).astype(np.int32)
    with jax.default_matmul_precision("highest"):
        loss_of = lambda s: _loss_alone(jax_loss(nnx.merge(graphdef, s), jnp.asarray(batch)))
        jloss, jgrads = jax.jit(jax.value_and_grad(loss_of))(state)
    jgrads = {k: np.asarray(v) for k, v in flatten(nnx.to_pure_dict(jgrads)).items()}

    model = Decoder(cfg.model)
    model.load_state_dict(from_shared(params, cfg.model.n_layer))
    tbatch = torch.from_numpy(batch).long()
    loss = next_token_loss(model(tbatch[:, :-1]), tbatch[:, 1:])
    loss.backward()
    np.testing.assert_allclose(loss.item(), float(jloss), rtol=1e-6)
    grads = to_shared({n: p.grad for n, p in model.named_parameters()}, cfg.model.n_layer)
    assert set(grads) == set(jgrads)
    diff = np.sqrt(sum(np.sum((grads[k] - v) ** 2) for k, v in jgrads.items()))
    total = np.sqrt(sum(np.sum(v**2) for v in jgrads.values()))
    assert diff / total < 1e-5


# --- MLA against an independent reference of DeepSeek-V2's equations ----------------------------------


def _rope_complex(x, theta):
    """RoPE as a complex rotation of (x_i, x_{i+r/2}) by position * theta^(-2i/r); x [T, r]."""
    T, r = x.shape
    z = x[:, : r // 2] + 1j * x[:, r // 2 :]
    z = z * np.exp(1j * np.arange(T)[:, None] * theta ** (-2.0 * np.arange(r // 2) / r))
    return np.concatenate([z.real, z.imag], axis=1)


def _mla_reference(x, p, cfg):
    """DeepSeek-V2 eqs. (9)-(19) for one sequence x [T, d], float64, head by head."""
    T, _ = x.shape
    k, r, kvl, eps = cfg.head_width, cfg.rope_head_dim, cfg.kv_latent_dim, cfg.layernorm_eps
    rms = lambda c, g: c / np.sqrt(np.mean(c**2, -1, keepdims=True) + eps) * g
    c_q = rms(x @ p["q_down"]["kernel"], p["q_norm"]["scale"])  # c^Q = W^DQ h
    c_kv = rms(x @ p["kv_down"]["kernel"][:, :kvl], p["kv_norm"]["scale"])  # c^KV = W^DKV h
    k_rope = _rope_complex(x @ p["kv_down"]["kernel"][:, kvl:], cfg.rope_theta)  # k^R = RoPE(W^KR h), shared
    out = np.zeros((T, cfg.d_model))
    for h in range(cfg.n_head):
        q_c = c_q @ p["q_up"]["kernel"][:, h, :k]  # q^C = W^UQ c^Q
        q_r = _rope_complex(c_q @ p["q_up"]["kernel"][:, h, k:], cfg.rope_theta)  # q^R = RoPE(W^QR c^Q)
        k_c = c_kv @ p["kv_up"]["kernel"][:, 0, h]  # k^C = W^UK c^KV
        v_c = c_kv @ p["kv_up"]["kernel"][:, 1, h]  # v^C = W^UV c^KV
        q, kk = np.concatenate([q_c, q_r], 1), np.concatenate([k_c, k_rope], 1)
        s = q @ kk.T / np.sqrt(k + r)
        s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
        a = np.exp(s - s.max(1, keepdims=True))
        out += (a / a.sum(1, keepdims=True)) @ v_c @ p["out"]["kernel"][h]  # u = W^O [o_1; ...; o_h]
    return out + p["out"]["bias"]


def test_mla_matches_deepseek_v2_equations():
    cfg = tiny_config(*VARIANTS["mla"]).model
    layer = MLAttention(cfg, nnx.Rngs(3), stack=())
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), nnx.to_pure_dict(nnx.state(layer, nnx.Param)))
    p["out"]["bias"] = np.random.default_rng(1).normal(0, 0.02, p["out"]["bias"].shape)
    nnx.update(layer, jax.tree.map(jnp.asarray, p))
    x = np.random.default_rng(0).normal(size=(2, 16, cfg.d_model))
    with jax.default_matmul_precision("highest"):
        got = np.asarray(layer(jnp.asarray(x, jnp.float32), jnp.float32))
    want = np.stack([_mla_reference(xb, p, cfg) for xb in x])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_mla_cache_width_is_latent_plus_rope():
    cfg = tiny_config(*VARIANTS["mla"]).model
    assert kv_cache_width(cfg) == 8 + 4 and kv_cache_width(tiny_config().model) == 2 * 32
    assert kv_cache_width(tiny_config(*VARIANTS["llama"]).model) == 2 * 2 * 8  # 2 kv heads of width 8


# --- dilated attention --------------------------------------------------------------------------------


def _qkv(shape=(2, 16, 4, 8), seed=0):
    return [jnp.asarray(a, jnp.float32) for a in np.random.default_rng(seed).normal(size=(3,) + shape)]


def test_dilated_one_segment_rate_one_is_causal_attention():
    q, k, v = _qkv()
    with jax.default_matmul_precision("highest"):
        got = dilated_attention(q, k, v, ((16, 1),))
        want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        longer = dilated_attention(q, k, v, ((64, 1),))  # a segment longer than the sequence: the sequence
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(longer, want, rtol=1e-5, atol=1e-6)


def test_dilated_equals_brute_force_union_softmax():
    """Query t of head h: one softmax over the keys of every pair that selects t (with multiplicity)."""
    pairs = ((4, 1), (8, 2), (16, 4))
    q, k, v = _qkv()
    with jax.default_matmul_precision("highest"):
        got = np.asarray(dilated_attention(q, k, v, pairs))
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, T, H, D = q.shape
    want = np.zeros_like(q)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                keys = [
                    j for w, r in pairs if (t % w) % r == h % r for j in range(t - t % w, t + 1) if (j % w) % r == h % r
                ]
                s = np.array([q[b, t, h] @ k[b, j, h] for j in keys]) / np.sqrt(D)
                a = np.exp(s - s.max())
                want[b, t, h] = (a / a.sum()) @ v[b, keys, h]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_dilated_whole_sequence_model_equals_mha_model():
    batch = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 17)), jnp.int32)
    losses = []
    for extra in ((), ("model.attention=dilated", "model.segment_lengths=16", "model.dilation_rates=1")):
        with jax.default_matmul_precision("highest"):
            losses.append(float(jax_loss(JaxGPT(tiny_config(*extra).model, nnx.Rngs(0)), batch)))
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6)


# --- sketched linear layers ---------------------------------------------------------------------------

_SKETCH_SCRIPT = """
import hashlib, random, sys
import numpy as np, torch
seed = int(sys.argv[1])
random.seed(seed); np.random.seed(seed); torch.manual_seed(seed)  # perturb every global RNG state
np.random.random(seed + 1)
from jaxpar.models.decoder import Decoder
from jaxpar.core.model.layer_rules import stacked_sketches
from torchpar.models.decoder import Decoder as TorchGPT
from tests.helpers import tiny_config
cfg = tiny_config('model.linear=sketched', 'model.sketch_seed=7').model
jax_side = stacked_sketches(cfg)
model = TorchGPT(cfg)
torch_side = {n: np.stack([model.blocks[i].mlp.get_submodule(n).sketch.numpy() for i in range(cfg.n_layer)])
              for n in ("fc", "proj")}
assert all(np.array_equal(jax_side[n], torch_side[n]) for n in jax_side)
print(hashlib.sha256(b"".join(jax_side[n].tobytes() for n in sorted(jax_side))).hexdigest())
"""


def test_sketch_identical_across_processes_and_frameworks():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONHASHSEED": "random"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    digests = [
        subprocess.run(
            [sys.executable, "-c", _SKETCH_SCRIPT, str(seed)],
            cwd=root,
            env=env,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        for seed in (1, 2)
    ]
    cfg = tiny_config("model.linear=sketched", "model.sketch_seed=7").model
    from jaxpar.core.model.layer_rules import stacked_sketches

    here = hashlib.sha256(b"".join(a.tobytes() for _, a in sorted(stacked_sketches(cfg).items()))).hexdigest()
    assert digests[0] == digests[1] == here
    other = tiny_config("model.linear=sketched", "model.sketch_seed=8").model
    assert not np.array_equal(sketch_matrix(cfg, 0, "fc"), sketch_matrix(other, 0, "fc"))
    assert not np.array_equal(sketch_matrix(cfg, 0, "fc"), sketch_matrix(cfg, 1, "fc"))


def test_sketch_is_not_trained_or_saved():
    cfg = tiny_config(*VARIANTS["sketched"])
    model = Decoder(cfg.model)
    model.init_weights(0)
    tbatch = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (2, 17))).long()
    next_token_loss(model(tbatch[:, :-1]), tbatch[:, 1:]).backward()
    fc = model.blocks[0].mlp.fc
    assert not fc.sketch.requires_grad and fc.sketch.grad is None and fc.factor.grad.abs().sum() > 0
    assert not any("sketch" in n for n, _ in model.named_parameters())
    assert not any("sketch" in n for n in [*model.state_dict(), *shared_shapes(cfg.model)])
    jax_model = JaxGPT(cfg.model, nnx.Rngs(0))
    params = flatten(nnx.to_pure_dict(nnx.state(jax_model, nnx.Param)))
    assert "blocks.mlp.fc.factor" in params and not any("sketch" in n or "kernel" in n for n in params if ".mlp." in n)
    grads = nnx.grad(lambda m: jax_loss(m, jnp.asarray(tbatch.numpy(), jnp.int32)))(jax_model)
    assert set(flatten(nnx.to_pure_dict(grads))) == set(params)
