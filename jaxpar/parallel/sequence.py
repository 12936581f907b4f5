"""Sequence (context) parallelism on the `sp` mesh axis: the attention dispatcher the model calls.

Every activation's sequence dimension is sharded over `sp` by the rules table ("seq" -> sp).
Only attention mixes positions, so only attention needs manual collectives; the strategy is
`parallel.sequence_attention`:
  ring        K/V blocks rotate around the ring, online softmax (ring_attention.py)
  all_gather  K/V gathered along sp, local queries attend to all of them (the simple baseline)
  ulysses     all_to_all from sequence- to head-sharding and back (ulysses.py)

Zig-zag (`parallel.sequence_zigzag`): the token order is permuted once at the loss input so
device i holds chunks i and 2N-1-i of 2N; attention masks by the true (global) positions, so
every device does the same causal work. The loss is a mean over tokens, so it is unchanged.

Model code stays mesh-free: it calls `attention` and `sequence_order`, which read the active
mesh from jaxpar.sharding and the options from `use_sequence`; with no mesh or sp == 1 they are
plain `jax.nn.dot_product_attention` and the identity order.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.errors import UserError
from jaxpar.sharding import _ACTIVE, spec_for, tracing_mesh

STRATEGIES = ("ring", "all_gather", "ulysses")
AXIS = "sp"


@dataclass(frozen=True)
class SequenceOptions:
    attention: str = "ring"
    zigzag: bool = True


_OPTIONS: contextvars.ContextVar = contextvars.ContextVar("jaxpar_sequence", default=SequenceOptions())


@contextlib.contextmanager
def use_sequence(attention: str = "ring", zigzag: bool = True):
    if attention not in STRATEGIES:
        raise UserError(f"sequence attention {attention!r} is not one of {', '.join(STRATEGIES)}")
    token = _OPTIONS.set(SequenceOptions(attention, zigzag))
    try:
        yield
    finally:
        _OPTIONS.reset(token)


def check_sequence(seq_len: int, n_head: int, sizes, attention: str, zigzag: bool) -> None:
    """The divisibility sequence parallelism needs, as one line each (sizes: mesh axis -> size)."""
    sp = sizes["sp"]
    if sp == 1:
        return
    chunks = 2 * sp if zigzag else sp
    if seq_len % chunks:
        what = f"2*sp={chunks} (zig-zag)" if zigzag else f"sp={sp}"
        raise UserError(f"data.seq_len={seq_len} is not divisible by {what}")
    if attention == "ulysses" and n_head % (sizes["tp"] * sp):
        raise UserError(f"model.n_head={n_head} is not divisible by tp*sp={sizes['tp'] * sp} "
                        f"(ulysses attention shards heads over sp)")


def _sp_mesh():
    active = _ACTIVE.get()
    if active is None or active[0].shape.get(AXIS, 1) == 1:
        return None
    return active


def zigzag_order(T: int, n: int) -> np.ndarray:
    """Permutation of range(T): device i's contiguous shard holds chunks i and 2n-1-i of 2n."""
    if T % (2 * n):
        raise UserError(f"sequence length {T} is not divisible by 2*sp={2 * n} (zig-zag)")
    c = T // (2 * n)
    chunks = [j for i in range(n) for j in (i, 2 * n - 1 - i)]
    return np.concatenate([np.arange(j * c, (j + 1) * c) for j in chunks])


def sequence_order(T: int) -> np.ndarray | None:
    """The token order the loss should feed the model (None: natural order)."""
    active = _sp_mesh()
    if active is None or not _OPTIONS.get().zigzag:
        return None
    return zigzag_order(T, active[0].shape[AXIS])


def local_attention(q, k, v, q_pos=None, k_pos=None):
    """Causal attention on one device; by global positions when given (permuted or partial)."""
    if q_pos is None:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)
    mask = q_pos[:, None] >= k_pos[None, :]
    return jax.nn.dot_product_attention(q, k, v, mask=mask[None, None])


def all_gather_attention(q, k, v, pos, *, axis: str, n: int):
    """Inside shard_map: local queries against K/V gathered along the sequence axis."""
    del n
    gather = lambda x, dim: jax.lax.all_gather(x, axis, axis=dim, tiled=True)  # noqa: E731
    return local_attention(q, gather(k, 1), gather(v, 1), pos, gather(pos, 0))


def attention(q, k, v, positions=None):
    """Causal attention on q, k, v [batch, seq, heads, head_dim]; `positions` [seq] are the global
    positions of the (possibly permuted) sequence. Sharded over `sp` when the active mesh has it."""
    active = _sp_mesh()
    if active is None:
        return local_attention(q, k, v, positions, positions)
    from jaxpar.parallel.ring_attention import ring_attention
    from jaxpar.parallel.ulysses import ulysses_attention

    mesh, rules = active
    n, T = mesh.shape[AXIS], q.shape[1]
    opts = _OPTIONS.get()
    check_sequence(T, q.shape[2], mesh.shape, opts.attention, zigzag=False)
    if positions is None:
        positions = jnp.arange(T)
    spec = spec_for(("batch", "seq", "heads", "kv"), q.shape, mesh, rules)
    if spec[1] != AXIS:
        raise UserError(f"the rules table must map the sequence dimension to {AXIS!r} for sequence parallelism")
    fn = {"ring": ring_attention, "all_gather": all_gather_attention, "ulysses": ulysses_attention}[opts.attention]
    sharded = jax.shard_map(lambda *a: fn(*a, axis=AXIS, n=n), mesh=tracing_mesh(mesh),
                            in_specs=(spec, spec, spec, jax.P(AXIS)), out_specs=spec, check_vma=False)
    return sharded(q, k, v, jnp.asarray(positions, jnp.int32))
