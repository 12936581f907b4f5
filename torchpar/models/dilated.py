"""Dilated attention (model.attention=dilated) in PyTorch with jaxpar's math (jaxpar/models/dilated.py): the
training core, and decoding's form of it over a cache."""
from __future__ import annotations

import math

import numpy as np
import torch

NEG = -1e30


def _segment_attention(q, k, v, w: int, r: int):
    """jaxpar.models.dilated._segment_attention on [B, T, H, D]."""
    B, T, H, D = q.shape
    w = min(w, T)
    S, n = T // w, w // r
    sel = torch.from_numpy(np.arange(r)[:, None] == np.arange(H)[None, :] % r).to(q.device)  # [r, H]
    pick = lambda x: torch.where(sel[:, :, None], x.reshape(B, S, n, r, H, D), 0).sum(3)  # noqa: E731
    qs, ks, vs = pick(q), pick(k), pick(v)
    s = torch.einsum("bsqhd,bskhd->bshqk", qs.float(), ks.float()) / math.sqrt(D)
    s = torch.where(torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), s, NEG)
    lse = torch.logsumexp(s, dim=-1)
    o = torch.einsum("bshqk,bskhd->bsqhd", torch.exp(s - lse[..., None]), vs.float())
    out = torch.where(sel[:, :, None], o[:, :, :, None], 0).reshape(B, T, H, D)
    lse = torch.where(sel, lse.transpose(2, 3)[:, :, :, None], NEG).reshape(B, T, H)
    return out, lse


def dilated_attention(q, k, v, pairs):
    outs, lses = zip(*(_segment_attention(q, k, v, w, r) for w, r in pairs))
    lse = torch.stack(lses)
    weight = torch.exp(lse - lse.max(0).values)
    out = sum(wt[..., None] * o for wt, o in zip(weight, outs)) / weight.sum(0)[..., None]
    return out.to(q.dtype)


def key_counts(q_pos, k_pos, n_head: int, pairs, context: int):
    """jaxpar.models.dilated.key_counts: [heads, q, k], how many pairs let query q_pos[i] attend key k_pos[j]."""
    h, q, k = torch.arange(n_head, device=q_pos.device)[:, None, None], q_pos[None, :, None], k_pos[None, None, :]
    counts = torch.zeros(n_head, len(q_pos), len(k_pos), dtype=torch.int32, device=q_pos.device)
    for w, r in pairs:
        w = min(w, context)
        counts += (q // w == k // w) & (k <= q) & (q % w % r == h % r) & (k % w % r == h % r)
    return counts


def counted_attention(q, k, v, counts):
    """jaxpar.models.dilated.counted_attention on [b, heads, t, d]: decoding's form of dilated_attention."""
    s = torch.einsum("bhqd,bhkd->bhqk", q.float(), k.float()) / math.sqrt(q.shape[-1])
    s = torch.where(counts > 0, s + counts.clamp(min=1).float().log(), NEG)
    return torch.einsum("bhqk,bhkd->bhqd", s.softmax(-1), v.float()).to(q.dtype)
