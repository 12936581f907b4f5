"""The torch-side step shared by none/ddp/fsdp: accumulate, clip, AdamW; DCP checkpoints.

model.compute_dtype=float16: torch.amp.GradScaler (fsdp: its sharded variant, which agrees on an overflow
over all ranks) with the optim.loss_scale_* keys, clamped at optim.loss_scale_min as jaxpar does
(jaxpar/loss_scale.py). A skipped step does not advance the learning-rate schedule; the scaler's scale and
count and the skipped count travel in the checkpoint's meta.json. A resume takes the state from the checkpoint
and every setting from the config: lr, betas, eps, weight decay, clipping and the scaler's rules.

Gradient synchronisation is the wrapper's own (DDP's all-reduce, FSDP2's reduce-scatter); this
file only chooses on which microbatch it happens (`sync` context) and reads the clipped norm.
`full_state_dict()` returns the whole (unsharded) parameters by torch name on rank 0: the plain
module's state_dict here (none, ddp); fsdp passes its own gather. Every engine, DeepSpeed's included, is an
`Engine` (torchpar/backends/__init__.py).
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch

from jaxpar.core.model.experts import expert_records
from jaxpar.core.optimizer.lr_schedule import lr_at
from torchpar import dist
from torchpar.checkpoint import DCPCheckpointer
from torchpar.models.decoder import inputs_and_targets
from torchpar.models.moe import balance_loss, update_router_bias
from torchpar.optim import group_settings, local, make_optimizer, put_back, set_lr, state_bytes, whole


def microbatches(batch: torch.Tensor, M: int) -> list[torch.Tensor]:
    """train.microbatches: microbatch m = rows m, m+M, ... (as jaxpar splits them)."""
    return [batch[m::M] for m in range(M)]


def read_metrics(handle, env, data_ways: int, experts: int = 0, groups: bool = False) -> dict:
    """A step's (local loss, grad_norm, lr, extra) as a dict of floats.

    The loss is averaged over the ranks that hold a share of the batch, the experts' statistics summed over them
    (a collective: every rank calls it at the same steps). `groups` (DiLoCo's, each its own norm): the grad norm is
    their mean.
    """
    loss, grad_norm, lr, extra = handle
    stats, depths = extra.pop("expert_stats", None), extra.pop("mtp_losses", None)
    depths = [] if depths is None else depths.tolist()  # multi-token prediction's, each depth's as the loss is
    norm = [float(grad_norm)] if groups else []  # every rank of a group holds its group's norm
    loss_sum, *stats = dist.all_sum([float(loss)] + norm + depths + ([] if stats is None else stats.tolist()), env)
    if groups:
        grad_norm, stats = stats[0] / env.world, stats[1:]
    extra = {**extra, **{f"mtp_loss_{d + 1}": v / data_ways for d, v in enumerate(stats[: len(depths)])}}
    stats = stats[len(depths) :]
    if stats:  # [choices per expert, dropped, balance loss per layer, rows] over every rank and microbatch
        extra = {**extra, **expert_records(stats[:-2] + [stats[-2] / stats[-1]], experts)}
    return {"loss": loss_sum / data_ways, "grad_norm": float(grad_norm), "lr": float(lr), **extra}


def microbatch_loss(module, raw, batch: torch.Tensor):
    """The training loss of a microbatch and its experts' statistics.

    (the training loss of rows [batch, seq + 1]: cross-entropy, with experts plus their weighted balance loss;
    the experts' statistics summed over the rows, the balance per layer and the row count appended, or None). The
    wrapped module computes the cross-entropy in its forward (model.loss_chunks: the whole logits never held).
    """
    inputs, targets = inputs_and_targets(batch)
    loss = module(inputs, targets)
    stats = raw.expert_stats  # the forward's (torchpar/models/decoder.py)
    if stats is None:
        return loss, None
    summed = stats.detach().sum(0)
    summed[-1] /= raw.cfg.moe_layers
    return loss + balance_loss(raw, stats), torch.cat([summed, summed.new_tensor([stats.shape[0]])])


def mtp_share(raw, weight: float):
    """The last forward's per-depth losses (model.mtp_depth) times `weight`, as a microbatch's loss is; None without."""
    return None if not raw.cfg.mtp_depth else raw.mtp_losses * weight


def add_stats(total, stats):
    return stats if total is None else total + stats


def eval_loss(module, batch: torch.Tensor, share: float = 1.0) -> float:
    inputs, targets = inputs_and_targets(batch)
    with torch.no_grad():
        return float(module(inputs, targets)) * share


def grad_scaler(cfg, env, sharded: bool = False):
    """float16's loss scaler with the shared keys; None for float32 and bfloat16."""
    if cfg.model.compute_dtype != "float16":
        return None
    o = cfg.optim
    kwargs = {
        "init_scale": o.loss_scale_init,
        "growth_factor": o.loss_scale_growth_factor,
        "backoff_factor": o.loss_scale_backoff_factor,
        "growth_interval": o.loss_scale_growth_interval,
    }
    if sharded:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler  # deferred: at import time it keeps
        # gloo threads alive at exit (tests/torchpar/test_torchpar_exit.py)

        return ShardedGradScaler(env.device.type, **kwargs)
    return torch.amp.GradScaler(env.device.type, **kwargs)


class TorchEngine:
    groups = None  # DiLoCo's (torchpar/diloco.py `Groups`), set by use_groups

    def __init__(self, module, raw, cfg, env, sync=lambda last: nullcontext(), full_state=None, scaler=None):
        self.module, self.raw, self.cfg, self.env, self.sync = module, raw, cfg, env, sync
        self.scaler = scaler if scaler is not None else grad_scaler(cfg, env)
        self.skipped, self.overflow_next = 0, False  # float16: updates skipped so far; the test hook
        self.expert_stats = None  # with experts: their statistics of the step so far (microbatch_loss)
        self.mtp_losses = None  # with multi-token prediction: each depth's loss of the step so far, as the loss
        self.full_state_dict = full_state or raw.state_dict
        self.params = [p for p in raw.parameters()]
        self.optimizer = make_optimizer(raw, cfg)
        self.checkpointer = DCPCheckpointer(cfg.run.dir, cfg.checkpoint.keep, module, self.optimizer, env)
        self.step = 0  # updates so far: restore() sets it
        # which share of each global batch this rank reads, and how many ranks' losses make the mean
        self.data_rank, self.data_ways = env.rank, env.world

    @property
    def local_params(self) -> int:
        """Parameter elements this rank holds: its shards under FSDP2, its stage under pipeline, else all."""
        return sum(local(p).numel() for p in self.params)

    @property
    def optimizer_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (once it has stepped)."""
        return state_bytes(self.optimizer)

    def eval_loss(self, batch: torch.Tensor, share: float = 1.0) -> float:
        return eval_loss(self.module, batch, share)

    def read(self, handle) -> dict:
        return read_metrics(handle, self.env, self.data_ways, self.cfg.model.moe_experts, self.groups is not None)

    def inject_overflow(self) -> None:
        self.overflow_next = True

    def update(self, batch: torch.Tensor, share: float = 1.0):
        """This rank's rows of the global batch: accumulate over train.microbatches, clip, update.

        A handle on the metrics (read them with `read`). `share`: the framework's token_share (1.0 without a
        loss mask).
        """
        micro = microbatches(batch, self.cfg.train.microbatches)
        lr = lr_at(self.step - self.skipped, self.cfg.optim, self.cfg.train.steps)  # counts applied updates
        set_lr(self.optimizer, lr)
        total = self.forward_backward(micro, share)
        if self.overflow_next:  # test hook: this step's gradients overflow
            next(p for p in self.params if p.grad is not None).grad.fill_(float("inf"))
            self.overflow_next = False
        if self.scaler is None:
            norm = self.clip_gradients(self.cfg.optim.grad_clip or float("inf"))
            self.optimizer.step()
            extra = {}
        else:
            scale = self.scaler.get_scale()
            self.scaler.unscale_(self.optimizer)
            norm = self.clip_gradients(self.cfg.optim.grad_clip or float("inf"))
            self.scaler.step(self.optimizer)  # skipped where a gradient is not finite
            self.scaler.update()
            if self.scaler.get_scale() < self.cfg.optim.loss_scale_min:
                self.scaler.update(new_scale=self.cfg.optim.loss_scale_min)
            applied = math.isfinite(float(norm))  # the global norm: inf on any rank's overflow
            self.skipped += not applied
            extra = {"loss_scale": scale, "skipped_steps": self.skipped}
        if self.cfg.model.moe_bias_update and (self.scaler is None or applied):  # a skipped step keeps the bias
            m = self.cfg.model
            loads = self.expert_stats[: m.moe_layers * m.moe_experts].tolist()  # DiLoCo: the group's own
            self.move_router_bias(self.groups.sum_within(loads) if self.groups else dist.all_sum(loads, self.env))
        if self.expert_stats is not None:
            extra["expert_stats"] = self.expert_stats
        if self.mtp_losses is not None:
            extra["mtp_losses"] = self.mtp_losses
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        if self.groups is not None:
            self.groups.after(self.step - 1)
        return total, norm, lr, extra

    def use_groups(self, groups) -> None:
        """DiLoCo (torchpar/diloco.py): meetings after the steps, each group's own bias loads and checkpoint state."""
        self.groups = self.checkpointer.views = groups
        self.checkpointer.groups = groups.count

    def move_router_bias(self, loads: list[float]) -> None:
        """The experts' balance bias moved by the step's loads (every rank's, layer-major).

        The pipeline moves its stage's layers' alone.
        """
        update_router_bias(self.raw, loads)

    def save(self, step: int, meta: dict) -> None:
        """A DCP checkpoint; meta.json also carries float16's scaler and skipped count."""
        if self.scaler is not None:
            meta = {**meta, "grad_scaler": self.scaler.state_dict(), "skipped_steps": self.skipped}
        if self.groups is not None:
            meta = {**meta, "diloco_groups": self.groups.count}
        self.checkpointer.save(step, meta)

    def restore(self) -> int | None:
        """The latest complete checkpoint loaded (what an earlier process left unfinished removed first).

        Its data step, or None where there is none.
        """
        self.checkpointer.remove_partial_saves()
        settings = group_settings(self.optimizer)  # the config's betas, eps, weight decay: not the checkpoint's
        meta = self.checkpointer.restore()
        put_back(self.optimizer, settings)
        if meta is None:
            return None
        if self.scaler is not None and "grad_scaler" in meta:
            self.restore_scaler(meta["grad_scaler"])
            self.skipped = int(meta["skipped_steps"])
        self.step = int(meta["data_step"])
        return self.step

    def restore_scaler(self, saved: dict) -> None:
        """float16: the saved scale and count of clean steps.

        The growth and backoff rules stay the config's (GradScaler.load_state_dict would take the saved ones
        too). GradScaler grows when the count reaches the interval exactly: a count past a shortened interval is
        held at one below it, so the next clean step grows the scale, as jaxpar's rule (count >= interval,
        jaxpar/loss_scale.py) does.
        """
        state = self.scaler.state_dict()
        count = min(saved["_growth_tracker"], state["growth_interval"] - 1)
        self.scaler.load_state_dict({**state, "scale": saved["scale"], "_growth_tracker": count})

    def forward_backward(self, micro: list[torch.Tensor], share: float = 1.0) -> torch.Tensor:
        """Gradients of the mean loss (times `share`) over the microbatches accumulated in .grad; returns that loss."""
        total, self.expert_stats, self.mtp_losses = torch.zeros((), device=micro[0].device), None, None
        for m, batch in enumerate(micro):
            with self.sync(m == len(micro) - 1):
                loss, stats = microbatch_loss(self.module, self.raw, batch)
                loss = loss * share / len(micro)
                (loss if self.scaler is None else self.scaler.scale(loss)).backward()
            total += loss.detach()
            self.expert_stats = add_stats(self.expert_stats, stats)
            self.mtp_losses = add_stats(self.mtp_losses, mtp_share(self.raw, share / len(micro)))
        return total

    def clip_gradients(self, clip: float) -> torch.Tensor:
        """Clip to the global norm; returns the pre-clip norm."""
        norm = torch.nn.utils.clip_grad_norm_(self.params, clip)  # DTensor-aware for FSDP2
        return whole(norm)
