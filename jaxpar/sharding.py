"""The one table from logical axis names (what the model knows) to mesh axes, and the PartitionSpecs it gives.

Model code names axes ("batch", "embed", "heads", ...) and calls `jaxpar.context.constrain`; nothing
else. Changing a layout means changing `RULES` here (ZeRO-3 adds dp to "embed": jaxpar/layout.py),
never the model.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import PartitionSpec as P

# logical name -> mesh axes (a tuple is sharded over their product). Weights and activations use
# different names for the model dimension: weights' "embed" is FSDP-sharded, activations'
# "act_embed" is not (the batch already uses fsdp there).
RULES: dict[str, tuple[str, ...]] = {
    # ep is a data axis outside the experts (each ep rank reads its own rows); diloco's groups read theirs too (a
    # group's step sees the rules without it: jaxpar/parallel/diloco.py)
    "batch": ("diloco", "dp", "fsdp", "ep"),
    "seq": ("sp",),  # sequence parallelism; attention across shards: jaxpar/parallel/sequence.py
    "act_embed": (),
    "embed": ("fsdp",),
    "heads": ("tp",),
    "kv_heads": ("tp",),  # llama's key/value heads (GQA): split over tp when they divide, else replicated
    "kv": (),
    "mlp": ("tp",),
    "vocab": ("tp",),
    "layers": ("pp",),  # pipeline stages own contiguous slices of the layer stack
    "stage": ("pp",),
    "qkv": (),
    "pos": (),
    "q_latent": (),  # MLA's latent down-projections: small, replicated (heads carry tp)
    "kv_latent": (),
    "experts": ("ep",),  # a mixture of experts' expert axis (models/moe.py; tokens travel: parallel/expert_parallel.py)
    "expert_scores": (),  # the router's output: every token scores every expert
    "sketch": ("fsdp",),  # a sketched layer's factor [sketch, out]: its input dim, sharded like "embed"
}


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


def context_mesh(mesh):
    """The mesh a shard_map traced now names.

    `mesh`, or inside another shard_map (manual over some axes: the data axes' of parallel.grad_compression,
    jaxpar/parallel/compression.py) the mesh as that context sees it, which jax asks a nested shard_map for.
    """
    context = jax.sharding.get_abstract_mesh()
    return context if context.manual_axes else mesh
