"""Parallelism applied from outside the model: the parallel context a layout's model is traced in.

The model asks its context for attention and for the layer runner (jaxpar/context.py); this file
decides what they are for a config and mesh: attention across `sp` shards with the configured
strategy, the layer stack as a GPipe pipeline over `pp` — or a plain scan when the stages run
on the hand-scheduled executor (jaxpar/step.py), which calls each stage's layers itself — and a mixture of
experts' tokens sent to their experts over `ep`.
"""
from __future__ import annotations

import functools

from jaxpar.context import ParallelContext
from jaxpar.core.pipeline_schedules import resolve_microbatches
from jaxpar.dispatch import local_experts
from jaxpar.ops import local_attention, scan_layers
from jaxpar.parallel.experts import expert_parallel
from jaxpar.parallel.gpipe import gpipe_layers
from jaxpar.parallel.sequence import sequence_attention


def unrolled_layers(setting: str, mesh) -> bool:
    """train.scan_layers: auto unrolls on a GPU, where the scan's per-layer copies cost a third of a GPT-2 124M
    step (docs/gpu.md), and scans elsewhere, where compile time matters more (tests, CPU runs)."""
    return setting == "off" or (setting == "auto" and mesh.devices.flat[0].platform == "gpu")


def parallel_context(layout, on_executor: bool = False) -> ParallelContext:
    mesh, p, S = layout.mesh, layout.cfg.parallel, layout.mesh.shape["pp"]
    unroll = unrolled_layers(layout.cfg.train.scan_layers, mesh)
    attention = sequence_attention(mesh, layout.rules, p.sequence_attention) if mesh.shape["sp"] > 1 else local_attention
    if S > 1 and not on_executor:
        run_layers = gpipe_layers(S, resolve_microbatches(S, p.pipeline_microbatches), unroll)
    else:
        run_layers = functools.partial(scan_layers, unroll=unroll)
    experts = expert_parallel(mesh, layout.rules) if layout.cfg.model.moe_experts else local_experts
    return ParallelContext(mesh, layout.rules, attention, run_layers, experts)
