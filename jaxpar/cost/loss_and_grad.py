"""The training loss and its gradients as a program on a mesh, traced or compiled: its matmul FLOPs and its memory.

The automatic pipeline schedule (jaxpar/pipeline/auto.py) weighs schedules by these FLOPs; the memory tools
(python -m jaxpar.tools.pipeline_memory, python -m jaxpar.tools.sequence_memory) print both.
"""

from __future__ import annotations

import math

import jax

from jaxpar.context import use
from jaxpar.core.pipeline.schedules import resolve_microbatches
from jaxpar.cost.jaxpr_flops import branch_flops, matmul_flops
from jaxpar.layout import Layout
from jaxpar.mesh import make_mesh
from jaxpar.pipeline.tick_plan import BRANCHES, COL, tick_plan
from jaxpar.state import abstract_state
from jaxpar.step import loss_and_grad


def loss_and_grad_program(cfg, sizes: dict[str, int], devices, schedule: str | None = None):
    """(fn, abstract params, abstract batch): (loss, grads) on a mesh of `sizes` as the train step computes them.

    `schedule`: run that pipeline schedule on the hand-scheduled executor. The result is ready to trace.
    """
    layout = Layout(cfg, make_mesh(sizes, devices[: math.prod(sizes.values())]))
    fn, context = loss_and_grad(layout, schedule)
    params = abstract_state(layout)["params"]
    batch = jax.ShapeDtypeStruct(layout.batch_shape, jax.numpy.int32, sharding=layout.batch_sharding)

    def traced(params, batch):
        with use(context):
            return fn(params, batch)

    return traced, params, batch


def compiled_memory(cfg, sizes: dict[str, int], devices, schedule: str | None = None):
    """Compiled memory analysis of (loss, grads) on a mesh of `sizes` (see loss_and_grad_program)."""
    traced, params, batch = loss_and_grad_program(cfg, sizes, devices, schedule)
    return jax.jit(traced).lower(params, batch).compile().memory_analysis()


def step_flops(cfg, sizes, devices, on_executor: str | None) -> float:
    """Matmul FLOPs of (loss, grads), all devices together; `on_executor`: that schedule's ticks, from its table."""
    traced, params, batch = loss_and_grad_program(cfg, sizes, devices, on_executor)
    jaxpr = jax.make_jaxpr(traced)(params, batch).jaxpr
    if not on_executor:
        return matmul_flops(jaxpr)  # GSPMD: the logical program, every device's share together
    per_branch = branch_flops(jaxpr, BRANCHES)  # one device's tick, by branch
    p, S = cfg.parallel, sizes["pp"]
    M = resolve_microbatches(S, p.pipeline_microbatches)
    codes = tick_plan(on_executor, S, M, p.pipeline_virtual_stages).tables
    return sum(per_branch[c] for c in codes[..., COL["code"]].flat)
