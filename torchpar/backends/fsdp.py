"""FSDP2: `fully_shard` per block and at the root on a 1-D DeviceMesh over all ranks.

model.compute_dtype=bfloat16 or float16 -> MixedPrecisionPolicy(param_dtype=that, reduce_dtype=fp32) (float16:
with the sharded GradScaler, torchpar/backends/base.py); parallel.offload=params+optimizer -> CPUOffloadPolicy; model.remat is applied inside the model (torch.utils.checkpoint).
parallel.zero_stage 1 or 2 keeps parameters gathered between forward and backward
(reshard_after_forward=False, ZeRO-2-like); 0 or 3 reshards after forward (ZeRO-3).
Full weights (--write-final): `get_model_state_dict(full_state_dict, cpu_offload)` gathers them to rank 0.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from torchpar.backends.base import TorchEngine, grad_scaler


def build(model, cfg, env, **_):
    cpu_offload = cfg.parallel.offload == "params+optimizer"  # torchpar.train.check_offload refuses the rest
    mesh = init_device_mesh(env.device.type, (env.world,), mesh_dim_names=("fsdp",))
    mp = MixedPrecisionPolicy()
    if cfg.model.compute_dtype != "float32":
        mp = MixedPrecisionPolicy(param_dtype=getattr(torch, cfg.model.compute_dtype), reduce_dtype=torch.float32)
    kwargs = {"mesh": mesh, "mp_policy": mp, "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
              "reshard_after_forward": cfg.parallel.zero_stage not in (1, 2)}
    if not cpu_offload:
        model = model.to(env.device)
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)

    def sync(last: bool):  # accumulation: reduce-scatter only after the last microbatch
        model.set_requires_gradient_sync(last)
        return nullcontext()

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return TorchEngine(model, model, cfg, env, sync=sync, full_state=lambda: get_model_state_dict(model, options=full),
                       scaler=grad_scaler(cfg, env, sharded=True))
