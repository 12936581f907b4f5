"""The parallel context: what model code may know of parallelism while it is traced.

Models call `constrain(x, logical_axes)` to pin an activation's layout, and `current().attention`,
`current().run_layers` and `current().experts` for the computations a parallel strategy replaces (attention
across sequence shards; the layer stack as pipeline stages; a mixture of experts across `ep`). jaxpar/parallelize.py
builds the context from the config and mesh; with none active, constraints are no-ops and both are the plain local
versions.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable

import jax
from jax.sharding import NamedSharding

from jaxpar.parallel.expert_dispatch import local_experts
from jaxpar.ops import FLOAT8, local_attention, scan_layers
from jaxpar.sharding import spec_for


@dataclasses.dataclass(frozen=True)
class ParallelContext:
    mesh: Any = None  # None: no constraints (a model traced outside any mesh)
    rules: dict = dataclasses.field(default_factory=dict)  # logical name -> mesh axes
    # (q, k, v, positions, segments, window) -> output [batch, seq, heads, head_dim]; window: model.sliding_window
    attention: Callable = local_attention
    # (layer, stacked, x, rows) -> x after every layer (x: a pytree of [batch, ...]; rows: per-row arrays that
    # every layer reads, layer(h, slice, *rows))
    run_layers: Callable = scan_layers
    experts: Callable = local_experts  # (x, ids, weights, kept, w, capacity, activation) -> the experts' sum
    float8: bool = False  # model.float8: every projection (jaxpar/ops.py project) multiplies in float8


_CURRENT: contextvars.ContextVar = contextvars.ContextVar("jaxpar_parallel_context", default=ParallelContext())


def current() -> ParallelContext:
    return _CURRENT.get()


@contextlib.contextmanager
def use(ctx: ParallelContext):
    token, float8 = _CURRENT.set(ctx), FLOAT8.set(ctx.float8)
    try:
        yield ctx
    finally:
        FLOAT8.reset(float8)
        _CURRENT.reset(token)


def constrain(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    """Pin an activation's layout by logical names (a hint to GSPMD, never a change in value)."""
    ctx = current()
    if ctx.mesh is None:
        return x
    return jax.lax.with_sharding_constraint(
        x, NamedSharding(tracing_mesh(ctx.mesh), spec_for(axes, x.shape, ctx.mesh, ctx.rules))
    )


def tracing_mesh(mesh):
    """The mesh that sharding constraints should name while tracing: `mesh`, or the abstract one inside a shard_map.

    Inside a shard_map (the pipeline executor is manual over pp) sharding constraints and nested shard_maps must name
    the context's abstract mesh; activations never use its manual axes.
    """
    context = jax.sharding.get_abstract_mesh()
    return context if not context.empty and context.manual_axes else mesh
