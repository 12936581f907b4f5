"""Sequence (context) parallelism on the `sp` mesh axis: attention across sequence shards.

Every activation's sequence dimension is sharded over `sp` by the rules table ("seq" -> sp).
Only attention mixes positions, so only attention needs manual collectives; the strategy is
`parallel.sequence_attention`:
  ring        K/V blocks rotate around the ring, online softmax (ring_attention.py)
  all_gather  K/V gathered along sp, local queries attend to all of them (the simple baseline)
  ulysses     all_to_all from sequence- to head-sharding and back (ulysses.py)

Zig-zag (`parallel.sequence_zigzag`): the token order is permuted once at the loss input
(jaxpar/loss.py) so device i holds chunks i and 2N-1-i of 2N; attention masks by the true (global)
positions, so every device does the same causal work. `sequence_attention` returns the function
jaxpar/parallelize.py puts in the parallel context; the model never sees the mesh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.context import tracing_mesh
from jaxpar.core.errors import UserError
from jaxpar.ops import causal_attention
from jaxpar.parallel.ring_attention import ring_attention
from jaxpar.parallel.ulysses import ulysses_attention
from jaxpar.sharding import spec_for

STRATEGIES = ("ring", "all_gather", "ulysses")
AXIS = "sp"


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
        raise UserError(
            f"model.n_head={n_head} is not divisible by tp*sp={sizes['tp'] * sp} "
            f"(ulysses attention shards heads over sp)"
        )


def check_window(window: int, strategy: str, sinks: bool = False) -> None:
    """model.sliding_window and model.attention_sinks across sp shards: all_gather and ulysses; ring is not built."""
    for what, on in ((f"model.sliding_window={window}", window), ("model.attention_sinks=true", sinks)):
        if on and strategy == "ring":
            raise UserError(
                f"{what} with parallel.sequence_attention=ring: ring attention is not built with it; use "
                "parallel.sequence_attention=all_gather or ulysses"
            )


def zigzag_order(T: int, n: int) -> np.ndarray:
    """Permutation of range(T): device i's contiguous shard holds chunks i and 2n-1-i of 2n."""
    if T % (2 * n):
        raise UserError(f"sequence length {T} is not divisible by 2*sp={2 * n} (zig-zag)")
    c = T // (2 * n)
    chunks = [j for i in range(n) for j in (i, 2 * n - 1 - i)]
    return np.concatenate([np.arange(j * c, (j + 1) * c) for j in chunks])


def all_gather_attention(q, k, v, pos, seg, sinks=None, *, axis: str, n: int, window: int = 0):
    """Inside shard_map: local queries against K/V gathered along the sequence axis."""
    del n
    gather = lambda x, dim: jax.lax.all_gather(x, axis, axis=dim, tiled=True)
    k_seg = None if seg is None else gather(seg, 1)
    return causal_attention(q, gather(k, 1), gather(v, 1), pos, gather(pos, pos.ndim - 1), seg, k_seg, window, sinks)


def in_pipeline_branch() -> bool:
    """Traced inside the pipeline executor's shard_map, manual over pp (jaxpar/pipeline/executor.py)?"""
    return "pp" in jax.sharding.get_abstract_mesh().manual_axes


def sequence_attention(mesh, rules, strategy: str):
    """attention(q, k, v, positions, segments) over the sp shards of `mesh`.

    `positions` [seq] are the global positions of the (possibly permuted) sequence, None for natural order; with
    segment ids [batch, seq] (packed documents) both are per row, sharded as the activations' first two dimensions.
    """
    if strategy not in STRATEGIES:
        raise UserError(f"sequence attention {strategy!r} is not one of {', '.join(STRATEGIES)}")
    fn = {"ring": ring_attention, "all_gather": all_gather_attention, "ulysses": ulysses_attention}[strategy]
    n = mesh.shape[AXIS]

    def attention(q, k, v, positions=None, segments=None, window: int = 0, sinks=None):
        T = q.shape[1]
        check_sequence(T, q.shape[2], mesh.shape, strategy, zigzag=False)
        check_window(window, strategy, sinks is not None)
        band = {"window": window} if window else {}
        spec = spec_for(("batch", "seq", "heads", "kv"), q.shape, mesh, rules)
        if spec[1] != AXIS:
            raise UserError(f"the rules table must map the sequence dimension to {AXIS!r} for sequence parallelism")
        rows = jax.P(*spec[:2])  # per-row positions and segment ids: [batch, seq]
        # in the hand-scheduled executor (manual over pp) the layers run in a branch one stage takes: ring's hops
        # must not be collective-permutes there (ring_attention.py)
        hops = {"exchange": "all_to_all"} if strategy == "ring" and in_pipeline_branch() else {}
        sharded = jax.shard_map(
            lambda *a: fn(*a, axis=AXIS, n=n, **hops, **band),
            mesh=tracing_mesh(mesh),
            out_specs=spec,
            in_specs=(spec, spec, spec, rows if segments is not None else jax.P(AXIS), rows, jax.P(spec[2])),
            check_vma=False,
        )
        positions = jnp.asarray(jnp.arange(T) if positions is None else positions, jnp.int32)
        return sharded(q, k, v, positions, segments, sinks)  # sinks [heads]: split as the heads are

    return attention
