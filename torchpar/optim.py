"""AdamW with jaxpar's weight-decay mask and learning-rate schedule (jaxpar.core.lr_schedule.lr_at).

The config decides every hyperparameter, also on resume: a checkpoint's copy of them (torch's optimizer state
holds each parameter group's betas, eps, weight decay and lr; a scheduler's state what it was built with) is
never what a resumed run uses. `group_settings` / `put_back` keep the config's over a load; the schedule's
state is its position alone.
"""
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


def group_settings(optimizer) -> list[dict]:
    """Each parameter group's settings as the optimizer was built (from the config), but its parameters and lr
    (the schedule's)."""
    return [{k: v for k, v in g.items() if k not in ("params", "lr")} for g in optimizer.param_groups]


def put_back(optimizer, settings: list[dict]) -> None:
    """After a checkpoint load (torch's Optimizer.load_state_dict replaces every group's settings with the saved
    ones): the config's settings again, the restored moments and step counts kept."""
    for group, own in zip(optimizer.param_groups, settings):
        group.update(own)


class SharedLRSchedule(LRScheduler):
    """The lr of the update at 0-based step s is lr_at(s): warmup + cosine, written once in jaxpar. Its state is
    its position (updates applied so far) alone: the schedule is the config's, so a run resumed with other
    optim.* or train.steps follows the new schedule from where it stood."""
    POSITION = ("last_epoch", "_step_count")

    def __init__(self, optimizer, cfg: Config, last_epoch: int = -1):
        self.cfg = cfg
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        return [lr_at(self.last_epoch, self.cfg.optim, self.cfg.train.steps) for _ in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.POSITION}

    def load_state_dict(self, state_dict: dict) -> None:
        """The saved position (a checkpoint written before this held the whole scheduler, its config too: only
        the position is taken), and the lr there under this config."""
        for k in self.POSITION:
            setattr(self, k, state_dict[k])
        self.apply()

    def apply(self) -> None:
        """Every group's lr: the schedule's at its position (after an optimizer load put the saved lr back)."""
        self._last_lr = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr
