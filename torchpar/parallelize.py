"""torchpar's parallelism, applied to the plain Decoder from outside its code in one visible order.

As torchtitan's parallelize does: activation checkpointing or offload of each block (model.remat) -> torch.compile of
each block (train.compile) -> the backend's wrapper (torchpar/backends/: DDP, FSDP2, pipeline stages, DeepSpeed),
which also owns gradient reduction and its compression.
"""

from __future__ import annotations

from functools import partial

import torch
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from jaxpar.core.config.schema import Config
from jaxpar.core.config.mesh_spec import parse_mesh
from torchpar import backends
from torchpar.models.decoder import Block
from torchpar.models.head import chunk_loss

# model.remat=save_matmuls: keep matmul outputs, recompute the rest (jaxpar: dots_with_no_batch_dims_saveable).
_MATMULS = [torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default]


def parallelize(
    model, cfg: Config, env, backend: str, deepspeed_config: str = "", compile_model: bool | None = None
) -> tuple[backends.Engine, bool]:
    """The backend's engine over `model`, and whether its blocks were compiled.

    `compile_model`: None follows train.compile; the benchmarks' --compile sets it.
    """
    checkpoint_blocks(model, cfg.model.remat, backend)
    compiled = use_compile(cfg, backend, env.device.type) if compile_model is None else compile_model
    if compiled:
        compile_blocks(model)
    return backends.build(backend, model, cfg, env, deepspeed_config=deepspeed_config), compiled


class CheckpointedBlock(Block):
    """A Block that is recomputed in the backward pass or whose saved activations wait in host memory (model.remat).

    Recomputed: `full` keeps only its inputs, `save_matmuls` its matmuls' outputs too. In host memory (`offload`):
    every tensor the block saves for its backward, through torch's save_on_cpu -- pinned on a GPU -- nothing
    recomputed; under DeepSpeed its activation checkpointing instead, the block's input on the host
    (`cpu_checkpointing`, configured by torchpar/backends/deepspeed.py) and the block recomputed. checkpoint_blocks
    turns a block into one in place: its class changes, not its submodules, so parameter names (the shared weight
    format, DCP checkpoints) stay those of the plain Decoder, where a wrapping module (torch's checkpoint_wrapper)
    would add a prefix. Without gradients (evaluation, decoding) nothing is recomputed or moved: it runs as a Block.
    """

    remat = "full"

    def forward(self, x, positions=None, mask=None):
        if not torch.is_grad_enabled():
            return super().forward(x, positions, mask)
        if self.remat == "offload":
            with torch.autograd.graph.save_on_cpu(pin_memory=x.is_cuda):
                return super().forward(x, positions, mask)
        if self.remat == "deepspeed_offload":
            import deepspeed  # deferred: deepspeed, optional: --backend deepspeed only

            # positions and mask by closure: DeepSpeed pairs each input it partitions with its size, and loses
            # count at a None
            forward = super().forward
            return deepspeed.checkpointing.checkpoint(lambda x: forward(x, positions, mask), x)
        context = partial(create_selective_checkpoint_contexts, _MATMULS) if self.remat == "save_matmuls" else None
        kwargs = {"context_fn": context} if context else {}
        return checkpoint(super().forward, x, positions, mask, use_reentrant=False, **kwargs)


def checkpoint_blocks(model, remat: str, backend: str = "") -> None:
    """Apply model.remat: each block recomputed in the backward pass, or its activations offloaded.

    none: nothing changes; offload on --backend deepspeed: DeepSpeed's checkpointing. Called before compile, which
    then compiles the recomputing forward, and before any wrapper (FSDP2 shards per block, pipeline stages take
    blocks).
    """
    if remat == "none":
        return
    mode = "deepspeed_offload" if remat == "offload" and backend == "deepspeed" else remat
    for block in model.blocks:
        block.__class__, block.remat = CheckpointedBlock, mode


def use_compile(cfg: Config, backend: str, device_type: str) -> bool:
    """Whether to compile the blocks, by train.compile: on, off, or auto.

    auto = on a GPU for every backend but deepspeed, and not under expert parallelism (its exchange sizes its buffers
    from the routing on the host).
    """
    if cfg.train.compile != "auto":
        return cfg.train.compile == "on"
    ep = parse_mesh(cfg.parallel.mesh).get("ep", 1) if backend == "ddp" else 1
    return device_type == "cuda" and backend != "deepspeed" and ep == 1


def compile_blocks(model) -> None:
    """torch.compile each block in place, before any wrapper, and the chunked loss's step.

    Before any wrapper because FSDP2 shards per block and pipeline stages take whole blocks. The blocks share one
    compiled graph (parameters are graph inputs), as torchtitan does. The loss's chunk (head.py chunk_loss: the
    head's logits, their softmax and gradient, the head's two gradient products) is one more graph, called once per
    chunk; the pipeline's last stage keeps it eager.
    """
    for block in model.blocks:
        block.compile()
    model.loss_chunk = torch.compile(chunk_loss)
