"""AdamW with jaxpar's weight-decay mask and learning-rate schedule (jaxpar.core.optimizer.lr_schedule.lr_at).

With optim.name=muon, Muon (jaxpar/core/optimizer/muon.py) on the hidden matrices and that AdamW on the rest, one
optimizer; with optim.name=adamw8bit, torchao's AdamW8bit (its moments in 8 bits: jaxpar/core/optimizer/adamw8bit.py).

The config decides every hyperparameter, also on resume: a checkpoint's copy of them (torch's optimizer state
holds each parameter group's betas, eps, weight decay and lr; a scheduler's state what it was built with) is
never what a resumed run uses. `group_settings` / `put_back` keep the config's over a load; the schedule's
state is its position alone.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import LRScheduler

from jaxpar.core.optimizer import adamw8bit, muon
from jaxpar.core.config.schema import Config
from jaxpar.core.errors import quiet_logs
from jaxpar.core.optimizer.lr_schedule import decays as decays_shared, lr_at
from jaxpar.core.weights.names import shared_name


def decays(torch_name: str) -> bool:
    """The shared decay rule, applied to a torch parameter's shared name."""
    return decays_shared(shared_name(torch_name))


def muon_axes(torch_name: str):
    """(reduction, output) axes of a parameter Muon steps (jaxpar/core/optimizer/muon.py), None for AdamW's."""
    return muon.per_layer_axes(shared_name(torch_name))


def param_groups(model: torch.nn.Module, weight_decay: float, with_muon: bool = False) -> list[dict]:
    named = list(model.named_parameters())
    mine = {n for n, _ in named if with_muon and muon_axes(n)}
    groups = [
        {"params": [p for n, p in named if decays(n) and n not in mine], "weight_decay": weight_decay},
        {"params": [p for n, p in named if not decays(n) and n not in mine], "weight_decay": 0.0},
    ]
    return groups + (
        [{"params": [p for n, p in named if n in mine], "weight_decay": weight_decay, "muon": True}] if mine else []
    )


def make_optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.Optimizer:
    o = cfg.optim
    kwargs = dict(lr=lr_at(0, o, cfg.train.steps), betas=(o.beta1, o.beta2), eps=o.eps)
    if o.name == "muon":
        axes = {p: muon_axes(n) for n, p in model.named_parameters() if muon_axes(n)}
        return MuonAdamW(param_groups(model, o.weight_decay, with_muon=True), axes, cfg, **kwargs)
    if o.name == "adamw8bit":
        on_gpu = next(model.parameters()).device.type == "cuda"
        return torchao_adamw8bit(param_groups(model, o.weight_decay), on_gpu and cfg.train.compile != "off", **kwargs)
    fused = use_fused(o.fused, next(model.parameters()).device.type)
    return torch.optim.AdamW(param_groups(model, o.weight_decay), **kwargs, **({"fused": True} if fused else {}))


def use_fused(setting: str, device_type: str) -> bool:
    """Whether AdamW runs as torch's fused kernel, by optim.fused: on, off, or auto (on a GPU, where it pays).

    One kernel for every parameter's update instead of the foreach path's launches per group of tensors: on a GPU
    the foreach path's launches kept the device idle (docs/gpu.md); on the CPU the two take about the same time.
    """
    return setting == "on" or (setting == "auto" and device_type == "cuda")


def as_matrices(x: torch.Tensor, axes) -> torch.Tensor:
    """`x` as its matrices [B, fan_in, fan_out].

    The (reduction, output) axes made one matrix, every other axis a batch axis (jaxpar/core/optimizer/muon.py).
    """
    order = _order(x.ndim, axes)
    return x.permute(order).reshape(-1 if x.numel() else 0, *muon.fans(x.shape, axes))


def from_matrices(y: torch.Tensor, shape, axes) -> torch.Tensor:
    """as_matrices undone: [B, fan_in, fan_out] back to a tensor of `shape`."""
    order = _order(len(shape), axes)
    return y.reshape([shape[a] for a in order]).permute([order.index(a) for a in range(len(shape))])


def _order(ndim: int, axes) -> tuple[int, ...]:
    reduction, output = axes
    return tuple(a for a in range(ndim) if a not in reduction + output) + reduction + output


def newton_schulz(y: torch.Tensor, steps: int) -> torch.Tensor:
    """jaxpar/core/optimizer/muon.py's NS_k on each matrix of y [B, fan_in, fan_out], float32: jaxpar/optim.py's."""
    wide = y.shape[-2] <= y.shape[-1]  # iterate on X X^T of the smaller side (torch.optim.Muon's orientation)
    y = y if wide else y.mT
    y = y / torch.linalg.vector_norm(y, dim=(-2, -1), keepdim=True).clamp_min(muon.EPS)
    a, b, c = muon.COEFFS
    for _ in range(steps):
        gram = y @ y.mT
        y = a * y + (b * gram + c * gram @ gram) @ y
    return y if wide else y.mT


def orthogonalize(x: torch.Tensor, axes, steps: int) -> torch.Tensor:
    """NS_k on every matrix of `x` (its other axes batch axes), each on its own."""
    return from_matrices(newton_schulz(as_matrices(x, axes), steps), x.shape, axes)


class MuonAdamW(torch.optim.AdamW):
    """Muon on the groups marked "muon", AdamW's own step on the others.

    One optimizer (one state dict, one DCP checkpoint), and the AdamW parameters stepped exactly as under
    optim.name=adamw. The momentum is kept as the parameter is (an FSDP2 shard); under FSDP2 each rank runs
    Newton-Schulz on a share of the whole matrices (`orthogonalized`).
    """

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
        lr, decay = group["lr"], group["weight_decay"]
        params = [p for p in group["params"] if p.grad is not None]
        updates = [self._nesterov(p, o.muon_momentum) for p in params]
        for p, ortho in zip(params, orthogonalized(updates, [self.axes[p] for p in params], o.muon_ns_steps)):
            p.mul_(1 - lr * decay)
            p.add_(ortho, alpha=-lr * muon.lr_scale(o.muon_lr_rule, *muon.fans(p.shape, self.axes[p])))

    def _nesterov(self, p: torch.Tensor, m: float) -> torch.Tensor:
        """The momentum updated with p's gradient, and the Nesterov update from it (laid out as p is)."""
        state = self.state[p]
        if "momentum_buffer" not in state:  # and a step count, as AdamW's state (its load reads every "step")
            state["step"], state["momentum_buffer"] = torch.tensor(0.0), torch.zeros_like(p.grad)
        state["step"] += 1
        state["momentum_buffer"].lerp_(p.grad, 1 - m)
        return p.grad.lerp(state["momentum_buffer"], m)


def orthogonalized(updates: list, axes: list, steps: int) -> list:
    """Each update's NS_k, laid out as the update is.

    FSDP2's shards (a band of rows of every matrix on each rank) of the same matrix shape are stacked, padded with
    zero matrices to a multiple of the ranks and moved by DTensor's redistribute to whole matrices, a share on each
    rank (an all-to-all; on gloo torch all-gathers and keeps its chunk), and the result back the same way: each rank
    iterates on 1/ranks of the matrices rather than on all of them. A shard of whole matrices (experts: Shard(0) on
    a batch axis) is iterated where it is; a tensor FSDP2 did not shard, or any other layout, whole on every rank.
    """
    out, groups = [None] * len(updates), defaultdict(list)
    for i, (u, a) in enumerate(zip(updates, axes)):
        how = _sharding(u, a)
        if how == "rows":
            groups[(_band(u, a), muon.fans(u.shape, a), u.device_mesh, tuple(u.placements))].append(i)
        elif how == "matrices":
            out[i] = _local_like(u, orthogonalize(u.to_local(), a, steps))
        else:
            out[i] = _like(u, orthogonalize(whole(u), a, steps))
    for members in groups.values():
        for i, o in zip(members, _spread([updates[i] for i in members], [axes[i] for i in members], steps)):
            out[i] = o
    return out


def _sharding(u: torch.Tensor, axes) -> str | None:
    """How the update u is sharded for Muon: "rows", "matrices" or None.

    "rows" where u is FSDP2's Shard(0) on the first reduction axis (replicated on any other mesh axis: HSDP),
    "matrices" where dim 0 is a batch axis, None for any other tensor.
    """
    from torch.distributed.tensor import Shard  # deferred: DTensor on import keeps gloo alive at exit

    placements = getattr(u, "placements", ())
    if [p for p in placements if not p.is_replicate()] != [Shard(0)]:
        return None
    return "rows" if 0 in axes[0] else None if 0 in axes[1] else "matrices"


def _band(u, axes) -> int:
    """Rows of its matrices each rank holds, padded as FSDP2 pads: ceil(dim 0 / shards) x the rest of fan_in."""
    shards = u.device_mesh.size(next(i for i, p in enumerate(u.placements) if not p.is_replicate()))
    return -(-u.shape[0] // shards) * (muon.fans(u.shape, axes)[0] // u.shape[0])


# gloo has no all-to-all: DTensor all-gathers and keeps its chunk instead, and says so once per rank. Expected on
# the CPU (orthogonalized, docs/torchpar.md), so kept off the console
logging.getLogger("torch.distributed.tensor._collective_utils").addFilter(
    lambda record: "does not support alltoall" not in record.getMessage()
)


def _spread(updates: list, axes: list, steps: int) -> list:
    """NS_k of row-sharded updates of one matrix shape and band.

    Each rank a share of their matrices (see orthogonalized). Zero rows pad each band and zero matrices the count:
    Newton-Schulz keeps both zero, and the padding is dropped before it runs, so every matrix is iterated at its own
    shape.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard  # deferred: on import, gloo stays alive at exit

    mesh, band, fan_in = updates[0].device_mesh, _band(updates[0], axes[0]), muon.fans(updates[0].shape, axes[0])[0]
    bands = [as_matrices(u.to_local(), a) for u, a in zip(updates, axes)]
    stack = torch.cat([F.pad(b, (0, 0, 0, band - b.shape[1])) for b in bands])
    n = stack.shape[0]
    stack = F.pad(stack, (0, 0, 0, 0, 0, -n % mesh.size()))
    rows = [Replicate() if p.is_replicate() else Shard(1) for p in updates[0].placements]
    dealt = [Shard(0)] * mesh.ndim  # the matrices dealt out over every mesh axis
    mine = DTensor.from_local(stack, mesh, rows, run_check=False).redistribute(mesh, dealt).to_local()
    done = F.pad(newton_schulz(mine[:, :fan_in], steps), (0, 0, 0, mine.shape[1] - fan_in))
    back = DTensor.from_local(done, mesh, dealt, run_check=False).redistribute(mesh, rows).to_local()[:n]
    pieces = back.split([b.shape[0] for b in bands])
    return [
        _local_like(u, from_matrices(piece[:, : b.shape[1]], u.to_local().shape, a))
        for u, a, b, piece in zip(updates, axes, bands, pieces)
    ]


def _local_like(u, local: torch.Tensor):
    """`local` as this rank's share of a DTensor laid out as u."""
    from torch.distributed.tensor import DTensor  # deferred: DTensor on import keeps gloo alive at exit

    return DTensor.from_local(local, u.device_mesh, u.placements, run_check=False, shape=u.shape, stride=u.stride())


def _like(p: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """`whole` laid out as the parameter is: this rank's shard of it (no communication: every rank holds it all)."""
    if not hasattr(p, "device_mesh"):
        return whole
    from torch.distributed.tensor import distribute_tensor  # deferred: DTensor on import keeps gloo alive at exit

    return distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 DTensor (a plain tensor as it is)."""
    return t.to_local() if hasattr(t, "to_local") else t


def whole(t: torch.Tensor) -> torch.Tensor:
    """The full tensor of an FSDP2 DTensor (a collective over its mesh; a plain tensor as it is)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):  # torchao's optimizers hold it as a tensor (one compiled step)
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def group_settings(optimizer) -> list[dict]:
    """Each parameter group's settings as the optimizer was built (from the config).

    All but its parameters and lr (the schedule's).
    """
    return [{k: v for k, v in g.items() if k not in ("params", "lr")} for g in optimizer.param_groups]


def put_back(optimizer, settings: list[dict]) -> None:
    """After a checkpoint load (torch's Optimizer.load_state_dict replaces every group's settings with the saved ones).

    The config's settings again, the restored moments and step counts kept.
    """
    for group, own in zip(optimizer.param_groups, settings):
        group.update(own)


class SharedLRSchedule(LRScheduler):
    """The lr of the update at 0-based step s is lr_at(s): warmup + cosine, written once in jaxpar.

    Its state is its position (updates applied so far) alone: the schedule is the config's, so a run resumed with
    other optim.* or train.steps follows the new schedule from where it stood.
    """

    POSITION = ("last_epoch", "_step_count")

    def __init__(self, optimizer, cfg: Config, last_epoch: int = -1):
        self.cfg = cfg
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        return [lr_at(self.last_epoch, self.cfg.optim, self.cfg.train.steps) for _ in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.POSITION}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the saved position, and the lr there under this config.

        Only the position is taken, also from a checkpoint that holds the whole scheduler, its config too.
        """
        for k in self.POSITION:
            setattr(self, k, state_dict[k])
        self.apply()

    def apply(self) -> None:
        """Every group's lr: the schedule's at its position (after an optimizer load put the saved lr back)."""
        self._last_lr = self.get_lr()
        set_lr(self.optimizer, self._last_lr[0])


def torchao_adamw8bit(groups: list[dict], compile_step: bool, **kwargs) -> torch.optim.Optimizer:
    """torchao's AdamW8bit with jaxpar/core/optimizer/adamw8bit.py's block size.

    It decides which tensors hold 8-bit moments on the whole parameter (torchao decides on this rank's FSDP shard, so
    a 2-way shard of a tensor at the size limit would step differently from one process). Its step is compiled on a
    GPU only: on a CPU compiling each parameter's step costs far more than it gains at these sizes.
    """
    from torch.distributed.tensor import DTensor  # deferred: DTensor on import keeps gloo alive at exit

    with quiet_logs("torchao", "torch.utils._pytree"):  # torchao's CUDA kernels it cannot load here: not ours to use
        from torchao.optim import AdamW8bit  # deferred: torchao, optional (~2 s): optim.name=adamw8bit

    class Whole8bit(AdamW8bit):
        eight_bit = True

        def _new_buffer(self, p: torch.Tensor, signed: bool):
            if not holds_codes(p):
                return torch.zeros_like(p)
            codes = self._subclass_zeros(local(p), signed, adamw8bit.BLOCK)
            if isinstance(p, DTensor):
                codes = DTensor.from_local(
                    codes, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                )
            return codes.to(p.device)

        def step(self, closure=None):
            if compile_step:
                return super().step(closure)
            with torch.compiler.set_stance("force_eager"):
                return super().step(closure)

    return Whole8bit(groups, block_size=adamw8bit.BLOCK, **kwargs)


def holds_codes(p: torch.Tensor) -> bool:
    """Whether adamw8bit keeps p's moments in 8 bits.

    The whole parameter's size decides, and this rank's shard must be whole blocks.
    """
    return adamw8bit.quantized(p.numel()) and local(p).numel() % adamw8bit.BLOCK == 0


def state_bytes(optimizer) -> int:
    """The bytes of state this rank's optimizer holds once it has stepped (torch makes it at the first step).

    AdamW's two float32 moments per element, Muon's one momentum, adamw8bit's two codes and their blocks' scales.
    """
    total = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            n = local(p).numel()
            if group.get("muon"):
                total += 4 * n
            elif getattr(optimizer, "eight_bit", False) and holds_codes(p):
                total += 2 * (n + 4 * n // adamw8bit.BLOCK)
            else:
                total += 8 * n
    return total
