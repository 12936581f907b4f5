"""AdamW with jaxpar's weight-decay mask and learning-rate schedule (jaxpar.core.lr_schedule.lr_at); with
optim.name=muon, Muon (jaxpar/core/muon.py) on the hidden matrices and that AdamW on the rest, one optimizer.

The config decides every hyperparameter, also on resume: a checkpoint's copy of them (torch's optimizer state
holds each parameter group's betas, eps, weight decay and lr; a scheduler's state what it was built with) is
never what a resumed run uses. `group_settings` / `put_back` keep the config's over a load; the schedule's
state is its position alone.
"""
from __future__ import annotations

import torch
from torch.optim.lr_scheduler import LRScheduler

from jaxpar.core import muon
from jaxpar.core.config import Config
from jaxpar.core.lr_schedule import decays as decays_shared, lr_at
from jaxpar.core.weights import shared_name


def decays(torch_name: str) -> bool:
    """The shared decay rule, applied to a torch parameter's shared name."""
    return decays_shared(shared_name(torch_name))


def muon_axes(torch_name: str):
    """(reduction, output) axes of a parameter Muon steps (jaxpar/core/muon.py), None for AdamW's."""
    return muon.per_layer_axes(shared_name(torch_name))


def param_groups(model: torch.nn.Module, weight_decay: float, with_muon: bool = False) -> list[dict]:
    named = list(model.named_parameters())
    mine = {n for n, _ in named if with_muon and muon_axes(n)}
    groups = [{"params": [p for n, p in named if decays(n) and n not in mine], "weight_decay": weight_decay},
              {"params": [p for n, p in named if not decays(n) and n not in mine], "weight_decay": 0.0}]
    return groups + ([{"params": [p for n, p in named if n in mine], "weight_decay": weight_decay, "muon": True}]
                     if mine else [])


def make_optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.Optimizer:
    o = cfg.optim
    kwargs = dict(lr=lr_at(0, o, cfg.train.steps), betas=(o.beta1, o.beta2), eps=o.eps)
    if o.name == "muon":
        axes = {p: muon_axes(n) for n, p in model.named_parameters() if muon_axes(n)}
        return MuonAdamW(param_groups(model, o.weight_decay, with_muon=True), axes, cfg, **kwargs)
    return torch.optim.AdamW(param_groups(model, o.weight_decay), **kwargs)


def orthogonalize(x: torch.Tensor, axes, steps: int) -> torch.Tensor:
    """jaxpar/core/muon.py's NS_k on every matrix of `x` (its other axes batch axes), float32: jaxpar/optim.py's."""
    reduction, output = axes
    batch = tuple(a for a in range(x.ndim) if a not in reduction + output)
    order = batch + reduction + output
    fan_in, fan_out = muon.fans(x.shape, axes)
    y = x.permute(order).reshape(*(x.shape[a] for a in batch), fan_in, fan_out)
    wide = fan_in <= fan_out
    y = y if wide else y.mT
    y = y / torch.linalg.vector_norm(y, dim=(-2, -1), keepdim=True).clamp_min(muon.EPS)
    a, b, c = muon.COEFFS
    for _ in range(steps):
        gram = y @ y.mT
        y = a * y + (b * gram + c * gram @ gram) @ y
    y = y if wide else y.mT
    return y.reshape([x.shape[a] for a in order]).permute([order.index(a) for a in range(x.ndim)])


class MuonAdamW(torch.optim.AdamW):
    """Muon on the groups marked "muon", AdamW's own step on the others: one optimizer (one state dict, one DCP
    checkpoint), and the AdamW parameters stepped exactly as under optim.name=adamw. The momentum is kept as the
    parameter is (an FSDP2 shard); Newton-Schulz reads the whole matrix (gathered), each rank keeps its shard."""

    def __init__(self, groups: list[dict], axes: dict, cfg: Config, **kwargs):
        super().__init__(groups, **kwargs)
        self.axes, self.cfg = axes, cfg

    @torch.no_grad()
    def step(self, closure=None):
        groups = self.param_groups
        self.param_groups = [g for g in groups if not g.get("muon")]
        try:
            loss = super().step(closure)
        finally:
            self.param_groups = groups
        for group in groups:
            if group.get("muon"):
                self._muon_step(group)
        return loss

    def _muon_step(self, group: dict) -> None:
        o = self.cfg.optim
        m, lr, decay = o.muon_momentum, group["lr"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:  # and a step count, as AdamW's state (its load reads every "step")
                state["step"], state["momentum_buffer"] = torch.tensor(0.0), torch.zeros_like(p.grad)
            state["step"] += 1
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - m)
            update = _whole(p.grad.lerp(buf, m))  # Nesterov
            ortho = _like(p, orthogonalize(update, self.axes[p], o.muon_ns_steps))
            p.mul_(1 - lr * decay)
            p.add_(ortho, alpha=-lr * muon.lr_scale(o.muon_lr_rule, *muon.fans(p.shape, self.axes[p])))


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor (FSDP2's DTensor) gathered whole on every rank; a plain one as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _like(p: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """`whole` laid out as the parameter is: this rank's shard of it (no communication: every rank holds it all)."""
    if not hasattr(p, "device_mesh"):
        return whole
    from torch.distributed.tensor import distribute_tensor
    return distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None)


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
