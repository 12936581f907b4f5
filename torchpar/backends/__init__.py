"""Backends wrap the plain GPT: `none` (one process), `ddp`, `fsdp` (FSDP2), `deepspeed` (ZeRO 0-3),
`pipeline` (torch.distributed.pipelining, one stage per rank).

Each `build(...)` returns an engine with: module (for eval), train_step(microbatches) ->
(local loss, grad_norm, lr, extra metrics: float16's loss_scale and skipped_steps), eval_loss(batch), data_rank/data_ways (this rank's
share of a batch; the ranks whose losses are averaged), checkpointer (save(step, meta) / restore() -> meta | None / remove_partial_saves()).
"""
from __future__ import annotations

import importlib

BACKENDS = ("none", "ddp", "fsdp", "deepspeed", "pipeline")


def build(name: str, model, cfg, env, **options):
    module = importlib.import_module(f"torchpar.backends.{'base' if name == 'none' else name}")
    return module.build(model, cfg, env, **options)
