"""Dilated attention (LongNet, arXiv:2307.02486), causal, as the core of an MHA layer. Mesh-free.

For each (segment length w, dilation rate r) pair: the sequence is cut into segments of
w' = min(w, T) tokens, and in each segment head h keeps the tokens at offsets i with
i % r == h % r (heads see different dilation phases); those w'/r tokens attend causally among
themselves. A token outside a pair's selection gets nothing from that pair. The pairs' outputs
are combined weighted by their softmax denominators: out = sum_i e^{lse_i} o_i / sum_i e^{lse_i}
(lse_i = log of pair i's denominator), i.e. one softmax over the union of the pairs' keys.
One pair (T, 1) is exactly causal attention. Every token needs a pair with r = 1 (config check).

Selection and scatter are exact 0/1 masks on a [.., w'/r, r, heads, ..] view (no gathers), so
with the sequence sharded over `sp` GSPMD keeps segments that fit in a shard local and, for
longer segments, moves only the selected (dilated) keys and values across sp. Cost per pair
O(T w' / r^2) scores, not O(T^2). Token order must be natural (the model switches zig-zag off).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

F32 = jnp.float32
NEG = -1e30


def _segment_attention(q, k, v, w: int, r: int):
    """One pair: (out [B,T,H,D] float32, lse [B,T,H] float32; NEG where the token is not selected)."""
    B, T, H, D = q.shape
    w = min(w, T)
    S, n = T // w, w // r
    sel = jnp.asarray(np.arange(r)[:, None] == np.arange(H)[None, :] % r)  # [r, H]: head h keeps offset h % r
    pick = lambda x: jnp.sum(jnp.where(sel[:, :, None], x.reshape(B, S, n, r, H, D), 0), axis=3)  # noqa: E731
    qs, ks, vs = pick(q), pick(k), pick(v)  # [B, S, n, H, D]
    s = jnp.einsum("bsqhd,bskhd->bshqk", qs, ks, preferred_element_type=F32) / math.sqrt(D)
    s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, NEG)
    lse = jax.nn.logsumexp(s, axis=-1)  # [B, S, H, n]
    o = jnp.einsum("bshqk,bskhd->bsqhd", jnp.exp(s - lse[..., None]), vs.astype(F32))
    out = jnp.where(sel[:, :, None], o[:, :, :, None], 0).reshape(B, T, H, D)
    lse = jnp.where(sel, jnp.swapaxes(lse, 2, 3)[:, :, :, None], NEG).reshape(B, T, H)
    return out, lse


def dilated_attention(q, k, v, pairs) -> jax.Array:
    """Causal dilated attention on q, k, v [batch, seq, heads, head_dim]; pairs ((w, r), ...)."""
    outs, lses = zip(*(_segment_attention(q, k, v, w, r) for w, r in pairs))
    lse = jnp.stack(lses)  # [P, B, T, H]
    weight = jnp.exp(lse - jnp.max(lse, axis=0))
    out = sum(wt[..., None] * o for wt, o in zip(weight, outs)) / jnp.sum(weight, axis=0)[..., None]
    return out.astype(q.dtype)


# Decoding (jaxpar/decode.py) sees one query at a time against a cache of keys, so it takes the union form of
# the combination above: a key that k of the pairs show the query enters the one softmax k times, i.e. with
# log(k) added to its score. The segment structure is that of a row of `context` tokens (the model's
# max_seq_len): for the positions below data.seq_len it is the training rows' structure whatever the context,
# since a segment cut at min(w, seq_len) and one cut at min(w, context) start together at 0.
def key_counts(q_pos, k_pos, n_head: int, pairs, context: int) -> jax.Array:
    """[heads, q, k] int32: how many pairs let the query at position q_pos[i] attend the key at k_pos[j]."""
    h, q, k = jnp.arange(n_head)[:, None, None], q_pos[None, :, None], k_pos[None, None, :]
    counts = jnp.zeros((n_head, q_pos.shape[0], k_pos.shape[0]), jnp.int32)
    for w, r in pairs:
        w = min(w, context)
        counts += (q // w == k // w) & (k <= q) & (q % w % r == h % r) & (k % w % r == h % r)
    return counts


def counted_attention(q, k, v, counts) -> jax.Array:
    """Causal dilated attention of q [b, tq, heads, d] over k, v [b, tk, heads, d] with key_counts' counts:
    dilated_attention's output at those query positions, float32 inside as there."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=F32) / math.sqrt(q.shape[-1])
    s = jnp.where(counts > 0, s + jnp.log(jnp.maximum(counts, 1).astype(F32)), NEG)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v.astype(F32)).astype(q.dtype)
