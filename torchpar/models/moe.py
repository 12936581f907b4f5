"""The mixture-of-experts feed-forward block in PyTorch with jaxpar's routing and per-layer parameter shapes
(jaxpar/models/moe.py has the rules: float32 router, top-k, capacity by choice rank then position, shared
experts, the per-row statistics). Every expert runs on this rank (no expert parallelism here); backends wrap it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from jaxpar.core.config import ModelConfig
from jaxpar.core.experts import row_capacity
from torchpar.models.layers import Kernel
from torchpar.models.llama import SwiGLU


def route(logits: torch.Tensor, cfg: ModelConfig):
    """Router logits [B, T, E] float32 -> (ids, weights, kept [B, T, k], stats [B, E + 2]) as jaxpar's route."""
    E, k = cfg.moe_experts, cfg.moe_top_k
    B, T = logits.shape[:2]
    scores = logits.softmax(-1) if cfg.moe_router == "softmax" else logits.sigmoid()
    top, ids = scores.topk(k, dim=-1)
    weights = top / top.sum(-1, keepdim=True) if cfg.moe_norm_topk else top
    chosen = F.one_hot(ids, E)  # [B, T, k, E]
    capacity = row_capacity(cfg, T)
    if capacity:  # a row's choices claim places by choice rank, then position
        place = chosen.transpose(1, 2).reshape(B, k * T, E).cumsum(1).sub(1).reshape(B, k, T, E).transpose(1, 2)
        kept = torch.where(chosen > 0, place, 0).sum(-1) < capacity
    else:
        kept = torch.ones_like(ids, dtype=torch.bool)
    received = chosen.sum((1, 2)).float()
    share = scores / scores.sum(-1, keepdim=True)
    balance = (received * E / (k * T) * share.mean(1)).sum(-1)
    dropped = (~kept).sum((1, 2)).float()
    return ids, weights, kept, torch.cat([received, dropped[:, None], balance[:, None]], dim=-1)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, E, f = cfg.d_model, cfg.moe_experts, cfg.expert_dim
        self.router = Kernel((d, E))
        self.gate, self.up = nn.Parameter(torch.empty(E, d, f)), nn.Parameter(torch.empty(E, d, f))
        self.down = nn.Parameter(torch.empty(E, f, d))
        self.shared = SwiGLU(cfg, cfg.moe_shared_experts * f) if cfg.moe_shared_experts else None
        self.cfg = cfg

    def forward(self, x):
        """x [B, T, embed] -> (y, stats [B, E + 2])."""
        ids, weights, kept, stats = route(self.router(x.float(), "btd,de->bte"), self.cfg)
        flat = x.reshape(-1, x.shape[-1])
        ids, kept = ids.reshape(flat.shape[0], -1), kept.reshape(flat.shape[0], -1)
        per_choice = flat.new_zeros(ids.shape + (flat.shape[-1],))  # [N, k, embed]: each kept choice's output
        for e in range(self.cfg.moe_experts):
            token, choice = torch.nonzero((ids == e) & kept, as_tuple=True)
            h = flat[token]
            h = F.silu(h @ self.gate[e].to(x.dtype)) * (h @ self.up[e].to(x.dtype))
            per_choice = per_choice.index_put((token, choice), h @ self.down[e].to(x.dtype))
        y = (per_choice * weights.reshape(ids.shape)[..., None].to(x.dtype)).sum(1).reshape(x.shape)
        return (y if self.shared is None else y + self.shared(x)), stats


def balance_loss(model, stats) -> torch.Tensor | float:
    """model.moe_aux_loss x the mean balance loss per row and layer (jaxpar's loss_fn); 0 without experts."""
    if stats is None:
        return 0.0
    return model.cfg.moe_aux_loss * stats[:, -1].mean() / model.cfg.n_layer
