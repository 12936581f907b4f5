"""Ring attention (Liu et al. 2023) inside shard_map over the `sp` axis.

Each device keeps its queries; K/V blocks travel around the ring with `lax.ppermute` (N-1 hops),
and the output is accumulated blockwise with an online softmax (running max `m` and
denominator `l`), so no device ever holds more than one [T/N, T/N] score block.

Causal masking uses the global positions that travel with each K/V block, so any token order
works. Each local block is split in two halves on both sides, and a half-pair whose keys are
all in the future of its queries is skipped (`lax.cond`): with zig-zag order (device i holds
chunks i and 2N-1-i) every off-diagonal step then does exactly half the work on every device —
the causal load balance. Without zig-zag, device i skips whole blocks from devices j > i.
With packed documents (data.document_mask) positions and segment ids are per row and travel alike, and a
half-pair is skipped when none of its queries sees a key of its own document.

Backward is a custom VJP that saves only q, k, v, the output and the log-sum-exp (O(T/N) per
device): it recomputes each score block, and dK/dV accumulators travel around the ring with
their K/V block, arriving home after N hops.

A hop is a `ppermute`, or with exchange="all_to_all" an `all_to_all` in which each device's only non-zero piece goes
to its successor: the pipeline executor runs the layers in one branch of a `lax.switch` per tick, taken by one pp
stage's devices alone, and XLA:CPU joins a collective-permute's rendezvous across every device its source-target
pairs name (all of pp x sp), so a ppermute there waits on, or is matched with, another stage's at another tick
(wrong values); an all_to_all's rendezvous is its sp group's. At sp=2 it moves the same bytes as the ppermute; at
sp=N it moves N-1 times as many (the zero pieces).
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

from jaxpar.ops import visible

F32 = jnp.float32
NEG = -1e30  # finite "minus infinity": a fully masked row never makes NaNs


def _halves(x, axis: int):
    """Two halves along `axis` (one piece when the length is odd).

    Positions and segment ids (pos, seg) along their last axis, seq.
    """
    if isinstance(x, tuple):
        pos, seg = x
        halves = _halves(pos, pos.ndim - 1)
        return list(zip(halves, [None] * len(halves) if seg is None else _halves(seg, seg.ndim - 1)))
    n = x.shape[axis]
    if n % 2:
        return [x]
    return [jax.lax.slice_in_dim(x, i * (n // 2), (i + 1) * (n // 2), axis=axis) for i in range(2)]


def _visible(qp, kp):
    """Does any query see any key? qp, kp: (positions, segment ids or None)."""
    if qp[1] is None:
        return jnp.max(qp[0]) >= jnp.min(kp[0])
    return jnp.any(visible(qp[0], kp[0], qp[1], kp[1]))


def _scores(q, k, qp, kp, scale):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=F32) * scale
    return s, visible(qp[0], kp[0], qp[1], kp[1])


def _fwd_block(state, q, k, v, qp, kp, scale):
    o, m, l = state  # [b,h,q,d], [b,h,q], [b,h,q]
    s, mask = _scores(q, k, qp, kp, scale)
    m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, NEG), axis=-1))
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    corr = jnp.exp(m - m_new)
    o = o * corr[..., None] + jnp.einsum("bhqk,bkhd->bhqd", p, v.astype(F32))
    return o, m_new, l * corr + jnp.sum(p, axis=-1)


def _bwd_block(acc, q, do, lse, delta, k, v, qp, kp, scale):
    dq, dk, dv = acc  # [b,q,h,d], [b,k,h,d], [b,k,h,d] float32
    s, mask = _scores(q, k, qp, kp, scale)
    p = jnp.where(mask, jnp.exp(s - lse[..., None]), 0.0)
    dv = dv + jnp.einsum("bhqk,bqhd->bkhd", p, do)
    dp = jnp.einsum("bqhd,bkhd->bhqk", do, v.astype(F32))
    ds = p * (dp - delta[..., None]) * scale
    dq = dq + jnp.einsum("bhqk,bkhd->bqhd", ds, k.astype(F32))
    dk = dk + jnp.einsum("bhqk,bqhd->bkhd", ds, q.astype(F32))
    return dq, dk, dv


def _rotate(x, axis: str, n: int, exchange: str):
    """Each device's block (a pytree) to device i+1 of `axis`, as the module docstring's `exchange` says."""
    with jax.named_scope("ring_hop"):
        if exchange == "ppermute":
            return jax.lax.ppermute(x, axis, [(i, (i + 1) % n) for i in range(n)])
        i = jax.lax.axis_index(axis)

        def one(a):
            to = (jnp.arange(n) == (i + 1) % n).reshape((n,) + (1,) * a.ndim)
            got = jax.lax.all_to_all(jnp.where(to, a[None], jnp.zeros((), a.dtype)), axis, 0, 0, tiled=True)
            return jax.lax.dynamic_index_in_dim(got, (i - 1) % n, keepdims=False)  # the predecessor's piece

        return jax.tree.map(one, x)


def _forward(q, k, v, pos, axis, n, exchange):
    b, t, h, d = q.shape
    scale = 1.0 / math.sqrt(d)
    qs, qps = _halves(q, 1), _halves(pos, 0)
    init = [
        (
            jnp.zeros((b, h, x.shape[1], d), F32),
            jnp.full((b, h, x.shape[1]), NEG, F32),
            jnp.zeros((b, h, x.shape[1]), F32),
        )
        for x in qs
    ]

    def step(states, kv):
        k, v, kp = kv
        out = []
        for qh, qph, st in zip(qs, qps, states):
            for kh, vh, kph in zip(_halves(k, 1), _halves(v, 1), _halves(kp, 0)):
                st = jax.lax.cond(
                    _visible(qph, kph), partial(_fwd_block, scale=scale), lambda st, *_: st, st, qh, kh, vh, qph, kph
                )
            out.append(st)
        return out

    def hop(carry, _):
        states, kv = carry
        kv = _rotate(kv, axis, n, exchange)
        return (step(states, kv), kv), None

    states = step(init, (k, v, pos))
    (states, _), _ = jax.lax.scan(hop, (states, (k, v, pos)), None, length=n - 1)
    o = jnp.concatenate([o / l[..., None] for o, _, l in states], axis=2)
    lse = jnp.concatenate([m + jnp.log(l) for _, m, l in states], axis=2)
    return jnp.einsum("bhqd->bqhd", o).astype(q.dtype), lse


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _ring(q, k, v, pos, axis, n, exchange):
    return _forward(q, k, v, pos, axis, n, exchange)[0]


def _ring_fwd(q, k, v, pos, axis, n, exchange):
    out, lse = _forward(q, k, v, pos, axis, n, exchange)
    return out, (q, k, v, pos, out, lse)


def _ring_bwd(axis, n, exchange, res, do):
    q, k, v, pos, out, lse = res
    scale = 1.0 / math.sqrt(q.shape[-1])
    do = do.astype(F32)
    delta = jnp.einsum("bqhd,bqhd->bhq", do, out.astype(F32))
    split = lambda x, ax: _halves(x, ax)
    qs, dos, qps, lses, deltas = split(q, 1), split(do, 1), split(pos, 0), split(lse, 2), split(delta, 2)

    def step(dqs, kv, dkv):
        k, v, kp = kv
        ks, vs, kps = split(k, 1), split(v, 1), split(kp, 0)
        dks, dvs = split(dkv[0], 1), split(dkv[1], 1)
        dqs = list(dqs)
        for i, (qh, doh, qph, lseh, dh) in enumerate(zip(qs, dos, qps, lses, deltas)):
            for j, (kh, vh, kph) in enumerate(zip(ks, vs, kps)):
                dqs[i], dks[j], dvs[j] = jax.lax.cond(
                    _visible(qph, kph),
                    partial(_bwd_block, scale=scale),
                    lambda acc, *_: acc,
                    (dqs[i], dks[j], dvs[j]),
                    qh,
                    doh,
                    lseh,
                    dh,
                    kh,
                    vh,
                    qph,
                    kph,
                )
        return dqs, (jnp.concatenate(dks, axis=1), jnp.concatenate(dvs, axis=1))

    def hop(carry, _):
        dqs, kv, dkv = carry
        kv, dkv = _rotate((kv, dkv), axis, n, exchange)
        dqs, dkv = step(dqs, kv, dkv)
        return (dqs, kv, dkv), None

    zeros = jnp.zeros(k.shape, F32)
    dqs, dkv = step([jnp.zeros(x.shape, F32) for x in qs], (k, v, pos), (zeros, zeros))
    (dqs, _, dkv), _ = jax.lax.scan(hop, (dqs, (k, v, pos), dkv), None, length=n - 1)
    dk, dv = _rotate(dkv, axis, n, exchange)  # the N-th hop brings each block's gradients home
    return jnp.concatenate(dqs, axis=1).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(q, k, v, pos, seg, sinks=None, *, axis: str, n: int, exchange: str = "ppermute"):
    """Ring attention over the `n` devices of `axis`, called inside shard_map.

    q, k, v [b, T/N, h, d] and their global positions [T/N] on each device, or with segment ids [b, T/N] (packed
    documents) both per row. `exchange`: how a block hops, "ppermute" or "all_to_all" (inside a branch that some
    devices do not take: the module docstring). `sinks`: always None (sequence.check_window refuses them here).
    """
    return _ring(q, k, v, (pos, seg), axis, n, exchange)
