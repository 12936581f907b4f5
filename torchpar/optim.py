"""AdamW with jaxpar's weight-decay mask and learning-rate schedule (jaxpar.core.lr_schedule.lr_at)."""
from __future__ import annotations

import torch
from torch.optim.lr_scheduler import LRScheduler

from jaxpar.core.config import Config
from jaxpar.core.lr_schedule import decays as decays_shared, lr_at
from jaxpar.core.weights import shared_name


def decays(torch_name: str) -> bool:
    """The shared decay rule, applied to a torch parameter's shared name."""
    return decays_shared(shared_name(torch_name))


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if decays(n)], "weight_decay": weight_decay},
            {"params": [p for n, p in named if not decays(n)], "weight_decay": 0.0}]


def make_optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.Optimizer:
    o = cfg.optim
    return torch.optim.AdamW(param_groups(model, o.weight_decay), lr=lr_at(0, o, cfg.train.steps),
                             betas=(o.beta1, o.beta2), eps=o.eps)


class SharedLRSchedule(LRScheduler):
    """The lr of the update at 0-based step s is lr_at(s): warmup + cosine, written once in jaxpar."""

    def __init__(self, optimizer, cfg: Config, last_epoch: int = -1):
        self.cfg = cfg
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        return [lr_at(self.last_epoch, self.cfg.optim, self.cfg.train.steps) for _ in self.optimizer.param_groups]
