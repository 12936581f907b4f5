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

Block-sparse (model.sparsity_ratio; the pattern: jaxpar/core/model/layer_rules.py): each pair's selected row is cut
into blocks and a query block attends only its kept key blocks, which it gathers (constant indices along the row;
under sp GSPMD partitions the gather): about sparsity_ratio of the pair's scores, never a dense [n, n] matrix.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.core.model.layer_rules import BlockSparsity, block_mask, kept_blocks

F32 = jnp.float32
NEG = -1e30


def _dense_core(qs, ks, vs):
    """Causal attention within each segment's selected row.

    qs, ks, vs [B, S, n, H, D] -> (out [B, S, n, H, D] float32, lse [B, S, H, n] float32).
    """
    n, D = qs.shape[2], qs.shape[-1]
    s = jnp.einsum("bsqhd,bskhd->bshqk", qs, ks, preferred_element_type=F32) / math.sqrt(D)
    s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, NEG)
    lse = jax.nn.logsumexp(s, axis=-1)  # [B, S, H, n]
    return jnp.einsum("bshqk,bskhd->bsqhd", jnp.exp(s - lse[..., None]), vs.astype(F32)), lse


def _sparse_core(qs, ks, vs, kept):
    """_dense_core on the kept blocks only (kept [H, nb, K], core/model/layer_rules.py).

    Each query block gathers its K key and value blocks and attends over those K x b keys; no [n, n] scores exist.
    """
    B, S, n, H, D = qs.shape
    _, nb, K = kept.shape
    b = n // nb
    idx = np.where(kept < 0, np.arange(nb)[None, :, None], kept)  # an unused slot reads the diagonal, masked below
    heads = np.arange(H)[:, None, None]
    blocks = lambda x: jnp.moveaxis(x.reshape(B, S, nb, b, H, D), (4, 2), (0, 1))[heads, idx]
    kg, vg = blocks(ks), blocks(vs)  # [H, nb, K, B, S, b, D]
    s = jnp.einsum("bsiqhd,hijbsld->bshiqjl", qs.reshape(B, S, nb, b, H, D), kg, preferred_element_type=F32)
    causal = (np.arange(K) > 0)[None, :, None] | np.tril(np.ones((b, b), bool))[:, None, :]  # [b, K, b]: slot 0
    s = jnp.where((kept >= 0)[:, :, None, :, None] & causal, s / math.sqrt(D), NEG)  # is the diagonal block
    lse = jax.nn.logsumexp(s, axis=(-2, -1))  # [B, S, H, nb, b]
    o = jnp.einsum("bshiqjl,hijbsld->bsiqhd", jnp.exp(s - lse[..., None, None]), vg.astype(F32))
    return o.reshape(B, S, n, H, D), lse.reshape(B, S, H, n)


def _segment_attention(q, k, v, w: int, r: int, sparsity: BlockSparsity | None = None):
    """One pair: (out [B,T,H,D] float32, lse [B,T,H] float32; NEG where the token is not selected)."""
    B, T, H, D = q.shape
    S, n = T // min(w, T), min(w, T) // r
    sel = jnp.asarray(np.arange(r)[:, None] == np.arange(H)[None, :] % r)  # [r, H]: head h keeps offset h % r
    pick = lambda x: jnp.sum(jnp.where(sel[:, :, None], x.reshape(B, S, n, r, H, D), 0), axis=3)
    qs, ks, vs = pick(q), pick(k), pick(v)  # [B, S, n, H, D]
    if sparsity is None:
        o, lse = _dense_core(qs, ks, vs)
    else:
        o, lse = _sparse_core(qs, ks, vs, kept_blocks(sparsity, w, r, H, n // sparsity.block))
    out = jnp.where(sel[:, :, None], o[:, :, :, None], 0).reshape(B, T, H, D)
    lse = jnp.where(sel, jnp.swapaxes(lse, 2, 3)[:, :, :, None], NEG).reshape(B, T, H)
    return out, lse


def dilated_attention(q, k, v, pairs, sparsity: BlockSparsity | None = None) -> jax.Array:
    """Causal dilated attention on q, k, v [batch, seq, heads, head_dim].

    Pairs ((w, r), ...); `sparsity`: block-sparse (core/model/layer_rules.py), None: dense.
    """
    with jax.named_scope("dilated_attention"):  # what the FLOPs test counts
        outs, lses = zip(*(_segment_attention(q, k, v, w, r, sparsity) for w, r in pairs))
        lse = jnp.stack(lses)  # [P, B, T, H]
        weight = jnp.exp(lse - jnp.max(lse, axis=0))
        out = sum(wt[..., None] * o for wt, o in zip(weight, outs)) / jnp.sum(weight, axis=0)[..., None]
    return out.astype(q.dtype)


# Decoding (jaxpar/decode.py) sees one query at a time against a cache of keys, so it takes the union form of
# the combination above: a key that k of the pairs show the query enters the one softmax k times, i.e. with
# log(k) added to its score. The segment structure is that of a row of `context` tokens (the model's
# max_seq_len): for the positions below data.seq_len it is the training rows' structure whatever the context,
# since a segment cut at min(w, seq_len) and one cut at min(w, context) start together at 0.
def key_counts(q_pos, k_pos, n_head: int, pairs, context: int, sparsity: BlockSparsity | None = None) -> jax.Array:
    """[heads, q, k] int32: how many pairs let the query at position q_pos[i] attend the key at k_pos[j]."""
    h, q, k = jnp.arange(n_head)[:, None, None], q_pos[None, :, None], k_pos[None, None, :]
    counts = jnp.zeros((n_head, q_pos.shape[0], k_pos.shape[0]), jnp.int32)
    for w_cfg, r in pairs:
        w = min(w_cfg, context)
        seen = (q // w == k // w) & (k <= q) & (q % w % r == h % r) & (k % w % r == h % r)
        if sparsity is not None:  # blocks of the selected row; its pattern does not depend on the row's length
            b = sparsity.block
            mask = jnp.asarray(block_mask(sparsity, w_cfg, r, n_head, -(-w // r // b)))
            seen &= mask[h, q % w // r // b, k % w // r // b]
        counts += seen
    return counts


def counted_attention(q, k, v, counts) -> jax.Array:
    """Causal dilated attention of q [b, tq, heads, d] over k, v [b, tk, heads, d] with key_counts' counts.

    dilated_attention's output at those query positions, float32 inside as there.
    """
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=F32) / math.sqrt(q.shape[-1])
    s = jnp.where(counts > 0, s + jnp.log(jnp.maximum(counts, 1).astype(F32)), NEG)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v.astype(F32)).astype(q.dtype)
