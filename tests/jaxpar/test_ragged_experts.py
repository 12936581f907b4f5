"""model.moe_ragged: the experts multiply the rows routed to them alone, by grouped matmuls, in both frameworks.

jaxpar's ragged_experts (jax.lax.ragged_dot over the kept choices sorted by expert) equals the padded buffer in value
and gradient (its forward against numpy: tests/jaxpar/test_moe.py's dispatch test); the traced step counts the routed
rows' FLOPs, not experts x slots; on a mesh (dp x tp: the width split, fsdp) a ragged run equals the padded one on one
device; ep > 1 is refused in one line. torchpar's torch._grouped_mm equals its loop over the experts (which the twins
in tests/jaxpar/test_variants.py hold to jaxpar).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.core.errors import UserError
from jaxpar.parallel.expert_dispatch import local_experts, ragged_experts
from tests.helpers import assert_params_close, run_steps, tiny_config

B, T, D, E, F, K = 2, 6, 8, 4, 8, 2
# experts with biases and gpt-oss's clamp (a limit the products reach), some choices dropped
ACTIVATION = ("gpt_oss", 1.5, 1.702)


def _routing(seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, T, D)).astype(np.float32)
    w = {
        n: rng.normal(size=s).astype(np.float32)
        for n, s in (("gate", (E, D, F)), ("up", (E, D, F)), ("down", (E, F, D)))
    }
    w.update(
        {n: rng.normal(size=(E, s)).astype(np.float32) for n, s in (("gate_bias", F), ("up_bias", F), ("down_bias", D))}
    )
    ids = np.stack([rng.permutation(E)[:K] for _ in range(B * T)]).reshape(B, T, K)
    weights = rng.uniform(size=(B, T, K)).astype(np.float32)
    kept = rng.uniform(size=(B, T, K)) > 0.3
    return jnp.asarray(x), jnp.asarray(ids), jnp.asarray(weights), jnp.asarray(kept), jax.tree.map(jnp.asarray, w)


def test_ragged_experts_have_the_padded_buffers_gradients():
    x, ids, weights, kept, w = _routing()
    assert 0 < int(kept.sum()) < kept.size  # some choices dropped, some kept

    def loss(experts):
        return lambda x, w: jnp.sum(jnp.sin(experts(x, ids, weights, kept, w, 0, ACTIVATION)))

    with jax.default_matmul_precision("highest"):
        (pv, pg), (rv, rg) = (
            jax.value_and_grad(loss(f), argnums=(0, 1))(x, w) for f in (local_experts, ragged_experts)
        )
    np.testing.assert_allclose(rv, pv, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(rg), jax.tree.leaves(pg)):
        np.testing.assert_allclose(a, b, atol=1e-5 * max(float(jnp.abs(b).max()), 1.0))


def test_the_ragged_step_counts_the_routed_rows_alone():
    """3 projections x (forward, two backward products) x 2 x (B T k rows) x D x F, against experts x slots padded."""
    from jaxpar.cost.jaxpr_flops import matmul_flops

    x, ids, weights, kept, w = _routing()

    def flops(experts):
        f = jax.grad(lambda x, w: jnp.sum(jnp.sin(experts(x, ids, weights, kept, w, 0, ACTIVATION))), argnums=(0, 1))
        return matmul_flops(jax.make_jaxpr(f)(x, w).jaxpr)

    rows, padded_rows = B * T * K, E * B * T  # dropless: every expert keeps a slot for each of the N tokens
    assert flops(ragged_experts) == 3 * 3 * 2 * rows * D * F
    assert flops(local_experts) == 3 * 3 * 2 * padded_rows * D * F


MOE = (
    "model.family=llama",
    "model.n_kv_head=2",
    "model.moe_experts=4",
    "model.moe_top_k=2",
    "model.moe_d_ff=16",
    "model.moe_expert_bias=true",
    "model.moe_activation=gpt_oss",
    "model.moe_swiglu_limit=0.05",
    "optim.lr=1e-3",
    "optim.min_lr=1e-4",
)
_REFERENCE: dict = {}


@pytest.mark.parametrize("mesh", ["dp=2,tp=2", "fsdp=2"])
def test_ragged_on_a_mesh_equals_the_padded_buffer_on_one_device(mesh, dataset):
    if "ref" not in _REFERENCE:
        _REFERENCE["ref"] = run_steps(tiny_config(*MOE), "dp=1", dataset, devices=jax.devices()[:1])
    ref = _REFERENCE["ref"]
    n = math.prod(int(p.split("=")[1]) for p in mesh.split(","))
    got = run_steps(tiny_config(*MOE, "model.moe_ragged=true"), mesh, dataset, devices=jax.devices()[:n])
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5)
    assert_params_close(got["params"], ref["params"])


def test_ragged_over_ep_is_refused_in_one_line():
    from jaxpar.checks import divisibility

    sizes = {"dp": 1, "fsdp": 1, "tp": 1, "pp": 1, "sp": 1, "ep": 2}
    with pytest.raises(UserError, match="model.moe_ragged with ep=2") as e:
        divisibility(tiny_config(*MOE, "model.moe_ragged=true"), sizes)
    assert "\n" not in str(e.value)


def test_torchpar_grouped_matmuls_equal_its_loop():
    """torch._grouped_mm over the groups equals the loop over the experts, in value and gradient."""
    import torch

    from torchpar.models.moe import Experts

    cfg = tiny_config(*MOE, "model.d_model=32").model
    counts = [5, 0, 9, 4]  # an expert without rows among them
    rows = torch.from_numpy(np.random.default_rng(2).normal(size=(sum(counts), cfg.d_model)).astype(np.float32))
    outs = []
    for ragged in (False, True):
        torch.manual_seed(0)
        experts = Experts(tiny_config(*MOE, "model.d_model=32", f"model.moe_ragged={ragged}").model, E)
        with torch.no_grad():
            for p in experts.parameters():
                p.copy_(torch.randn_like(p))
        h = rows.clone().requires_grad_()
        y = experts(h, counts)
        y.sin().sum().backward()
        outs.append((y.detach(), h.grad, {n: p.grad for n, p in experts.named_parameters()}))
    (y0, h0, g0), (y1, h1, g1) = outs
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h1, h0, rtol=1e-5, atol=1e-5)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-5, atol=1e-5, msg=name)
    assert float(g1["gate"][1].abs().max()) == 0.0  # the expert without rows: a zero gradient, as DDP wants


def test_the_setting_chooses_each_frameworks_kernels(monkeypatch):
    """model.moe_ragged: jaxpar's traced loss has ragged dots and torchpar calls torch._grouped_mm, else neither."""
    import torch
    from flax import nnx

    from jaxpar.layout import Layout
    from jaxpar.loss import loss_fn
    from jaxpar.mesh import make_mesh
    from jaxpar.models.decoder import Decoder
    from jaxpar.parallelize import parallel_context
    from jaxpar.context import use
    from torchpar.models.decoder import Decoder as TorchDecoder

    calls, grouped = [], torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or grouped(*a, **k))
    for ragged in (False, True):
        cfg = tiny_config(*MOE, f"model.moe_ragged={ragged}")
        layout = Layout(cfg, make_mesh({"dp": 1}, jax.devices()[:1]))
        model = Decoder(cfg.model, nnx.Rngs(0))
        batch = jnp.zeros((2, cfg.data.seq_len + 1), jnp.int32)
        with use(parallel_context(layout)):
            jaxpr = str(jax.make_jaxpr(lambda: loss_fn(model, batch))())
        assert ("ragged_dot_general" in jaxpr) == ragged
        calls.clear()
        TorchDecoder(cfg.model)(torch.zeros((2, cfg.data.seq_len), dtype=torch.long))
        assert len(calls) == (3 * cfg.model.n_layer if ragged else 0)
