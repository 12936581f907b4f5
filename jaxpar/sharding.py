"""The one table from logical axis names (what the model knows) to mesh axes (what the layout knows).

Model code names axes ("batch", "embed", "heads", ...) and calls `constrain`; nothing else.
Changing a layout means changing `rules_for` here, never the model.
"""
from __future__ import annotations

import contextlib
import contextvars
import math

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

# logical name -> mesh axes (a tuple is sharded over their product). Weights and activations use
# different names for the model dimension: weights' "embed" is FSDP-sharded, activations'
# "act_embed" is not (the batch already uses fsdp there).
RULES: dict[str, tuple[str, ...]] = {
    "batch": ("dp", "fsdp"),
    "seq": ("sp",),  # sequence parallelism; attention across shards: jaxpar/parallel/sequence.py
    "act_embed": (),
    "embed": ("fsdp",),
    "heads": ("tp",),
    "kv": (),
    "mlp": ("tp",),
    "vocab": ("tp",),
    "layers": ("pp",),  # pipeline stages own contiguous slices of the layer stack
    "stage": ("pp",),
    "qkv": (),
    "pos": (),
    "q_latent": (),  # MLA's latent down-projections: small, replicated (heads carry tp)
    "kv_latent": (),
    "sketch": ("fsdp",),  # a sketched layer's factor [sketch, out]: its input dim, sharded like "embed"
}


def rules_for(zero_stage: int) -> dict[str, tuple[str, ...]]:
    """ZeRO-3 on plain data parallelism: parameters are sharded over dp as well as fsdp."""
    rules = dict(RULES)
    if zero_stage == 3:
        rules["embed"] = ("fsdp", "dp")
    return rules


def spec_for(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh, rules) -> P:
    """PartitionSpec for one array; a mesh axis is used once and only where the dim divides."""
    used: set[str] = set()
    out = []
    for name, dim in zip(axes, shape):
        mesh_axes = [a for a in (rules[name] if name else ()) if a not in used and mesh.shape[a] > 1]
        while mesh_axes and dim % math.prod(mesh.shape[a] for a in mesh_axes):
            mesh_axes.pop()  # indivisible (e.g. an odd vocab): replicate rather than fail
        used.update(mesh_axes)
        out.append(tuple(mesh_axes) if len(mesh_axes) > 1 else (mesh_axes[0] if mesh_axes else None))
    return P(*out)


def with_extra_axis(spec: P, shape: tuple[int, ...], mesh, axis: str) -> P:
    """Add `axis` to the first dim that can take it (ZeRO-1: optimizer state sharded over dp)."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    flat = [a for e in entries if e for a in (e if isinstance(e, tuple) else (e,))]
    if mesh.shape[axis] == 1 or axis in flat:
        return spec
    for i, (e, dim) in enumerate(zip(entries, shape)):
        cur = tuple(e if isinstance(e, tuple) else (e,)) if e else ()
        if dim % (math.prod(mesh.shape[a] for a in cur) * mesh.shape[axis]) == 0:
            entries[i] = cur + (axis,) if cur else axis
            return P(*entries)
    return spec


# The active (mesh, rules) for activation constraints; unset means "no mesh": constrain is a no-op.
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("jaxpar_sharding", default=None)


@contextlib.contextmanager
def use_rules(mesh, rules):
    token = _ACTIVE.set((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def constrain(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    """Pin an activation's layout by logical names (a hint to GSPMD, never a change in value)."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    return jax.lax.with_sharding_constraint(x, NamedSharding(tracing_mesh(mesh), spec_for(axes, x.shape, mesh, rules)))


def tracing_mesh(mesh):
    """`mesh`, or inside a shard_map (the pipeline executor is manual over pp) the context's abstract
    mesh, which sharding constraints and nested shard_maps must name; activations never use its manual axes."""
    context = jax.sharding.get_abstract_mesh()
    return context if not context.empty and context.manual_axes else mesh
