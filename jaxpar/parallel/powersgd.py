"""parallel.grad_compression=powersgd in jaxpar.

Each gradient matrix reduced over the data axes (dp, fsdp) as two rank-r factors, with error feedback and warm start --
the algorithm of torch's `powerSGD_hook` (Vogels et al. 2019), which torchpar's ddp backend runs; docs/torchpar.md
"Gradient compression" sets them side by side.

Per step, on each data rank i, for every gradient g_i of the step (summed over its microbatches):
  M_i = g_i + e_i                          e_i: this rank's error buffer (what compression left out so far)
  a leaf that would not shrink 2x (vectors; r(m+n) >= mn/2): R = psum(M_i) / n, sent whole
  a matrix (first dim m x the rest, one per layer of a stacked leaf):
      P = psum(M_i Q); P = Gram-Schmidt(P)     Q: the last step's factor (warm start), random at the start
      Q = psum(M_i^T P) / n;  R = P Q^T         R is the same on every rank
  e_i = M_i - R                            the step's gradient is R
The first parallel.powersgd_warmup_steps steps reduce plainly and keep e = 0 (as torch's start_powerSGD_iter).

It runs in a shard_map manual over the data axes, as grad_compression=bf16 does (compression.py): each device
computes its rows' gradients whole; tp stays GSPMD's. State, in the train state under "powersgd": "error", per
parameter (n, *shape) with n = dp*fsdp, its leading dim sharded over the data axes (one buffer per data rank,
as torch keeps one per rank), and "q", per compressed parameter (*layers, *rest, r), replicated over the data
axes (its layers on their pipeline stage, as the parameter's). A checkpoint
resumed on another data size gives every new rank the mean of the saved buffers: the sum the next steps owe,
divided by n, is what the old ranks owed (`restore_fit`).
"""

from __future__ import annotations

import math
import sys

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.core.weights.names import flatten, unflatten
from jaxpar.parallel.compression import data_axes, data_size, off_data, per_rank

MIN_RATE = 2  # torch's min_compression_rate: a matrix is compressed only where r(m+n) * 2 < m*n


def _is_spec(x) -> bool:
    return isinstance(x, P)


def enabled(layout) -> bool:
    return layout.cfg.parallel.grad_compression == "powersgd" and bool(data_axes(layout.mesh))


def layers_first(layout, name: str) -> bool:
    """A stacked leaf (first logical axis "layers"): one matrix per layer, as torch has one tensor per layer."""
    axes = layout.axes[tuple(name.split("."))]
    return bool(axes) and axes[0] == "layers"


def factor_shape(shape: tuple[int, ...], layered: bool, rank: int) -> tuple[int, ...] | None:
    """Q's shape (*layers, *rest, r) for a leaf compressed as (first dim) x (the rest), or None if sent whole."""
    lead, dims = (shape[:1], shape[1:]) if layered else ((), shape)
    if len(dims) < 2:
        return None
    m, n = dims[0], math.prod(dims[1:])
    r = min(rank, m, n)
    return (*lead, *dims[1:], r) if (m + n) * r * MIN_RATE < m * n else None


def factor_shapes(layout, shapes: dict) -> dict:
    """{flat name: Q's shape} of the compressed leaves among `shapes` ({flat name: shape})."""
    rank = layout.cfg.parallel.powersgd_rank
    out = {k: factor_shape(s, layers_first(layout, k), rank) for k, s in shapes.items()}
    return {k: s for k, s in out.items() if s is not None}


def shardings(layout) -> dict:
    """The "powersgd" entry's shardings.

    Error buffers (the data axes, then the parameter's other axes), Q replicated but for a stacked leaf's layers,
    which stay on their pipeline stage as the parameter's do.
    """
    axes, mesh = data_axes(layout.mesh), layout.mesh
    specs = flatten(jax.tree.map(lambda s: off_data(s, axes), layout.param_specs, is_leaf=_is_spec))
    shapes = {k: v.shape for k, v in flatten(layout.abstract_params).items()}
    return {
        "error": {k: NamedSharding(mesh, P(axes, *s)) for k, s in specs.items()},
        "q": {
            k: NamedSharding(mesh, P(*specs[k][:1]) if layers_first(layout, k) else P())
            for k in factor_shapes(layout, shapes)
        },
    }


def initial(layout, params) -> dict:
    """Zero error buffers, and Q as `initial_q` makes it."""
    n = data_size(layout.mesh)
    return {
        "error": {k: jnp.zeros((n, *v.shape), v.dtype) for k, v in flatten(params).items()},
        "q": initial_q(layout, params),
    }


def initial_q(layout, params) -> dict:
    """Q random normal (seeded by train.seed) with orthonormal columns, as torch starts it."""
    qs = sorted(factor_shapes(layout, {k: v.shape for k, v in flatten(params).items()}).items())
    keys = jax.random.split(jax.random.key(layout.cfg.train.seed), max(len(qs), 1))
    return {
        k: orthogonalize(jax.random.normal(key, s, jnp.float32), int(layers_first(layout, k)))
        for key, (k, s) in zip(keys, qs)
    }


def orthogonalize(x: jax.Array, lead: int) -> jax.Array:
    """Gram-Schmidt on the r columns of x (*lead dims, *vector dims, r), each batch of `lead` dims apart.

    As torch's _orthogonalize_gram_schmidt: each column normalised, then taken out of the columns after it. A zero
    column stays zero (torch, its epsilon 0, would divide by zero).
    """
    vec = tuple(range(lead, x.ndim - 1))
    cols = [x[..., i] for i in range(x.shape[-1])]
    for i in range(len(cols)):
        norm = jnp.sqrt(jnp.sum(cols[i] ** 2, axis=vec, keepdims=True))
        cols[i] = jnp.where(norm > 0, cols[i] / jnp.where(norm > 0, norm, 1), 0)
        for j in range(i + 1, len(cols)):
            cols[j] = cols[j] - jnp.sum(cols[i] * cols[j], axis=vec, keepdims=True) * cols[i]
    return jnp.stack(cols, axis=-1)


def _rest(m: jax.Array, lead: int) -> str:
    """einsum letters: batch dims, the rows, the rest."""
    letters = "abcdefghijklmnopq"
    return letters[:lead], letters[lead], letters[lead + 1 : m.ndim]


def compress(m: jax.Array, q: jax.Array, lead: int, axes: tuple[str, ...], n: int) -> tuple[jax.Array, jax.Array]:
    """(R, new Q) for one matrix stack M_i (this rank's), its warm-start Q: the two rank-r all-reduces."""
    b, row, rest = _rest(m, lead)
    q = orthogonalize(q, lead)  # the warm start, as torch's hook does before each P = M Q
    p = jax.lax.psum(jnp.einsum(f"{b}{row}{rest},{b}{rest}z->{b}{row}z", m, q), axes)
    p = orthogonalize(p, lead)
    q = jax.lax.psum(jnp.einsum(f"{b}{row}{rest},{b}{row}z->{b}{rest}z", m, p), axes) / n
    return jnp.einsum(f"{b}{row}z,{b}{rest}z->{b}{row}{rest}", p, q), q


def reduce_powersgd(layout, grads: dict, state: dict, axes: tuple[str, ...], n: int) -> tuple[dict, dict]:
    """This rank's gradients (flat dict) and its PowerSGD state -> (the mean gradients, the new state)."""
    out, error, qs = {}, {}, {}
    for k, g in grads.items():
        m = g + state["error"][k][0]
        if k in state["q"]:
            out[k], qs[k] = compress(m, state["q"][k], int(layers_first(layout, k)), axes, n)
        else:
            out[k] = jax.lax.psum(m, axes) / n
        error[k] = (m - out[k])[None]
    return out, {"error": error, "q": qs}


def powersgd_loss_and_grads(layout, value_and_grad, accum: int, value=None):
    """(params, batch, powersgd state, step, token share) -> (mean loss, mean gradients, new powersgd state).

    The step's loss and gradients as the plain step makes them, reduced over the data axes by PowerSGD after its
    warm-up.
    """
    mesh, axes = layout.mesh, data_axes(layout.mesh)
    n, warmup = data_size(mesh), layout.cfg.parallel.powersgd_warmup_steps
    rank_loss_and_grads, batch_spec = per_rank(layout, value_and_grad, accum, value)  # value: the loss's zeros

    def plain(grads, state):
        return {k: jax.lax.psum(g, axes) / n for k, g in grads.items()}, state

    def compressed(grads, state):
        return reduce_powersgd(layout, grads, state, axes, n)

    def reduced(params, batch, state, step, share):
        def local(params, batch, state, step):
            loss, grads = rank_loss_and_grads(params, batch, share)  # share: step.py's token_share
            grads = {k: g / accum for k, g in flatten(grads).items()}
            if warmup:  # (0: the planner's steady state, jaxpar/tools/plan.py; the config asks for 2 or more)
                grads, state = jax.lax.cond(step < warmup, plain, compressed, grads, state)
            else:
                grads, state = compressed(grads, state)
            return jax.tree.map(lambda v: jax.lax.psum(v, axes) / (n * accum), loss), unflatten(grads), state

        # `share` is closed over, not an argument: the pipeline executor's own shard_map (over pp, nested in this
        # one) takes no value made inside this one (compression.compressed_loss_and_grads)
        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(), batch_spec, state_spec, P()),
            out_specs=(P(), P(), state_spec),
            axis_names=set(axes),
            check_vma=False,
        )(params, batch, state, step)

    state_spec = {"error": P(axes), "q": P()}
    return reduced


def restore_fit(layout, abstract: dict):
    """For Checkpointer.restore_latest: saved state's metadata -> (what to read, what to do with it after).

    The "powersgd" entry read as saved and fitted to this layout: kept where its shapes are this layout's, else
    remapped (another data size: every rank gets the mean of the saved error buffers; another rank r: Q starts
    afresh), made afresh where the checkpoint has none, dropped where this layout runs without it.
    """
    want = "powersgd" in abstract
    rest = {k: v for k, v in abstract.items() if k != "powersgd"}

    def fitted(state: dict) -> dict:
        if not want:
            return {k: v for k, v in state.items() if k != "powersgd"}
        saved = state.get("powersgd")
        return {
            **state,
            "powersgd": _fresh(layout, state["params"]) if saved is None else _remap(layout, saved, state["params"]),
        }

    def fit(saved: dict):
        if "powersgd" not in saved:
            return (rest, fitted) if want else (abstract, None)
        shapes = jax.tree.map(lambda m: tuple(m.shape), saved["powersgd"])
        if want and shapes == jax.tree.map(lambda x: tuple(x.shape), abstract["powersgd"]):
            return abstract, None
        return {**rest, "powersgd": _read_as_saved(layout, saved["powersgd"])}, fitted

    return fit


def _read_as_saved(layout, saved: dict) -> dict:
    """What to read a saved "powersgd" entry of another shape as.

    Every saved rank's error buffer, its parameter's dims sharded as this layout shards the parameter (so a restore
    onto another data size holds n_saved x the parameter's shard per device for a moment), Q whole.
    """
    params = flatten(layout.state_shardings["params"])

    def error(k, m):
        spec = params[k].spec if k in params else P()
        return jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=NamedSharding(layout.mesh, P(None, *spec)))

    whole = NamedSharding(layout.mesh, P())
    return {
        "error": {k: error(k, m) for k, m in saved["error"].items()},
        "q": {k: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=whole) for k, m in saved["q"].items()},
    }


def _fresh(layout, params) -> dict:
    return jax.jit(lambda p: initial(layout, p), out_shardings=layout.state_shardings["powersgd"])(params)


def _remap(layout, saved: dict, params) -> dict:
    """Saved PowerSGD state -> this layout's.

    Error buffers averaged onto another data size, Q kept where its shape (rank r) is the same.
    """
    shard, n = layout.state_shardings["powersgd"], data_size(layout.mesh)
    old = next(iter(saved["error"].values())).shape[0]
    if old != n and jax.process_index() == 0:
        print(
            f"PowerSGD: the error buffers of {old} data ranks averaged onto {n} (resumed on another data size)",
            file=sys.stderr,
        )

    def fit_error(e):
        return e if old == n else jnp.broadcast_to(jnp.mean(e, axis=0, keepdims=True), (n, *e.shape[1:]))

    error = jax.jit(lambda es: {k: fit_error(e) for k, e in es.items()}, out_shardings=shard["error"])(saved["error"])
    shapes = factor_shapes(layout, {k: v.shape for k, v in flatten(params).items()})
    kept = {k for k, s in shapes.items() if k in saved["q"] and tuple(saved["q"][k].shape) == s}
    qs = {k: saved["q"][k] for k in kept}
    if kept != set(shapes):  # Q made afresh only where it is needed
        fresh = jax.jit(lambda p: initial_q(layout, p))(params)
        qs.update({k: fresh[k] for k in set(shapes) - kept})
        if jax.process_index() == 0:
            print(
                "PowerSGD: another rank r (or other matrices) than the checkpoint's: its factors start afresh",
                file=sys.stderr,
            )
    return {"error": error, "q": jax.device_put(qs, shard["q"])}


def payload_bytes(layout) -> int:
    """Bytes one data rank hands to PowerSGD's all-reduces per step after the warm-up.

    r(m+n) float32 values per compressed m x n matrix (per layer), the other leaves whole -- the figure torch's hook
    counts.
    """
    total = 0
    for k, x in flatten(layout.abstract_params).items():
        layered = layers_first(layout, k)
        q = factor_shape(x.shape, layered, layout.cfg.parallel.powersgd_rank)
        rows = x.shape[int(layered)]  # P's: (*layers, m, r)
        total += x.size if q is None else math.prod(q) + math.prod(q[: int(layered)]) * rows * q[-1]
    return 4 * total
