"""The fsdp backend: FSDP2's `fully_shard` per block and at the root on a DeviceMesh.

The mesh is 1-D ("fsdp") over all ranks, or 2-D ("dp", "fsdp") for parallel.mesh=dp=D,fsdp=F (HSDP: FSDP2 shards over
fsdp and replicates over dp; fsdp=1 is plain replication). Every rank still reads its own share of each batch (both
axes split the data).

model.compute_dtype=bfloat16 or float16 -> MixedPrecisionPolicy(param_dtype=that) (float16: with the sharded
GradScaler, torchpar/backends/base.py); gradients are reduced in float32, or in bfloat16 with
parallel.grad_compression=bf16 (reduce_dtype); parallel.offload=params+optimizer -> CPUOffloadPolicy; model.remat is
applied before this wrapper (torchpar/parallelize.py: torch.utils.checkpoint per block).
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

from jaxpar.core.config.mesh_spec import parse_mesh, resolve_sizes
from torchpar.backends.base import TorchEngine, grad_scaler
from torchpar.diloco import Groups, group_mesh


def fsdp_options(cfg, world: int) -> dict:
    """What the config asks of FSDP2: the mesh's (shape, axis names).

    parallel.mesh's dp x fsdp, all ranks on fsdp when it is not set (jaxpar.core.config.mesh_spec.check_torch_mesh
    vetted it) -- and fully_shard's settings.
    """
    sizes = resolve_sizes(parse_mesh(cfg.parallel.mesh), world) if cfg.parallel.mesh else {"dp": 1}
    groups = sizes.get("diloco", 1)  # DiLoCo's: FSDP2 inside each group of ranks
    inner = world // groups
    mesh = ((inner,), ("fsdp",)) if sizes["dp"] == 1 else ((sizes["dp"], sizes["fsdp"]), ("dp", "fsdp"))
    compute = None if cfg.model.compute_dtype == "float32" else cfg.model.compute_dtype
    reduce = "bfloat16" if cfg.parallel.grad_compression == "bf16" else "float32"  # powersgd: torchpar.checks refuses
    return {
        "mesh": mesh,
        "groups": groups,
        "param_dtype": compute,
        "reduce_dtype": reduce,
        "cpu_offload": cfg.parallel.offload == "params+optimizer",
        "reshard_after_forward": cfg.parallel.zero_stage not in (1, 2),
    }


def build(model, cfg, env, **_):
    o = fsdp_options(cfg, env.world)  # torchpar.checks.check_offload refuses the offloads FSDP2 cannot do
    groups = o["groups"]
    if groups > 1:
        whole, mesh = group_mesh(env, (groups, *o["mesh"][0]), o["mesh"][1])
    else:
        mesh = init_device_mesh(env.device.type, o["mesh"][0], mesh_dim_names=o["mesh"][1])
    mp = MixedPrecisionPolicy(
        param_dtype=getattr(torch, o["param_dtype"]) if o["param_dtype"] else None,
        reduce_dtype=getattr(torch, o["reduce_dtype"]),
    )
    cpu_offload = o["cpu_offload"]
    kwargs = {
        "mesh": mesh,
        "mp_policy": mp,
        "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
        "reshard_after_forward": o["reshard_after_forward"],
    }
    if not cpu_offload:
        model = model.to(env.device)
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)

    def sync(last: bool):  # accumulation: reduce-scatter only after the last microbatch
        model.set_requires_gradient_sync(last)
        return nullcontext()

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    engine = TorchEngine(
        model,
        model,
        cfg,
        env,
        sync=sync,
        full_state=lambda: get_model_state_dict(model, options=full),
        scaler=grad_scaler(cfg, env, sharded=True),
    )
    if groups > 1:
        engine.use_groups(Groups(model, cfg, env, whole, groups))
    return engine
