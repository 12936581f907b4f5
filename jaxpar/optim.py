"""optax AdamW: global-norm clipping, weight decay by the shared rule, the shared warmup + cosine.

With optim.name=muon, Muon (jaxpar/core/optimizer/muon.py) on the hidden matrices and that AdamW on the rest
(optax.partition); with optim.name=adamw8bit, AdamW whose moments are held in 8 bits
(jaxpar/core/optimizer/adamw8bit.py: optax has none).

Every hyperparameter is a closure over the config, none is in the optimizer state (counts and moments only), so a
resumed run takes its optim.* and train.steps from the config it runs with. The state has one structure whether
or not it clips (optim.grad_clip=0: an identity in the clipping slot; both slots hold optax's empty state), so a
resume may also turn clipping on or off.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

try:  # jax 0.11 removed shard_alike; there the update's layout is left to GSPMD (a layout hint, never a value)
    from jax.experimental.shard_alike import shard_alike
except ImportError:
    shard_alike = None
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.context import current, tracing_mesh
from jaxpar.core.optimizer import adamw8bit, muon
from jaxpar.core.config.schema import Config
from jaxpar.core.optimizer.lr_schedule import decays, lr_at


def lr_fn(cfg: Config):
    """step -> learning rate, traceable (the shared formula with jax.numpy)."""
    return lambda step: lr_at(jnp.asarray(step, jnp.float32), cfg.optim, cfg.train.steps, xp=jnp)


def _name(path) -> str:
    return ".".join(k.key for k in path)


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    o = cfg.optim
    mask = lambda params: jax.tree_util.tree_map_with_path(lambda p, _: decays(_name(p)), params)
    adamw = optax.adamw(lr_fn(cfg), b1=o.beta1, b2=o.beta2, eps=o.eps, weight_decay=o.weight_decay, mask=mask)
    if o.name == "adamw8bit":
        adamw = scale_by_adamw8bit(cfg)
    if o.name == "muon":
        labels = lambda params: jax.tree_util.tree_map_with_path(
            lambda p, _: "muon" if muon.stacked_axes(_name(p)) else "adamw", params
        )
        adamw = optax.partition({"muon": scale_by_muon(cfg), "adamw": adamw}, labels)
    return optax.chain(optax.clip_by_global_norm(o.grad_clip) if o.grad_clip else optax.identity(), adamw)


class MuonState(NamedTuple):
    count: jax.Array  # updates so far (the schedule's step)
    mu: optax.Updates  # the momentum, one per matrix parameter


def orthogonalize(x: jax.Array, axes, steps: int) -> jax.Array:
    """jaxpar/core/optimizer/muon.py's NS_k on every matrix of `x`.

    Its (reduction, output) axes made one matrix, the other axes batch axes (layers, experts, q/k/v), each matrix on
    its own (orthogonalize_all of x alone).
    """
    return orthogonalize_all([x], [axes], steps)[0]


def orthogonalize_all(xs: list, axes: list, steps: int, likes: list | None = None) -> list:
    """Orthogonalize each of `xs`, on a mesh sharing the whole matrices out among the devices.

    On a mesh each device iterates on a share of the whole matrices (spread_matrices) rather than every device on every
    matrix. The matrices of one shape (as iterated) from every parameter are stacked and dealt out together, so their
    count is padded to a multiple of the devices once, not per parameter. Each result is laid out as its `like` (the
    parameter): the update then goes back to the parameter's layout once, rather than drawing the parameter (weight
    decay) into the spread layout.
    """
    mats = [_as_matrices(x, a) for x, a in zip(xs, axes)]
    groups = defaultdict(list)
    for i, y in enumerate(mats):
        groups[y.shape[1:]].append(i)
    out = [None] * len(xs)
    for members in groups.values():
        sizes = [mats[i].shape[0] for i in members]
        done = newton_schulz(spread_matrices(jnp.concatenate([mats[i] for i in members])), steps)
        for i, piece in zip(members, jnp.split(done[: sum(sizes)], list(itertools.accumulate(sizes))[:-1])):
            out[i] = _from_matrices(piece, xs[i].shape, axes[i])
            if likes is not None and shard_alike is not None and current().mesh is not None:
                out[i] = shard_alike(likes[i], out[i])[1]
    return out


def _as_matrices(x: jax.Array, axes) -> jax.Array:
    """x as [matrices, rows, cols], each matrix in the orientation iterated (_as_is)."""
    fan_in, fan_out = muon.fans(x.shape, axes)
    y = x.transpose(_order(x.ndim, axes)).reshape(-1, fan_in, fan_out)
    return y if _as_is(fan_in, fan_out, axes) else jnp.swapaxes(y, -1, -2)


def _as_is(fan_in: int, fan_out: int, axes) -> bool:
    """Whether a matrix is iterated as [fan_in, fan_out].

    The wide orientation (X X^T on the smaller side, as torch.optim.Muon). A square one is free (NS(X^T) = NS(X)^T):
    its side of one axis goes to the rows -- the model dimension here, which the layout shards over fsdp -- so q/k/v
    ([embed] x [heads, head_dim]) and the attention output ([heads, head_dim] x [embed]) stack with their shards
    alike, without a reshard.
    """
    return fan_in < fan_out or (fan_in == fan_out and len(axes[0]) <= len(axes[1]))


def _from_matrices(y: jax.Array, shape, axes) -> jax.Array:
    fan_in, fan_out = muon.fans(shape, axes)
    order = _order(len(shape), axes)
    y = y if _as_is(fan_in, fan_out, axes) else jnp.swapaxes(y, -1, -2)
    return y.reshape(tuple(shape[a] for a in order)).transpose(tuple(order.index(a) for a in range(len(shape))))


def _order(ndim: int, axes) -> tuple[int, ...]:
    reduction, output = axes
    return tuple(a for a in range(ndim) if a not in reduction + output) + reduction + output


def newton_schulz(y: jax.Array, steps: int) -> jax.Array:
    """NS_k on each matrix of y [matrices, rows, cols], rows <= cols, float32."""
    y = y / jnp.maximum(jnp.linalg.norm(y, axis=(-2, -1), keepdims=True), muon.EPS)
    a, b, c = muon.COEFFS
    for _ in range(steps):
        gram = y @ jnp.swapaxes(y, -1, -2)
        y = a * y + (b * gram + c * gram @ gram) @ y
    return y


def spread_matrices(y: jax.Array) -> jax.Array:
    """`y` [matrices, rows, cols] laid out as whole matrices per device, dealt out over the traced step's mesh.

    The matrices go to every device of the mesh (zero matrices pad their count to a multiple: Newton-Schulz keeps them
    zero). GSPMD moves each parameter's shards there and the update back (all-to-alls) instead of gathering every
    matrix everywhere; each device iterates on ceil(matrices / devices) of them. Outside a mesh: as it is.
    """
    mesh = current().mesh
    if mesh is None or mesh.size == 1:
        return y
    traced = tracing_mesh(mesh)  # inside DiLoCo's inner step `diloco` is manual: each group deals out its own
    manual = set(getattr(traced, "manual_axes", ()))
    names = tuple(n for n in mesh.axis_names if mesh.shape[n] > 1 and n not in manual)
    y = jnp.pad(y, ((0, -y.shape[0] % math.prod(mesh.shape[n] for n in names)), (0, 0), (0, 0)))
    return jax.lax.with_sharding_constraint(y, NamedSharding(traced, P(names or None, None, None)))


def _lerp(start, end, weight: float):
    """torch.lerp's formula (its rounding too): from the nearer end."""
    return start + weight * (end - start) if weight < 0.5 else end - (end - start) * (1 - weight)


def scale_by_muon(cfg: Config) -> optax.GradientTransformation:
    """The whole Muon update of the matrices, the learning rate and weight decay included.

    The rule: jaxpar/core/optimizer/muon.py.
    """
    o, lr = cfg.optim, lr_fn(cfg)
    m = o.muon_momentum

    def init(params):
        return MuonState(jnp.zeros((), jnp.int32), jax.tree.map(jnp.zeros_like, params))

    def update(grads, state, params):
        mu = jax.tree.map(lambda b, g: _lerp(b, g, 1 - m), state.mu, grads)
        leaves, tree = jax.tree_util.tree_flatten_with_path(params)
        names = [_name(path) for path, _ in leaves]
        axes, ws = [muon.stacked_axes(n) for n in names], [w for _, w in leaves]
        nesterov = [_lerp(g, b, m) for g, b in zip(jax.tree.leaves(grads), jax.tree.leaves(mu))]
        updates = [
            -lr(state.count)
            * (muon.lr_scale(o.muon_lr_rule, *muon.fans(w.shape, a)) * o_ + (o.weight_decay if decays(n) else 0.0) * w)
            for n, a, w, o_ in zip(names, axes, ws, orthogonalize_all(nesterov, axes, o.muon_ns_steps, ws))
        ]
        return jax.tree.unflatten(tree, updates), MuonState(optax.safe_increment(state.count), mu)

    return optax.GradientTransformation(init, update)


class AdamW8bitState(NamedTuple):
    count: jax.Array  # updates so far (the schedule's step)
    mu: optax.Updates  # per parameter: its first moment's 8-bit codes, or the float32 moment (a small tensor)
    nu: optax.Updates  # the second moment's likewise
    mu_scale: optax.Updates  # per parameter: its blocks' scales [numel / BLOCK] (float32 moments: a 0 stands in,
    # as orbax keeps no empty arrays)
    nu_scale: optax.Updates


_QMAP = {signed: adamw8bit.dynamic_map(signed) for signed in (True, False)}


def _holds_codes(path, p) -> bool:
    """adamw8bit.quantized on one layer's tensor.

    A stacked parameter's leading axis is its layers (multi-token prediction's: its depths, torchpar's modules).
    """
    stacked = _name(path).startswith((*muon.STACKS, "mtp."))
    return adamw8bit.quantized(p.size // p.shape[0] if stacked else p.size)


def quantize(x: jax.Array, signed: bool) -> tuple[jax.Array, jax.Array]:
    """x -> (uint8 codes shaped as x, float32 scale per block).

    jaxpar/core/optimizer/adamw8bit.py's q, as torchao rounds: the largest code at or below each value, then one up
    from its midpoint with the next.
    """
    qmap = jnp.asarray(_QMAP[signed])
    blocks = x.reshape(-1, adamw8bit.BLOCK)
    scale = jnp.maximum(jnp.abs(blocks).max(axis=1), 1e-12)
    y = blocks / scale[:, None]
    code = jnp.maximum(jnp.searchsorted(qmap, y, side="right") - 1, 0)
    up = jnp.minimum(code + 1, 255)
    code = jnp.where(y - qmap[code] >= (qmap[up] - qmap[code]) * 0.5, up, code)
    return code.astype(jnp.uint8).reshape(x.shape), scale


def dequantize(codes: jax.Array, scale: jax.Array, signed: bool) -> jax.Array:
    values = jnp.asarray(_QMAP[signed])[codes.astype(jnp.int32)]
    return (values.reshape(-1, adamw8bit.BLOCK) * scale[:, None]).reshape(codes.shape)


def _stored(moments, scales, signed: bool):
    """The float32 moments as kept: (codes, scales) trees, a small tensor's moment as it is."""
    pairs = jax.tree.map(lambda x, s: quantize(x, signed) if s.ndim else (x, s), moments, scales)
    return jax.tree.transpose(jax.tree.structure(moments), jax.tree.structure((0, 0)), pairs)


def scale_by_adamw8bit(cfg: Config) -> optax.GradientTransformation:
    """The whole 8-bit AdamW update, the learning rate and weight decay included.

    The rule: jaxpar/core/optimizer/adamw8bit.py.
    """
    o, lr = cfg.optim, lr_fn(cfg)

    def init(params):
        codes = lambda p, x: jnp.zeros(x.shape, jnp.uint8) if _holds_codes(p, x) else jnp.zeros_like(x)
        scale = lambda p, x: jnp.zeros(x.size // adamw8bit.BLOCK if _holds_codes(p, x) else ())
        mu, mu_scale = (jax.tree_util.tree_map_with_path(f, params) for f in (codes, scale))
        return AdamW8bitState(jnp.zeros((), jnp.int32), mu, mu, mu_scale, mu_scale)

    def update(grads, state, params):
        count = optax.safe_increment(state.count)
        t = count.astype(jnp.float32)
        bc1, bc2 = 1 - o.beta1**t, 1 - o.beta2**t
        read = lambda x, scale, signed: dequantize(x, scale, signed) if x.dtype == jnp.uint8 else x
        m = jax.tree.map(lambda x, s, g: _lerp(read(x, s, True), g, 1 - o.beta1), state.mu, state.mu_scale, grads)
        v = jax.tree.map(lambda x, s, g: _lerp(read(x, s, False), g * g, 1 - o.beta2), state.nu, state.nu_scale, grads)

        rate = lr(state.count)

        def step(path, m, v, w):
            decay = o.weight_decay if decays(_name(path)) else 0.0
            return -rate * (decay * w) - rate * (m / bc1) / (jnp.sqrt(v) / jnp.sqrt(bc2) + o.eps)

        mu, mu_scale = _stored(m, state.mu_scale, True)
        nu, nu_scale = _stored(v, state.nu_scale, False)
        updates = jax.tree_util.tree_map_with_path(step, m, v, params)
        return updates, AdamW8bitState(count, mu, nu, mu_scale, nu_scale)

    return optax.GradientTransformation(init, update)


def with_clip_slot(fit):
    """Extend Checkpointer.restore_latest's `fit` to checkpoints saved without the gradient-clipping slot.

    Checkpoints written while optim.grad_clip=0 left the clipping slot out (AdamW's state alone): they are read as
    saved, then the empty slot is put in front.
    """

    def extended(saved: dict):
        target, after = fit(saved)
        if len(saved["opt_state"]) == len(target["opt_state"]):
            return target, after

        def slotted(state: dict) -> dict:
            state = {**state, "opt_state": (optax.EmptyState(), state["opt_state"])}
            return after(state) if after is not None else state

        return {**target, "opt_state": target["opt_state"][1]}, slotted

    return extended
