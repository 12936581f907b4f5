"""AdamW with jaxpar's weight-decay mask and learning-rate schedule (jaxpar.schedule.lr_at)."""
from __future__ import annotations

import torch
from torch.optim.lr_scheduler import LRScheduler

from jaxpar.config import Config
from jaxpar.schedule import lr_at
from torchpar.layout import shared_name


def decays(torch_name: str) -> bool:
    """jaxpar's rule on the shared name: no decay for biases and LayerNorm scales."""
    return shared_name(torch_name).rsplit(".", 1)[-1] not in ("bias", "scale")


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if decays(n)], "weight_decay": weight_decay},
            {"params": [p for n, p in named if not decays(n)], "weight_decay": 0.0}]


def make_optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.Optimizer:
    o = cfg.optim
    return torch.optim.AdamW(param_groups(model, o.weight_decay), lr=lr_at(0, o, cfg.train.steps),
                             betas=(o.beta1, o.beta2), eps=o.eps)


class SharedSchedule(LRScheduler):
    """The lr of the update at 0-based step s is lr_at(s): warmup + cosine, written once in jaxpar."""

    def __init__(self, optimizer, cfg: Config, last_epoch: int = -1):
        self.cfg = cfg
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        return [lr_at(self.last_epoch, self.cfg.optim, self.cfg.train.steps) for _ in self.optimizer.param_groups]
