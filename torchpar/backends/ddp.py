"""DistributedDataParallel: replicated parameters, gradients all-reduced by DDP in backward.

parallel.grad_compression puts one of torch's DDP communication hooks on that all-reduce: bf16 (each bucket
sent as bfloat16, divided by the world size first, back to float32 after) or PowerSGD (rank-r factors P, Q
of each gradient matrix all-reduced instead of the matrix, with error feedback and warm start; vectors and
matrices that would not shrink 2x go uncompressed; the first parallel.powersgd_warmup_steps steps run plain).
PowerSGD's state (error buffers, P and Q factors, its step count) is each rank's own: saved beside the DCP
checkpoint, one file per rank (PowerSGDState's runtime slots, its numpy generator as plain numbers: the file holds
tensors and plain values only, read with torch.load(weights_only=True), so a run directory from elsewhere runs no
code on resume), and restored
where the buckets it was keyed by are the same (bucket size, device kind): on another number of ranks with the
error buffers averaged, with another rank r with fresh factors; elsewhere it starts afresh after its warm-up.
"""

from __future__ import annotations

import math
import os
import pickle
import re
import sys
from contextlib import nullcontext

import numpy as np
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from jaxpar.core.errors import UserError
from torchpar import dist
from torchpar.backends.base import TorchEngine
from torchpar.backends.experts import ExpertParallel, ep_size
from torchpar.diloco import Groups, group_count, group_mesh


def comm_hook(cfg) -> tuple[str, dict]:
    """parallel.grad_compression as a DDP hook: its name and PowerSGDState's settings (PowerSGD only)."""
    p = cfg.parallel
    if p.grad_compression != "powersgd":
        return p.grad_compression, {}
    return "powersgd", {
        "matrix_approximation_rank": p.powersgd_rank,
        "start_powerSGD_iter": p.powersgd_warmup_steps,
        "use_error_feedback": True,
        "warm_start": True,
        "random_seed": cfg.train.seed,
    }


def bf16_hook(process_group, bucket):
    """torch's bf16_compress_hook itself.

    DDP refuses that function by name unless CUDA with NCCL 2.10+ runs it; gloo reduces bfloat16 as well (checked
    with torch 2.13), so on the CPU it goes through this wrapper.
    """
    return default_hooks.bf16_compress_hook(process_group, bucket)


def one_bucket_mb(model) -> int:
    """A bucket size that holds every gradient: PowerSGD over gloo.

    Its hook chains three all-reduces per bucket in future callbacks; with two buckets in flight, gloo (which
    matches collectives by issue order) pairs one rank's P factors with another's uncompressed vectors past 2 ranks
    (a size-mismatch abort, or a hang).
    """
    return math.ceil(sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20) + 1


def rebuild_buckets_first(ddp, cfg, env) -> None:
    """One synchronised backward of a zero loss (gradients all zero, then dropped; no update).

    DDP rebuilds its buckets in the order gradients arrive after its first backward, so a hook registered after this
    one sees the final buckets from its first step on. PowerSGD keys its error buffers by bucket: a run resumed from
    a checkpoint would otherwise apply the saved buffers to its first step's other buckets.
    """
    x = torch.ones((1, cfg.data.seq_len), dtype=torch.long, device=env.device)
    (ddp(x).float().mean() * 0.0).backward()
    for p in ddp.parameters():
        p.grad = None


def build(model, cfg, env, **_):
    model = model.to(env.device)
    ep = ep_size(cfg, env.world)
    experts = ExpertParallel(model, env, ep) if ep > 1 else None  # before DDP: it ignores the experts
    name, settings = comm_hook(cfg)
    groups = group_count(cfg, env.world)  # DiLoCo's: DDP inside each group of ranks
    mesh, inner = group_mesh(env, (groups, env.world // groups), ("dp",)) if groups > 1 else (None, None)
    ddp = DDP(
        model,
        device_ids=[env.device.index] if env.device.type == "cuda" else None,
        bucket_cap_mb=one_bucket_mb(model) if name == "powersgd" and env.device.type != "cuda" else None,
        process_group=inner.get_group() if inner is not None else None,
    )
    state = None
    if name == "bf16":
        ddp.register_comm_hook(inner.get_group() if inner is not None else None, bf16_hook)  # None: every rank
    elif name == "powersgd":
        rebuild_buckets_first(ddp, cfg, env)
        state = powerSGD_hook.PowerSGDState(process_group=None, **settings)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    # Accumulation: no all-reduce until the last microbatch's backward (the hooks run only then too).
    sync = (
        (lambda last: experts.sync(last, ddp)) if experts else (lambda last: nullcontext() if last else ddp.no_sync())
    )
    engine = DDPEngine(ddp, model, cfg, env, sync=sync)
    if experts is not None:
        engine.use_experts(experts)
    if groups > 1:
        engine.use_groups(Groups(model, cfg, env, mesh, groups))
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    engine.plain_bytes, engine.powersgd = numel * (2 if name == "bf16" else 4), state
    if state is not None:
        buckets = (env.world, ddp.bucket_bytes_cap, env.device.type, cfg.parallel.powersgd_rank)
        engine.checkpointer.rank_state = PowerSGDCheckpoint(state, env, buckets)
    return engine


class DDPEngine(TorchEngine):
    """TorchEngine, its step also reporting `grad_comm_bytes`.

    What this rank handed to the gradient all-reduce (the payload; a ring all-reduce sends about twice that): 4
    bytes per gradient element plain, 2 with bf16, and with PowerSGD what its hook counted (r(n+m) per compressed n
    x m matrix, the rest whole; its warm-up steps send everything whole).
    """

    plain_bytes, powersgd = 0, None  # what the hook sends whole (set by build), PowerSGD's state
    experts = None  # parallel.mesh's ep: ExpertParallel (torchpar/backends/experts.py)

    def use_experts(self, experts) -> None:
        """Expert parallelism: the experts join the norm, checkpoints and full weights."""
        self.experts = experts
        self.checkpointer.views = experts
        self.full_state_dict = lambda: experts.full_state_dict(self.raw)

    def clip_gradients(self, clip: float) -> torch.Tensor:
        return super().clip_gradients(clip) if self.experts is None else self.experts.clip(self.params, clip)

    def update(self, batch: torch.Tensor, share: float = 1.0):
        before = self.powersgd.total_numel_after_compression if self.powersgd is not None else 0
        total, norm, lr, extra = super().update(batch, share)
        sent = self.plain_bytes
        if self.powersgd is not None and self.powersgd.total_numel_after_compression > before:
            sent = 4 * (self.powersgd.total_numel_after_compression - before)
        return total, norm, lr, {**extra, "grad_comm_bytes": sent}


class PowerSGDCheckpoint:
    """This rank's PowerSGD state in a checkpoint directory (torchpar/checkpoint.py calls save and load).

    The runtime slots only (the settings come from the config at hand), and the buckets they were keyed by. Resumed
    on another number of ranks, every rank takes the mean of the saved error buffers (what the next steps owe on
    average over the ranks stays what it was; DDP's buckets do not depend on the number of ranks), as jaxpar does
    (jaxpar/parallel/powersgd.py); with another rank r, the buffers stay and the factors start afresh.
    """

    RUNTIME = (
        "rng",
        "error_dict",
        "p_memory_dict",
        "q_memory_dict",
        "iter",
        "total_numel_before_compression",
        "total_numel_after_compression",
        "next_stats_report",
    )
    FACTORS = ("p_memory_dict", "q_memory_dict")

    def __init__(self, state, env, buckets: tuple):
        self.state, self.env, self.buckets = state, env, buckets  # (world, bucket cap, device kind, rank r)

    def path(self, folder: str, rank: int | None = None, world: int | None = None) -> str:
        rank, world = (self.env.rank, self.env.world) if rank is None else (rank, world)
        return os.path.join(folder, f"powersgd-rank{rank}-of-{world}.pt")

    def save(self, folder: str) -> None:
        saved = {slot: getattr(self.state, slot) for slot in self.RUNTIME}
        name, keys, pos, has_gauss, gauss = self.state.rng.get_state()  # numpy's MT19937: no pickled object
        saved["rng"] = (name, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss)
        torch.save({**saved, "buckets": self.buckets}, self.path(folder))

    def _load(self, path: str) -> dict:
        try:
            return torch.load(path, map_location=self.env.device, weights_only=True)
        except pickle.UnpicklingError:
            raise UserError(
                f"{path} holds objects other than tensors (an older torchpar's format, or "
                "not torchpar's): it is not unpickled, as that could run code; remove the "
                "powersgd-rank*.pt files of that checkpoint to resume with PowerSGD's "
                "state afresh"
            ) from None

    def _saved(self, folder: str) -> dict:
        """The PowerSGD state this rank restores from `folder`.

        This rank's file; where the checkpoint was written by another number of ranks, rank 0's with the error
        buffers averaged over all of theirs.
        """
        load = self._load
        if os.path.exists(self.path(folder)):
            return load(self.path(folder))
        worlds = {int(m[1]) for m in map(re.compile(r"powersgd-rank0-of-(\d+)\.pt$").match, os.listdir(folder)) if m}
        if len(worlds) != 1:
            return {}
        world = worlds.pop()
        if world == self.env.world:  # this rank's own file is missing: no state to restore
            return {}
        states = [load(self.path(folder, r, world)) for r in range(world)]
        errors = {b: torch.stack([s["error_dict"][b] for s in states]).mean(0) for b in states[0]["error_dict"]}
        return {**states[0], "error_dict": errors}

    def load(self, folder: str) -> None:
        """Every rank restores, or none does (one rank compressing while another warms up would hang)."""
        saved = self._saved(folder) if os.path.isdir(folder) else {}
        kept = saved.get("buckets", (None,) * 4)
        if dist.any_rank(kept[1:3] != self.buckets[1:3], self.env):  # bucket cap, device: another bucket layout
            if self.env.is_main:
                print(
                    f"PowerSGD: {folder} holds no error-feedback state for these gradient buckets; it starts "
                    f"afresh (after {self.state.start_powerSGD_iter} plain steps)",
                    file=sys.stderr,
                )
            return
        for slot in self.RUNTIME:
            setattr(self.state, slot, saved[slot])
        name, keys, *rest = saved["rng"]
        self.state.rng = np.random.RandomState()
        self.state.rng.set_state((name, keys.numpy().astype(np.uint32), *rest))
        said = []
        if kept[0] != self.buckets[0]:
            said.append(f"the error buffers of {kept[0]} ranks averaged onto {self.buckets[0]}")
        if kept[3] != self.buckets[3]:  # P and Q are rank r wide: the hook makes them afresh
            for slot in self.FACTORS:
                setattr(self.state, slot, {})
            said.append(f"rank r {kept[3]} -> {self.buckets[3]}: its factors start afresh")
        if said and self.env.is_main:
            print(f"PowerSGD: {'; '.join(said)} (resumed from {folder})", file=sys.stderr)
