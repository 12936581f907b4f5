"""DistributedDataParallel: replicated parameters, gradients all-reduced by DDP in backward."""
from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel as DDP

from torchpar.backends.base import TorchEngine


def build(model, cfg, env, **_):
    model = model.to(env.device)
    ddp = DDP(model, device_ids=[env.device.index] if env.device.type == "cuda" else None)
    # Accumulation: no all-reduce until the last microbatch's backward.
    return TorchEngine(ddp, model, cfg, env, sync=lambda last: ddp.no_sync() if not last else _null())


def _null():
    from contextlib import nullcontext
    return nullcontext()
