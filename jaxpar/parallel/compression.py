"""parallel.grad_compression=bf16 in jaxpar: the gradients' reduction over the data axes (dp, fsdp) in bfloat16.

GSPMD places the reduction itself, right after the matmul that makes each weight gradient, in float32 (a
bfloat16 cast after it stays after it). So here the step's loss and gradients run in a shard_map that is
manual over the data axes only (tp stays GSPMD's): each device computes its rows' gradients whole, sums them
over the microbatches in float32, and reduces them once, in `wire` dtype -- psum_scatter along the dimension a
gradient is sharded on over a data axis (fsdp; dp too at ZeRO-2/3), psum over the others -- and back to float32.

Inside, the parameters are whole over the data axes (gathered at the start of the step, as ZeRO-2 holds
them), and the rules table drops dp and fsdp, which are manual there. XLA:CPU has no bfloat16 all-reduce: its
all-reduce-promotion pass widens one to float32 after rounding each operand to bfloat16 (and aborts on the
reducer a partially manual shard_map gives it, jax 0.10.2). On the CPU the gradients are therefore rounded to
bfloat16 here and reduced in float32: the numbers of a bfloat16 reduction, the bytes of a float32 one.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar.context import current, use
from jaxpar.ops import sum_over_microbatches
from jaxpar.sharding import context_mesh

DATA_AXES = ("dp", "fsdp")
WIRE = jnp.bfloat16  # the reduction's dtype (tests set float32: the same program must then be the plain step's)


def data_axes(mesh) -> tuple[str, ...]:
    return tuple(a for a in DATA_AXES if mesh.shape[a] > 1)


def entry_axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry if isinstance(entry, tuple) else (entry,))


def data_size(mesh) -> int:
    """The number of data ranks: dp x fsdp."""
    return math.prod(mesh.shape[a] for a in data_axes(mesh))


def _spec_keeping(spec: P, keep) -> P:
    kept = [tuple(a for a in entry_axes(e) if keep(a)) for e in spec]
    return P(*[k if len(k) > 1 else (k[0] if k else None) for k in kept])


def over_data(spec: P, axes: tuple[str, ...]) -> P:
    """`spec` with only the data axes left (what a shard_map manual over them names)."""
    return _spec_keeping(spec, lambda a: a in axes)


def off_data(spec: P, axes: tuple[str, ...]) -> P:
    """`spec` without the data axes (what stays GSPMD's inside that shard_map: tp)."""
    return _spec_keeping(spec, lambda a: a not in axes)


def per_rank(layout, value_and_grad, accum: int, value=None):
    """One data rank's loss-and-gradients function and the batch's spec, for a shard_map manual over the data axes.

    Returns (this data rank's (params, batch, scale) -> (loss, gradients) summed over its microbatches, the batch's
    spec over the data axes); inside the shard_map the rules table leaves the data axes out. `value`: zeros shaped as
    the loss where it comes with more than the scalar (ops.sum_over_microbatches).
    """
    axes = data_axes(layout.mesh)
    inner_rules = {k: tuple(a for a in v if a not in axes) for k, v in layout.rules.items()}

    def loss_and_grads(params, batch, scale):
        with use(dataclasses.replace(current(), rules=inner_rules)):
            return sum_over_microbatches(value_and_grad, params, batch, scale, accum, value=value)

    return loss_and_grads, over_data(layout.batch_sharding.spec, axes)


def reduce_gradient(g: jax.Array, spec: P, axes: tuple[str, ...], wire) -> jax.Array:
    """This device's whole gradient -> its share of the sum over the data axes, the collectives in `wire` dtype.

    psum_scatter along each dimension `spec` (the gradient's spec over the data axes: `over_data`) shards over data
    axes, psum over the data axes it does not use.
    """
    x, used = g.astype(wire), set()
    if jax.default_backend() == "cpu" and wire != g.dtype:  # see the module docstring
        x = x.astype(g.dtype)
    for dim, entry in enumerate(spec):
        names = entry_axes(entry)
        if names:
            x = jax.lax.psum_scatter(x, names, scatter_dimension=dim, tiled=True)
            used.update(names)
    rest = tuple(a for a in axes if a not in used)
    return (jax.lax.psum(x, rest) if rest else x).astype(g.dtype)


def compressed_loss_and_grads(layout, value_and_grad, accum: int, value=None):
    """The step's loss and gradients with the gradients reduced over the data axes in the `wire` dtype.

    (params, batch, scale) -> (loss summed over the microbatches, gradients summed over them and reduced over the data
    axes in `wire`), both as the plain step's scan over microbatches makes them; `value`: per_rank's (the loss with its
    aux, e.g. multi-token prediction's depth losses, averaged over the data ranks alike).
    """
    mesh, axes, wire, n = layout.mesh, data_axes(layout.mesh), WIRE, data_size(layout.mesh)
    grad_specs = jax.tree.map(lambda s: over_data(s, axes), layout.grad_specs, is_leaf=lambda s: isinstance(s, P))
    rank_loss_and_grads, batch_spec = per_rank(layout, value_and_grad, accum, value)

    def compressed(params, batch, scale):
        def local(params, batch, scale):
            loss, grads = rank_loss_and_grads(params, batch, scale)
            grads = jax.tree.map(
                lambda g, s: reduce_gradient(g / n, s, axes, wire),
                grads,
                grad_specs,
                is_leaf=lambda s: isinstance(s, P),
            )
            return jax.tree.map(lambda v: jax.lax.psum(v, axes) / n, loss), grads

        return jax.shard_map(
            local,
            mesh=context_mesh(mesh),  # DiLoCo's inner step is a shard_map manual over `diloco` around this one
            in_specs=(P(), batch_spec, P()),
            out_specs=(P(), grad_specs),
            axis_names=set(axes),
            check_vma=False,
        )(params, batch, scale)  # an argument: inside DiLoCo's shard_map it is traced there, and cannot be closed over

    return compressed
