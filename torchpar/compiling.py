"""train.compile: torch.compile applied to the model's blocks, outside the model code (as torchtitan does)."""
from __future__ import annotations

from jaxpar.core.config import Config
from jaxpar.core.mesh_spec import parse_mesh


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
