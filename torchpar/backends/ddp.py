"""DistributedDataParallel: replicated parameters, gradients all-reduced by DDP in backward.

parallel.grad_compression puts one of torch's DDP communication hooks on that all-reduce: bf16 (each bucket
sent as bfloat16, divided by the world size first, back to float32 after) or PowerSGD (rank-r factors P, Q
of each gradient matrix all-reduced instead of the matrix, with error feedback and warm start; vectors and
matrices that would not shrink 2x go uncompressed; the first parallel.powersgd_warmup_steps steps run plain).
PowerSGD's state (error buffers, Q factors, its step count) is each rank's own: saved beside the DCP
checkpoint, one file per rank (torch's own pickling of PowerSGDState), and restored when the world size is
the same; on another world size it starts afresh after its warm-up, and says so.
"""
from __future__ import annotations

import logging
import math
import os
import sys
from contextlib import contextmanager, nullcontext

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from torchpar.backends.base import TorchEngine


def comm_hook(cfg) -> tuple[str, dict]:
    """parallel.grad_compression as a DDP hook: its name and PowerSGDState's settings (PowerSGD only)."""
    p = cfg.parallel
    if p.grad_compression != "powersgd":
        return p.grad_compression, {}
    return "powersgd", {"matrix_approximation_rank": p.powersgd_rank, "start_powerSGD_iter": p.powersgd_warmup_steps,
                        "use_error_feedback": True, "warm_start": True, "random_seed": cfg.train.seed}


def bf16_hook(process_group, bucket):
    """torch's bf16_compress_hook itself. DDP refuses that function by name unless CUDA with NCCL 2.10+ runs it;
    gloo reduces bfloat16 as well (checked with torch 2.13), so on the CPU it goes through this wrapper."""
    return default_hooks.bf16_compress_hook(process_group, bucket)


def one_bucket_mb(model) -> int:
    """A bucket size that holds every gradient: PowerSGD over gloo. Its hook chains three all-reduces per bucket
    in future callbacks; with two buckets in flight, gloo (which matches collectives by issue order) pairs one
    rank's P factors with another's uncompressed vectors past 2 ranks (a size-mismatch abort, or a hang)."""
    return math.ceil(sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20) + 1


def rebuild_buckets_first(ddp, cfg, env) -> None:
    """One synchronised backward of a zero loss (gradients all zero, then dropped; no update): DDP rebuilds its
    buckets in the order gradients arrive after its first backward, so a hook registered after this one sees
    the final buckets from its first step on. PowerSGD keys its error buffers by bucket: a run resumed from a
    checkpoint would otherwise apply the saved buffers to its first step's other buckets."""
    x = torch.ones((1, cfg.data.seq_len), dtype=torch.long, device=env.device)
    (ddp(x).float().mean() * 0.0).backward()
    for p in ddp.parameters():
        p.grad = None


def build(model, cfg, env, **_):
    model = model.to(env.device)
    name, settings = comm_hook(cfg)
    ddp = DDP(model, device_ids=[env.device.index] if env.device.type == "cuda" else None,
              bucket_cap_mb=one_bucket_mb(model) if name == "powersgd" and env.device.type != "cuda" else None)
    state = None
    if name == "bf16":
        ddp.register_comm_hook(None, bf16_hook)
    elif name == "powersgd":
        rebuild_buckets_first(ddp, cfg, env)
        state = powerSGD_hook.PowerSGDState(process_group=None, **settings)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    # Accumulation: no all-reduce until the last microbatch's backward (the hooks run only then too).
    engine = DDPEngine(ddp, model, cfg, env, sync=lambda last: nullcontext() if last else ddp.no_sync())
    engine.hook, engine.powersgd = name, state
    if state is not None:
        engine.checkpointer.rank_state = PowerSGDCheckpoint(state, env)
    return engine


class DDPEngine(TorchEngine):
    """TorchEngine, its step also reporting `grad_comm_bytes`: what this rank handed to the gradient all-reduce
    (the payload; a ring all-reduce sends about twice that): 4 bytes per gradient element plain, 2 with bf16,
    and with PowerSGD what its hook counted (r(n+m) per compressed n x m matrix, the rest whole; its warm-up
    steps send everything whole)."""
    hook, powersgd = "none", None

    def train_step(self, batch: torch.Tensor):
        before = self.powersgd.total_numel_after_compression if self.powersgd is not None else 0
        total, norm, lr, extra = super().train_step(batch)
        numel = sum(p.numel() for p in self.params if p.requires_grad)
        sent = numel * (2 if self.hook == "bf16" else 4)
        if self.powersgd is not None and self.powersgd.total_numel_after_compression > before:
            sent = 4 * (self.powersgd.total_numel_after_compression - before)
        return total, norm, lr, {**extra, "grad_comm_bytes": sent}


@contextmanager
def _quiet_powersgd():
    """PowerSGDState's pickling warns that the process group is left out (it is set again here): not for the
    console."""
    logger = logging.getLogger(powerSGD_hook.__name__)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


class PowerSGDCheckpoint:
    """This rank's PowerSGD state in a checkpoint directory (torchpar/checkpoint.py calls save and load)."""

    def __init__(self, state, env):
        self.state, self.env = state, env

    def path(self, folder: str) -> str:
        return os.path.join(folder, f"powersgd-rank{self.env.rank}-of-{self.env.world}.pt")

    def save(self, folder: str) -> None:
        with _quiet_powersgd():
            torch.save(self.state.__getstate__(), self.path(folder))

    def load(self, folder: str) -> None:
        path = self.path(folder)
        if not os.path.exists(path):
            if self.env.is_main:
                print(f"PowerSGD: {folder} holds no error-feedback state for {self.env.world} ranks; it starts afresh "
                      f"(after {self.state.start_powerSGD_iter} plain steps)", file=sys.stderr)
            return
        with _quiet_powersgd():
            saved = torch.load(path, weights_only=False)
        group = self.state.process_group
        for slot, value in saved.items():
            setattr(self.state, slot, value)
        self.state.process_group = group
