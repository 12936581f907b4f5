"""The mixture-of-experts feed-forward block in PyTorch with jaxpar's routing and per-layer parameter shapes
(jaxpar/models/moe.py has the rules: float32 router, top-k, capacity by choice rank then position, shared
experts, the per-row statistics). Every expert runs on this rank unless a backend plugs in its exchange
(torchpar/backends/experts.py: expert parallelism over the ranks of `ep`).
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


class Experts(nn.Module):
    """E experts' SwiGLU weights stacked on a leading experts axis (gate, up [E, embed, width], down [E, width,
    embed]); under expert parallelism (torchpar/backends/experts.py) this rank's E/ep of them."""

    def __init__(self, cfg: ModelConfig, n: int):
        super().__init__()
        d, f = cfg.d_model, cfg.expert_dim
        self.gate, self.up = nn.Parameter(torch.empty(n, d, f)), nn.Parameter(torch.empty(n, d, f))
        self.down = nn.Parameter(torch.empty(n, f, d))

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """rows [n, embed] grouped by expert, counts[e] of them expert e's -> its outputs, the same order. Every
        expert runs, on no rows too: each weight then has a gradient (zero), as DDP expects of every step."""
        out = []
        for e, h in enumerate(rows.split(counts)):
            h = F.silu(h @ self.gate[e].to(h.dtype)) * (h @ self.up[e].to(h.dtype))
            out.append(h @ self.down[e].to(h.dtype))
        return torch.cat(out)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.router = Kernel((cfg.d_model, cfg.moe_experts))
        self.experts = Experts(cfg, cfg.moe_experts)
        self.shared = SwiGLU(cfg, cfg.moe_shared_experts * cfg.expert_dim) if cfg.moe_shared_experts else None
        self.cfg = cfg
        self.exchange = None  # (rows, counts) -> outputs: expert parallelism's trip over the ep ranks

    def forward(self, x):
        """x [B, T, embed] -> (y, stats [B, E + 2]). The kept choices are sorted by expert (a stable sort: token
        order within an expert), their rows go through `exchange` and come back in that order."""
        ids, weights, kept, stats = route(self.router(x.float(), "btd,de->bte"), self.cfg)
        flat = x.reshape(-1, x.shape[-1])
        E, k = self.cfg.moe_experts, ids.shape[-1]
        choice = torch.where(kept, ids, E).reshape(-1)  # a dropped choice sorts after every expert's
        order = choice.argsort(stable=True)
        counts = torch.bincount(choice, minlength=E + 1)[:E]
        order = order[: int(counts.sum())]
        rows = flat[order // k]
        out = self.exchange(rows, counts) if self.exchange else self.experts(rows, counts.tolist())
        per_choice = flat.new_zeros(choice.shape + flat.shape[-1:]).index_copy(0, order, out)
        y = (per_choice.reshape(ids.shape + flat.shape[-1:]) * weights[..., None].to(x.dtype)).sum(-2)
        y = y.reshape(x.shape)
        return (y if self.shared is None else y + self.shared(x)), stats


def balance_loss(model, stats) -> torch.Tensor | float:
    """model.moe_aux_loss x the mean balance loss per row and expert layer (jaxpar's loss_fn); 0 without experts."""
    if stats is None:
        return 0.0
    return model.cfg.moe_aux_loss * stats[:, -1].mean() / model.cfg.moe_layers
