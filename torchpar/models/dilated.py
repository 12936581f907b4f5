"""Dilated attention (model.attention=dilated) in PyTorch with jaxpar's math (jaxpar/models/dilated.py).

The training core (block-sparse too: FlexAttention's block masks on CUDA, the same blocked sum as jaxpar's on the CPU,
where torch 2.13 has no FlexAttention backward), and decoding's form of it over a cache.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from jaxpar.core.model.layer_rules import block_mask, dense_blocks, kept_blocks

NEG = -1e30
FLEX_BLOCK = 128  # FlexAttention's default block: its fused kernel's tiles must fit the blocks


def _dense_core(qs, ks, vs):
    """jaxpar.models.dilated._dense_core: [B, S, n, H, D] -> (out [B, S, n, H, D], lse [B, S, H, n]), float32."""
    n, D = qs.shape[2], qs.shape[-1]
    s = torch.einsum("bsqhd,bskhd->bshqk", qs.float(), ks.float()) / math.sqrt(D)
    s = torch.where(torch.ones(n, n, dtype=torch.bool, device=qs.device).tril(), s, NEG)
    lse = torch.logsumexp(s, dim=-1)
    return torch.einsum("bshqk,bskhd->bsqhd", torch.exp(s - lse[..., None]), vs.float()), lse


def _blocked_core(qs, ks, vs, kept):
    """jaxpar.models.dilated._sparse_core: each query block gathers its kept key and value blocks."""
    B, S, n, H, D = qs.shape
    _, nb, K = kept.shape
    b = n // nb
    dev = qs.device
    idx = torch.from_numpy(np.where(kept < 0, np.arange(nb)[None, :, None], kept).astype(np.int64)).to(dev)
    heads = torch.arange(H, device=dev)[:, None, None]
    blocks = lambda x: x.float().reshape(B, S, nb, b, H, D).permute(4, 2, 0, 1, 3, 5)[heads, idx]
    kg, vg = blocks(ks), blocks(vs)  # [H, nb, K, B, S, b, D]
    s = torch.einsum("bsiqhd,hijbsld->bshiqjl", qs.float().reshape(B, S, nb, b, H, D), kg) / math.sqrt(D)
    causal = (np.arange(K) > 0)[None, :, None] | np.tril(np.ones((b, b), bool))[:, None, :]
    s = torch.where(torch.from_numpy((kept >= 0)[:, :, None, :, None] & causal).to(dev), s, NEG)
    lse = torch.logsumexp(s.flatten(-2), dim=-1)  # [B, S, H, nb, b]
    o = torch.einsum("bshiqjl,hijbsld->bsiqhd", torch.exp(s - lse[..., None, None]), vg)
    return o.reshape(B, S, n, H, D), lse.reshape(B, S, H, n)


def _flex_core(qs, ks, vs, kept):
    """The kept blocks on FlexAttention (flex_block_mask).

    torch 2.13 runs its backward on CUDA only (the CPU refuses it; there _blocked_core computes the same sum); fused
    when compiled (train.compile).
    """
    from torch.nn.attention.flex_attention import AuxRequest  # deferred: torch >= 2.9's (pyproject allows 2.5)

    B, S, n, H, D = qs.shape
    rows = lambda x: x.float().permute(0, 1, 3, 2, 4).reshape(B * S, H, n, D)
    o, aux = flex_attention(
        rows(qs), rows(ks), rows(vs), block_mask=flex_block_mask(kept, n, qs.device), return_aux=AuxRequest(lse=True)
    )
    return o.reshape(B, S, H, n, D).permute(0, 1, 3, 2, 4), aux.lse.reshape(B, S, H, n)


def flex_block_mask(kept, n: int, device):
    """FlexAttention's BlockMask of kept_blocks' pattern on rows of n tokens.

    Its mask_mod is the whole mask (causal, within the kept blocks: what the unfused path applies); its block lists
    name the same blocks, the diagonal as partial (masked) and the past ones as full, so that the fused kernel
    visits only those.
    """
    H, nb, K = kept.shape
    b = n // nb
    past = np.zeros((1, H, nb, nb), np.int32)
    past[..., : K - 1] = np.maximum(kept[..., 1:], 0)  # kept: the diagonal first, then the past blocks, -1 unused
    table = torch.from_numpy(dense_blocks(kept)).to(device)
    diagonal = torch.arange(nb, dtype=torch.int32, device=device)[:, None].expand(1, H, nb, nb)
    n_past = torch.from_numpy((kept[..., 1:] >= 0).sum(-1, dtype=np.int32)[None]).to(device)
    return BlockMask.from_kv_blocks(
        torch.ones(1, H, nb, dtype=torch.int32, device=device),
        diagonal,
        n_past,
        torch.from_numpy(past).to(device),
        BLOCK_SIZE=b,
        mask_mod=lambda _, h, q, k: (q >= k) & table[h, q // b, k // b],
        seq_lengths=(n, n),
    )


def _segment_attention(q, k, v, w: int, r: int, sparsity=None):
    """jaxpar.models.dilated._segment_attention on [B, T, H, D]."""
    B, T, H, D = q.shape
    S, n = T // min(w, T), min(w, T) // r
    sel = torch.from_numpy(np.arange(r)[:, None] == np.arange(H)[None, :] % r).to(q.device)  # [r, H]
    pick = lambda x: torch.where(sel[:, :, None], x.reshape(B, S, n, r, H, D), 0).sum(3)
    qs, ks, vs = pick(q), pick(k), pick(v)
    if sparsity is None:
        o, lse = _dense_core(qs, ks, vs)
    else:
        kept = kept_blocks(sparsity, w, r, H, n // sparsity.block)
        flex = q.is_cuda and sparsity.block % FLEX_BLOCK == 0
        o, lse = (_flex_core if flex else _blocked_core)(qs, ks, vs, kept)
    out = torch.where(sel[:, :, None], o[:, :, :, None], 0).reshape(B, T, H, D)
    lse = torch.where(sel, lse.transpose(2, 3)[:, :, :, None], NEG).reshape(B, T, H)
    return out, lse


def dilated_attention(q, k, v, pairs, sparsity=None):
    outs, lses = zip(*(_segment_attention(q, k, v, w, r, sparsity) for w, r in pairs))
    lse = torch.stack(lses)
    weight = torch.exp(lse - lse.max(0).values)
    out = sum(wt[..., None] * o for wt, o in zip(weight, outs)) / weight.sum(0)[..., None]
    return out.to(q.dtype)


def key_counts(q_pos, k_pos, n_head: int, pairs, context: int, sparsity=None):
    """jaxpar.models.dilated.key_counts: [heads, q, k], how many pairs let query q_pos[i] attend key k_pos[j]."""
    h, q, k = torch.arange(n_head, device=q_pos.device)[:, None, None], q_pos[None, :, None], k_pos[None, None, :]
    counts = torch.zeros(n_head, len(q_pos), len(k_pos), dtype=torch.int32, device=q_pos.device)
    for w_cfg, r in pairs:
        w = min(w_cfg, context)
        seen = (q // w == k // w) & (k <= q) & (q % w % r == h % r) & (k % w % r == h % r)
        if sparsity is not None:
            b = sparsity.block
            mask = torch.from_numpy(block_mask(sparsity, w_cfg, r, n_head, -(-w // r // b))).to(q_pos.device)
            seen &= mask[h, q % w // r // b, k % w // r // b]
        counts += seen
    return counts


def counted_attention(q, k, v, counts):
    """jaxpar.models.dilated.counted_attention on [b, heads, t, d]: decoding's form of dilated_attention."""
    s = torch.einsum("bhqd,bhkd->bhqk", q.float(), k.float()) / math.sqrt(q.shape[-1])
    s = torch.where(counts > 0, s + counts.clamp(min=1).float().log(), NEG)
    return torch.einsum("bhqk,bhkd->bhqd", s.softmax(-1), v.float()).to(q.dtype)
