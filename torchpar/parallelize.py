"""torchpar's parallelism, applied to the plain Decoder from outside its code in one visible order (as torchtitan's
parallelize does): activation checkpointing (model.remat: today still inside the blocks, torchpar/models/decoder.py)
-> torch.compile of each block (train.compile) -> the backend's wrapper (torchpar/backends/: DDP, FSDP2, pipeline
stages, DeepSpeed), which also owns gradient reduction and its compression."""
from __future__ import annotations

from jaxpar.core.config import Config
from jaxpar.core.mesh_spec import parse_mesh
from torchpar import backends


def parallelize(model, cfg: Config, env, backend: str, deepspeed_config: str = "") -> tuple[backends.Engine, bool]:
    """The backend's engine over `model`, and whether its blocks were compiled."""
    compiled = use_compile(cfg, backend, env.device.type)
    if compiled:
        compile_blocks(model)
    return backends.build(backend, model, cfg, env, deepspeed_config=deepspeed_config), compiled


def use_compile(cfg: Config, backend: str, device_type: str) -> bool:
    """train.compile: on, off, or auto = on a GPU for every backend but deepspeed, and not under expert parallelism
    (its exchange sizes its buffers from the routing on the host)."""
    if cfg.train.compile != "auto":
        return cfg.train.compile == "on"
    ep = parse_mesh(cfg.parallel.mesh).get("ep", 1) if backend == "ddp" else 1
    return device_type == "cuda" and backend != "deepspeed" and ep == 1


def compile_blocks(model) -> None:
    """torch.compile each block in place, before any wrapper (FSDP2 shards per block, pipeline stages take
    whole blocks); the blocks share one compiled graph (parameters are graph inputs), as torchtitan does."""
    for block in model.blocks:
        block.compile()
