"""DistributedDataParallel: replicated parameters, gradients all-reduced by DDP in backward."""
from __future__ import annotations

from contextlib import nullcontext

from torch.nn.parallel import DistributedDataParallel as DDP

from torchpar.backends.base import TorchEngine


def build(model, cfg, env, **_):
    model = model.to(env.device)
    ddp = DDP(model, device_ids=[env.device.index] if env.device.type == "cuda" else None)
    # Accumulation: no all-reduce until the last microbatch's backward.
    return TorchEngine(ddp, model, cfg, env, sync=lambda last: nullcontext() if last else ddp.no_sync())
