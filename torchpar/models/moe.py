"""The mixture-of-experts feed-forward block in PyTorch.

It has jaxpar's routing and per-layer parameter shapes (jaxpar/models/moe.py has the rules: float32 router, top-k,
capacity by choice rank then position, shared experts, the per-row statistics). Every expert runs on this rank unless
a backend plugs in its exchange (torchpar/backends/experts.py: expert parallelism over the ranks of `ep`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from jaxpar.core.config.schema import ModelConfig
from jaxpar.core.errors import UserError
from jaxpar.core.model.experts import row_capacity
from torchpar.models.layers import Kernel
from torchpar.models.llama import SwiGLU


def limit_to_groups(choice: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """jaxpar's limit_to_groups.

    Every expert outside the moe_topk_group best of moe_n_group groups (each scored by the sum of its best two) at
    -inf.
    """
    G = cfg.moe_n_group
    grouped = choice.unflatten(-1, (G, cfg.moe_experts // G))
    best = grouped.topk(2, dim=-1).values.sum(-1).topk(cfg.moe_topk_group, dim=-1).indices
    kept = torch.zeros(grouped.shape[:-1], dtype=torch.bool, device=choice.device).scatter(-1, best, True)
    return grouped.masked_fill(~kept[..., None], float("-inf")).flatten(-2)


def route(logits: torch.Tensor, cfg: ModelConfig, bias: torch.Tensor | None = None):
    """Route each token to its top-k experts, as jaxpar's route.

    Router logits [B, T, E] float32 -> (ids, weights, kept [B, T, k], stats [B, E + 2]) (`bias`: the choice's balance
    bias, model.moe_bias_update).
    """
    E, k = cfg.moe_experts, cfg.moe_top_k
    B, T = logits.shape[:2]
    scores = logits.softmax(-1) if cfg.moe_router == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias
    choice = choice if cfg.moe_n_group == 1 else limit_to_groups(choice, cfg)
    top, ids = choice.topk(k, dim=-1)
    top = top if choice is scores else scores.gather(-1, ids)  # the weights never see the bias
    weights = top / top.sum(-1, keepdim=True) if cfg.moe_norm_topk else top
    weights = weights if cfg.moe_routed_scale == 1.0 else weights * cfg.moe_routed_scale
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
    """E experts' gated MLPs stacked on a leading experts axis (gate, up [E, embed, width], down [E, width, embed]).

    With model.moe_expert_bias their biases too (gate_bias, up_bias [E, width], down_bias [E, embed]); the activation
    is model.moe_activation's (jaxpar/parallel/expert_dispatch.py gated). Under expert parallelism
    (torchpar/backends/experts.py) this rank's E/ep of them.
    """

    def __init__(self, cfg: ModelConfig, n: int):
        super().__init__()
        d, f = cfg.d_model, cfg.expert_dim
        self.gate, self.up = nn.Parameter(torch.empty(n, d, f)), nn.Parameter(torch.empty(n, d, f))
        self.down = nn.Parameter(torch.empty(n, f, d))
        if cfg.moe_expert_bias:  # gpt-oss's
            self.gate_bias, self.up_bias = nn.Parameter(torch.zeros(n, f)), nn.Parameter(torch.zeros(n, f))
            self.down_bias = nn.Parameter(torch.zeros(n, d))
        self.activation = (cfg.moe_activation, cfg.moe_swiglu_limit, cfg.moe_swiglu_alpha)
        self.ragged = cfg.moe_ragged
        if self.ragged and (d % 8 or f % 8):
            raise UserError(
                f"model.moe_ragged: torch._grouped_mm needs rows of a multiple of 16 bytes, so d_model ({d}) and the "
                f"experts' width ({f}) multiples of 8"
            )

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """rows [n, embed] grouped by expert, counts[e] of them expert e's -> its outputs, the same order.

        Every expert runs, on no rows too: each weight then has a gradient (zero), as DDP expects of every step.
        model.moe_ragged: each projection one torch._grouped_mm over the groups instead of a loop over the experts.
        """
        if self.ragged:
            return self._grouped(rows, counts)
        biased = hasattr(self, "gate_bias")
        bias = lambda name, e, h: getattr(self, name)[e].to(h.dtype) if biased else 0
        out = []
        for e, h in enumerate(rows.split(counts)):
            g = h @ self.gate[e].to(h.dtype) + bias("gate_bias", e, h)
            u = h @ self.up[e].to(h.dtype) + bias("up_bias", e, h)
            out.append(gated(self.activation, g, u) @ self.down[e].to(h.dtype) + bias("down_bias", e, h))
        return torch.cat(out)

    def _grouped(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """forward's outputs by grouped matmuls: expert e's rows are those between the offsets e - 1 and e."""
        sizes = torch.tensor(counts, device=rows.device)
        ends = sizes.cumsum(0).to(torch.int32)
        expert = torch.repeat_interleave(torch.arange(len(counts), device=rows.device), sizes)
        bias = lambda name: getattr(self, name)[expert].to(rows.dtype) if hasattr(self, name) else 0
        mm = lambda h, w: torch._grouped_mm(h, w.to(h.dtype), offs=ends)
        h = gated(self.activation, mm(rows, self.gate) + bias("gate_bias"), mm(rows, self.up) + bias("up_bias"))
        return mm(h, self.down) + bias("down_bias")


def gated(activation: tuple, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """jaxpar's gated: silu(gate) x up, or gpt-oss's clamped (up + 1) x gate x sigmoid(alpha x gate)."""
    kind, limit, alpha = activation
    if kind == "swiglu":
        return F.silu(gate) * up
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.router = Kernel((cfg.d_model, cfg.moe_experts))
        # the choice's balance bias (jaxpar/core/model/experts.py): no gradient, moe_bias_update moves it
        if cfg.router_bias:
            self.router.bias = nn.Parameter(torch.zeros(cfg.moe_experts), requires_grad=False)
        if cfg.moe_expert_bias:  # gpt-oss's bias on the router's logits: it weighs as well as chooses
            self.router.logit_bias = nn.Parameter(torch.zeros(cfg.moe_experts))
        self.experts = Experts(cfg, cfg.moe_experts)
        self.shared = SwiGLU(cfg, cfg.moe_shared_experts * cfg.expert_dim) if cfg.moe_shared_experts else None
        self.cfg = cfg
        self.exchange = None  # (rows, counts) -> outputs: expert parallelism's trip over the ep ranks

    def forward(self, x):
        """x [B, T, embed] -> (y, stats [B, E + 2]).

        The kept choices are sorted by expert (a stable sort: token order within an expert), their rows go
        through `exchange` and come back in that order.
        """
        bias = getattr(self.router, "bias", None)
        logits = self.router(x.float(), "btd,de->bte")
        if hasattr(self.router, "logit_bias"):
            logits = logits + self.router.logit_bias.float()
        ids, weights, kept, stats = route(logits, self.cfg, bias)
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


def layer_stats(per_layer: list[torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """Combine the expert layers' per-row statistics, as jaxpar's add_layer_stats.

    The expert layers' per-row statistics [B, E + 2] each -> their sum, or with model.moe_bias_update
    [B, layers x E + 2] (each layer's choices per expert, then the dropped choices and the balance loss summed over
    the layers).
    """
    if not cfg.moe_bias_update:
        return sum(per_layer)
    E = cfg.moe_experts
    return torch.cat([*(s[:, :E] for s in per_layer), sum(s[:, E:] for s in per_layer)], dim=-1)


@torch.no_grad()
def update_router_bias(model, loads: list[float]) -> None:
    """Move each expert layer's balance bias by the step's choices, as jaxpar/models/moe.py update_router_bias.

    `loads`: every rank's choices, layer-major.
    """
    cfg = model.cfg
    loads = torch.tensor(loads, dtype=torch.float32).reshape(cfg.moe_layers, cfg.moe_experts)
    step = cfg.moe_bias_update * torch.sign(loads.mean(-1, keepdim=True) - loads)
    biases = [block.moe.router.bias for block in model.blocks if hasattr(block, "moe")]
    for bias, s in zip(biases, step):
        bias.add_(s.to(bias.device))


def balance_loss(model, stats) -> torch.Tensor | float:
    """model.moe_aux_loss x the mean balance loss per row and expert layer (jaxpar's loss_fn); 0 without experts."""
    if stats is None:
        return 0.0
    return model.cfg.moe_aux_loss * stats[:, -1].mean() / model.cfg.moe_layers
