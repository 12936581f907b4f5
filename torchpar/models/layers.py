"""Basic torch layers holding jaxpar's parameter shapes: einsum-applied weights of any rank, the norms, rotary
embedding (jaxpar/models/layers.py's math); causal attention, within packed documents when asked."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Dense(nn.Module):
    """weight/bias of arbitrary rank applied by an einsum equation (jaxpar's `kernel`/`bias`)."""

    def __init__(self, w_shape: tuple[int, ...], b_shape: tuple[int, ...]):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(w_shape))
        self.bias = nn.Parameter(torch.zeros(b_shape))

    def forward(self, x: torch.Tensor, equation: str) -> torch.Tensor:
        return torch.einsum(equation, x, self.weight.to(x.dtype)) + self.bias.to(x.dtype)


class Kernel(nn.Module):
    """A bias-free weight of any rank applied by an einsum equation (jaxpar's `kernel`)."""

    def __init__(self, shape: tuple[int, ...]):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape))

    def forward(self, x, equation: str):
        return torch.einsum(equation, x, self.weight.to(x.dtype))


class LayerNorm(nn.Module):
    """Statistics in float32 whatever the compute dtype; weight/bias are jaxpar's scale/bias."""

    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight, self.bias, self.eps = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d)), eps

    def forward(self, x):
        y = F.layer_norm(x.float(), x.shape[-1:], self.weight.float(), self.bias.float(), self.eps)
        return y.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


def rope(x, theta: float, positions=None):
    """x [batch, seq, ..., r]: pairs (i, i + r/2) rotated by pos * theta^(-2i/r); positions [seq] default 0..T-1,
    or per row [batch, seq] (packed documents)."""
    r, T = x.shape[-1], x.shape[1]
    pos = torch.arange(T, device=x.device) if positions is None else positions
    freqs = theta ** (-torch.arange(r // 2, dtype=torch.float32, device=x.device) * 2 / r)
    angle = pos.to(torch.float32)[..., None] * freqs  # [(batch,) seq, r/2]
    angle = angle.reshape(*angle.shape[:-1], *(1,) * (x.ndim - 3), r // 2)
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2 = x[..., : r // 2], x[..., r // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def documents(tokens: torch.Tensor, eod: int, segment=0, position=0):
    """(positions, segments) [B, T] of rows of packed documents, as jaxpar/ops.py `documents`: a document starts
    at each `eod` token, its positions count from 0 there, its segment id is the previous one's plus one; a row's
    first tokens continue document `segment` from `position` (ints or [B, 1])."""
    starts, idx = tokens == eod, torch.arange(tokens.shape[1], device=tokens.device)
    last_start = torch.cummax(torch.where(starts, idx, -1), dim=1).values
    return torch.where(last_start >= 0, idx - last_start, position + idx), segment + torch.cumsum(starts, dim=1)


def document_mask(positions, segments, k_positions=None, k_segments=None) -> torch.Tensor:
    """[B, 1, T, K] bool, True where a query attends to a key: at or before it in its own document (keys: the
    queries themselves, or a cache's)."""
    k_positions = positions if k_positions is None else k_positions
    k_segments = segments if k_segments is None else k_segments
    mask = (positions[:, :, None] >= k_positions[:, None, :]) & (segments[:, :, None] == k_segments[:, None, :])
    return mask[:, None]


def causal_attention(q, k, v, mask=None):
    """Causal attention on [b, h, t, k]; `mask` (document_mask) instead of the plain causal one when given."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
