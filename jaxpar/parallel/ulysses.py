"""Ulysses sequence parallelism (DeepSpeed-Ulysses).

Inside shard_map over `sp`, an all_to_all turns sequence-sharded q/k/v [b, T/N, h, d] into head-sharded [b, T, h/N, d],
every device runs full-sequence attention on its heads, and a second all_to_all turns the output back. Needs the
(per-tp-shard) head count divisible by sp (checked by sequence.check_sequence).
"""

from __future__ import annotations

import jax

from jaxpar.ops import causal_attention


def ulysses_attention(q, k, v, pos, seg, sinks=None, *, axis: str, n: int, window: int = 0):
    del n
    to_heads = lambda x: jax.lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)
    q, k, v = to_heads(q), to_heads(k), to_heads(v)
    if sinks is not None:  # this device's heads after the exchange: the axis index's share of its heads before
        sinks = jax.lax.dynamic_slice_in_dim(sinks, jax.lax.axis_index(axis) * q.shape[2], q.shape[2])
    # positions [seq] or per row [batch, seq]: shard order = the order all_to_all concatenates
    pos, seg = (None if t is None else jax.lax.all_gather(t, axis, axis=t.ndim - 1, tiled=True) for t in (pos, seg))
    y = causal_attention(q, k, v, pos, pos, seg, seg, window, sinks)
    return jax.lax.all_to_all(y, axis, split_axis=1, concat_axis=2, tiled=True)
