"""Model-free tensor functions the models and decoding use (jaxpar/ops.py's counterparts): causal attention on one
device, within packed documents when asked, and the documents' positions and ids (document_positions)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def document_positions(tokens: torch.Tensor, eod: int, segment=0, position=0):
    """(positions, segments) [B, T] of rows of packed documents, as jaxpar/ops.py `document_positions`: a document starts
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
