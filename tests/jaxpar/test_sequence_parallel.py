"""Sequence parallelism on `sp`.

Each attention strategy equals full causal attention (outputs and each of dQ, dK, dV), training runs equal the
one-device run, and bad input fails in one line.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.core.errors import UserError
from tests.helpers import assert_params_close, run_steps, tiny_config
from jaxpar.mesh import make_mesh
from jaxpar.layout import Layout
from jaxpar.parallel.sequence import sequence_attention, zigzag_order
from jaxpar.sharding import RULES

B, T, H, D = 2, 32, 8, 4  # T divisible by 2*8 (zig-zag at sp=8), H by 8 (Ulysses at sp=8)


def full_attention(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    s = jnp.where(jnp.tril(jnp.ones((q.shape[1], q.shape[1]), bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def sharded_attention(strategy, sp, zigzag):
    """Full-sequence attention in natural order, computed sequence-parallel on an sp mesh."""
    mesh = make_mesh({"sp": sp}, jax.devices()[:sp])
    order = zigzag_order(T, sp) if zigzag else np.arange(T)
    inverse = np.argsort(order)

    attention = sequence_attention(mesh, RULES, strategy)

    def f(q, k, v):
        y = attention(q[:, order], k[:, order], v[:, order], order if zigzag else None)
        return y[:, inverse]

    return f


@pytest.mark.parametrize("zigzag", [True, False], ids=["zigzag", "natural"])
@pytest.mark.parametrize("sp", [2, 4, 8])
@pytest.mark.parametrize("strategy", ["ring", "all_gather", "ulysses"])
def test_attention_equals_full_attention(strategy, sp, zigzag):
    q, k, v, dy = (jax.random.normal(key, (B, T, H, D), jnp.float32) for key in jax.random.split(jax.random.key(0), 4))
    ref, ref_vjp = jax.vjp(full_attention, q, k, v)
    f = sharded_attention(strategy, sp, zigzag)
    out, grads = jax.jit(lambda q, k, v, dy: (lambda o, vjp: (o, vjp(dy)))(*jax.vjp(f, q, k, v)))(q, k, v, dy)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
    for name, got, want in zip(("dQ", "dK", "dV"), grads, ref_vjp(dy)):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("strategy", ["ring", "all_gather", "ulysses"])
def test_attention_in_a_branch_one_pipeline_stage_takes(strategy):
    """As in the pipeline executor (manual over pp).

    Attention in the lax.switch branch that stage 0 takes while stage 1 idles. XLA:CPU joins a collective-permute's
    rendezvous across every device its pairs name, both stages' here, so ring's hops there are all_to_alls (sp=4:
    each device's pieces for the other two are zeros).
    """
    mesh = make_mesh({"pp": 2, "sp": 4}, jax.devices()[:8])
    attention = sequence_attention(mesh, RULES, strategy)

    def stages(q, k, v):
        out = jax.lax.switch(jax.lax.axis_index("pp"), [attention, lambda q, k, v: jnp.zeros_like(q)], q, k, v)
        return jax.lax.psum(out, "pp")

    f = jax.shard_map(stages, mesh=mesh, in_specs=(jax.P(),) * 3, out_specs=jax.P(), axis_names={"pp"}, check_vma=False)
    q, k, v, dy = (jax.random.normal(key, (B, T, H, D), jnp.float32) for key in jax.random.split(jax.random.key(1), 4))
    ref, ref_vjp = jax.vjp(full_attention, q, k, v)
    out, grads = jax.jit(lambda q, k, v, dy: (lambda o, vjp: (o, vjp(dy)))(*jax.vjp(f, q, k, v)))(q, k, v, dy)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
    for name, got, want in zip(("dQ", "dK", "dV"), grads, ref_vjp(dy)):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=name)


RUNS = [
    ("sp=4,dp=2", ()),
    ("sp=2,fsdp=2,tp=2", ()),
    ("pp=2,sp=2,dp=2", ()),
    ("sp=2,fsdp=2,tp=2", ("parallel.sequence_attention=ulysses", "parallel.sequence_zigzag=false")),
]


@pytest.mark.parametrize(
    "mesh,extra",
    RUNS,
    ids=[
        "sp=4,dp=2",
        "sp=2,fsdp=2,tp=2",
        "pp=2,sp=2,dp=2",
        "sp=2,fsdp=2,tp=2,sequence_attention=ulysses,sequence_zigzag=false",
    ],
)
def test_training_matches_single_device(mesh, extra, dataset, reference):
    got = run_steps(tiny_config(*extra), mesh, dataset, devices=jax.devices()[:8])
    np.testing.assert_allclose(got["loss"], reference["loss"], rtol=1e-5)
    np.testing.assert_allclose(got["grad_norm"], reference["grad_norm"], rtol=1e-4)
    assert_params_close(got["params"], reference["params"])


ERRORS = [
    ("sp=4,dp=2", ("data.seq_len=12",), "data.seq_len=12 is not divisible by 2*sp=8 (zig-zag)"),
    ("sp=8", ("data.seq_len=12", "parallel.sequence_zigzag=false"), "data.seq_len=12 is not divisible by sp=8"),
    ("sp=8", ("parallel.sequence_attention=ulysses",), "model.n_head=4 is not divisible by tp*sp=8"),
    ("sp=4,tp=2", ("parallel.sequence_attention=ulysses",), "model.n_head=4 is not divisible by tp*sp=8"),
]


@pytest.mark.parametrize("mesh,extra,message", ERRORS)
def test_bad_sequence_layout_is_one_line(mesh, extra, message):
    cfg = tiny_config(*extra)
    with pytest.raises(UserError) as e:
        Layout(
            cfg, make_mesh(dict((k, int(v)) for k, v in (kv.split("=") for kv in mesh.split(","))), jax.devices()[:8])
        )
    assert message in str(e.value) and "\n" not in str(e.value)
