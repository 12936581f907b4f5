"""optim.name=muon in jaxpar (jaxpar/optim.py, jaxpar/core/optimizer/muon.py).

Each matrix of a stacked tensor orthogonalised on its own, a sharded layout equal to one device over 10 steps, and a run
that stops and resumes exactly (and is refused if it resumes as another optimizer). Its conversion to torchpar:
tests/e2e/test_convert_state.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.core.optimizer import muon
from jaxpar.optim import orthogonalize
from tests.helpers import assert_params_close, assert_resumes_exactly, run_cli, run_steps, tiny_config

MUON = ("optim.name=muon",)


def test_stacked_layers_experts_and_qkv_are_matrices_of_their_own():
    """A [layers, embed, 3, heads, head_dim] kernel is 2 x 3 matrices [embed, heads*head_dim].

    The same as each orthogonalised alone; the whole tensor read as one matrix is something else.
    """
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 32, 3, 4, 8)), jnp.float32)
    axes = muon.stacked_axes("blocks.attn.qkv.kernel")
    assert axes == ((1,), (3, 4))
    got = orthogonalize(x, axes, 5)
    for layer in range(2):
        for part in range(3):
            alone = orthogonalize(x[layer, :, part].reshape(32, 32), ((0,), (1,)), 5).reshape(32, 4, 8)
            np.testing.assert_allclose(got[layer, :, part], alone, atol=1e-5)
    one_matrix = orthogonalize(x, ((0, 1), (2, 3, 4)), 5)
    assert float(jnp.abs(one_matrix - got).max()) > 0.1
    # each expert too: [layers, experts, in, out]; the router, embeddings, norms and biases are not Muon's
    assert muon.stacked_axes("blocks.moe.gate") == ((2,), (3,))
    assert not any(
        muon.stacked_axes(n)
        for n in ("wte", "wpe", "lm_head", "blocks.moe.router.kernel", "blocks.ln1.scale", "blocks.attn.qkv.bias")
    )


def test_the_update_does_not_depend_on_the_layout_hint(monkeypatch):
    """jax 0.11 has no shard_alike, and optim.py then leaves the update's layout to GSPMD.

    On an fsdp=4 mesh the values must be those with the hint (it moves each result to its parameter's layout, never
    a value).
    """
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxpar import optim
    from jaxpar.context import ParallelContext, use

    mesh = jax.make_mesh((4,), ("fsdp",), (jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])
    rng = np.random.default_rng(0)
    shapes, axes = [(2, 16, 24), (24, 16), (3, 8, 8)], [((1,), (2,)), ((0,), (1,)), ((1,), (2,))]
    rows = [NamedSharding(mesh, P(*[None] * (len(s) - 2), "fsdp", None)) for s in shapes]  # as fsdp shards them
    ws = [jax.device_put(rng.standard_normal(s).astype(np.float32), r) for s, r in zip(shapes, rows)]
    grads = [jnp.asarray(rng.standard_normal(s).astype(np.float32)) for s in shapes]

    def update():
        with use(ParallelContext(mesh=mesh)):
            return jax.jit(lambda g, w: optim.orthogonalize_all(g, axes, 5, w))(grads, ws)

    hinted = update()
    monkeypatch.setattr(optim, "shard_alike", None)
    for got, want, w in zip(update(), hinted, ws):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        assert want.sharding.is_equivalent_to(w.sharding, w.ndim)  # the hint acted where it exists


@pytest.fixture(scope="module")
def muon_reference(dataset):
    return run_steps(tiny_config(*MUON), "dp=1", dataset, devices=jax.devices()[:1])


@pytest.mark.parametrize(
    "mesh,extra", [("dp=2,fsdp=2,tp=2", ()), ("fsdp=2,ep=2", ("model.moe_experts=4", "model.moe_d_ff=16"))]
)
def test_layout_matches_one_device(mesh, extra, dataset, muon_reference, reference):
    n = int(np.prod([int(p.split("=")[1]) for p in mesh.split(",")]))
    ref = (
        muon_reference
        if not extra
        else run_steps(tiny_config(*MUON, *extra), "dp=1", dataset, devices=jax.devices()[:1])
    )
    got = run_steps(tiny_config(*MUON, *extra), mesh, dataset, devices=jax.devices()[:n])
    assert ref["loss"][-1] < ref["loss"][0] - 0.1, "the reference run should learn something"
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5)
    np.testing.assert_allclose(got["grad_norm"], ref["grad_norm"], rtol=1e-4)
    assert_params_close(got["params"], ref["params"])
    if not extra:  # the setting is acted on: AdamW's run (tests/conftest.py) goes elsewhere from step 2
        assert np.abs(np.array(reference["loss"][1:]) - ref["loss"][1:]).min() > 1e-4


def test_resume_after_sigkill_is_exact_and_the_optimizer_cannot_change(tmp_path, dataset):
    args = [*MUON, "checkpoint.every=3"]
    assert_resumes_exactly(tmp_path, dataset, args, kill_after=4)
    other = run_cli(tmp_path / "k", dataset, "checkpoint.every=3", "train.steps=12")
    assert other.returncode == 2, other.stderr
    line = other.stderr.strip().splitlines()[-1]
    assert "optim.name: 'muon' -> 'adamw'" in line, other.stderr
