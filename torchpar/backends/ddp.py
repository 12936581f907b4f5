"""DistributedDataParallel: replicated parameters, gradients all-reduced by DDP in backward.

parallel.grad_compression puts one of torch's DDP communication hooks on that all-reduce: bf16 (each bucket
sent as bfloat16, divided by the world size first, back to float32 after) or PowerSGD (rank-r factors P, Q
of each gradient matrix all-reduced instead of the matrix, with error feedback and warm start; vectors and
matrices that would not shrink 2x go uncompressed; the first parallel.powersgd_warmup_steps steps run plain).
PowerSGD's state (error buffers, P and Q factors, its step count) is each rank's own: saved beside the DCP
checkpoint, one file per rank (PowerSGDState's runtime slots, as its own pickling keeps them), and restored
where the buckets it was keyed by are the same (world size, bucket size, device kind, rank r); elsewhere it
starts afresh after its warm-up, and says so.
"""
from __future__ import annotations

import math
import os
import sys
from contextlib import nullcontext

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from torchpar import dist
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
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    engine.plain_bytes, engine.powersgd = numel * (2 if name == "bf16" else 4), state
    if state is not None:
        buckets = (env.world, ddp.bucket_bytes_cap, env.device.type, cfg.parallel.powersgd_rank)
        engine.checkpointer.rank_state = PowerSGDCheckpoint(state, env, buckets)
    return engine


class DDPEngine(TorchEngine):
    """TorchEngine, its step also reporting `grad_comm_bytes`: what this rank handed to the gradient all-reduce
    (the payload; a ring all-reduce sends about twice that): 4 bytes per gradient element plain, 2 with bf16,
    and with PowerSGD what its hook counted (r(n+m) per compressed n x m matrix, the rest whole; its warm-up
    steps send everything whole)."""
    plain_bytes, powersgd = 0, None  # what the hook sends whole (set by build), PowerSGD's state

    def train_step(self, batch: torch.Tensor):
        before = self.powersgd.total_numel_after_compression if self.powersgd is not None else 0
        total, norm, lr, extra = super().train_step(batch)
        sent = self.plain_bytes
        if self.powersgd is not None and self.powersgd.total_numel_after_compression > before:
            sent = 4 * (self.powersgd.total_numel_after_compression - before)
        return total, norm, lr, {**extra, "grad_comm_bytes": sent}


class PowerSGDCheckpoint:
    """This rank's PowerSGD state in a checkpoint directory (torchpar/checkpoint.py calls save and load): the
    runtime slots only (the settings come from the config at hand), and the buckets they were keyed by."""
    RUNTIME = ("rng", "error_dict", "p_memory_dict", "q_memory_dict", "iter", "total_numel_before_compression",
               "total_numel_after_compression", "next_stats_report")

    def __init__(self, state, env, buckets: tuple):
        self.state, self.env, self.buckets = state, env, buckets  # buckets: what decides DDP's bucket layout

    def path(self, folder: str) -> str:
        return os.path.join(folder, f"powersgd-rank{self.env.rank}-of-{self.env.world}.pt")

    def save(self, folder: str) -> None:
        saved = {slot: getattr(self.state, slot) for slot in self.RUNTIME}
        torch.save({**saved, "buckets": self.buckets}, self.path(folder))

    def load(self, folder: str) -> None:
        """Every rank restores, or none does (one rank compressing while another warms up would hang)."""
        path = self.path(folder)
        saved = torch.load(path, map_location=self.env.device, weights_only=False) if os.path.exists(path) else {}
        if dist.any_rank(saved.get("buckets") != self.buckets, self.env):
            if self.env.is_main:
                print(f"PowerSGD: {folder} holds no error-feedback state for this layout ({self.env.world} ranks, "
                      f"rank {self.state.matrix_approximation_rank}, the same buckets); it starts afresh (after "
                      f"{self.state.start_powerSGD_iter} plain steps)", file=sys.stderr)
            return
        for slot in self.RUNTIME:
            setattr(self.state, slot, saved[slot])
