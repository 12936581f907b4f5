"""Tokens to their experts and back, mesh-free.

What a mixture-of-experts layer runs between its router and the sum of its experts' outputs (jaxpar/models/moe.py
routes; jaxpar/parallel/expert_parallel.py runs this across `ep`).

Each of a device's N tokens has k (expert id, weight) choices, some dropped by the router's capacity. The
choices are sorted into a buffer [experts, slots, embed]: expert e's slot s holds the s-th token (in token
order) that chose e; a slot nobody fills stays zero. The buffer goes to the devices owning the experts
(`exchange`: an all-to-all over ep; nothing on one device), every expert runs its SwiGLU on its slots as one
batched matmul, the results come back (`back`), and each token sums its choices' outputs by their weights.

The buffer is padded: slots = N holds any routing without a drop (a token picks an expert at most once), at the
price of experts x N rows in flight per device. The padded all-to-all is what XLA:CPU runs (it has no
ragged_all_to_all); a ragged exchange of the filled slots alone is not built yet. On one device's experts
(model.moe_ragged, `ragged_experts`) the kept choices are instead sorted by expert and each projection is one
jax.lax.ragged_dot over the filled rows alone: N x k rows, not experts x slots.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jaxpar.core.model.experts import slots_for


def _same(a):
    return a


def gated(activation: tuple, gate, up):
    """The experts' gated activation of `activation` = (model.moe_activation, its limit, its alpha).

    swiglu: silu(gate) x up. gpt_oss: gate clamped at most the limit, up within +-limit, then
    (up + 1) x gate x sigmoid(alpha x gate).
    """
    kind, limit, alpha = activation
    if kind == "swiglu":
        return jax.nn.silu(gate) * up
    gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return (up + 1) * gate * jax.nn.sigmoid(alpha * gate)


def swiglu_experts(buffer, w: dict, activation: tuple = ("swiglu", 0.0, 0.0), reduce: Callable = _same):
    """Run `buffer` [experts, slots, embed] through each expert's gated MLP.

    w: gate, up [experts, embed, width], down [experts, width, embed], and with model.moe_expert_bias gate_bias,
    up_bias [experts, width] and down_bias [experts, embed] (added once, after `reduce`); `reduce` sums partial
    outputs when the width is split (a psum over tp). `activation`: gated's.
    """
    bias = lambda name: w[name][:, None, :] if name in w else 0
    gate = jnp.einsum("esd,edf->esf", buffer, w["gate"]) + bias("gate_bias")
    up = jnp.einsum("esd,edf->esf", buffer, w["up"]) + bias("up_bias")
    return reduce(jnp.einsum("esf,efd->esd", gated(activation, gate, up), w["down"])) + bias("down_bias")


def dispatch(
    x,
    ids,
    weights,
    kept,
    n_experts: int,
    slots: int,
    experts: Callable,
    exchange: Callable = _same,
    back: Callable = _same,
):
    """x [N, embed]; ids, weights, kept [N, k] -> [N, embed]: sum over the kept choices of weight x expert(x).

    `experts` maps the received buffer to outputs of the same shape.
    """
    N, k = ids.shape
    flat, keep = ids.reshape(-1), kept.reshape(-1)
    chosen = (flat[:, None] == jnp.arange(n_experts)) & keep[:, None]  # [N*k, experts]
    rank = jnp.sum(jnp.where(chosen, jnp.cumsum(chosen, axis=0, dtype=jnp.int32) - 1, 0), axis=1)
    slot = jnp.where(keep, rank, slots)  # a dropped choice points past the buffer: the scatter skips it
    buffer = (
        jnp.zeros((n_experts, slots, x.shape[1]), x.dtype).at[flat, slot].set(jnp.repeat(x, k, axis=0), mode="drop")
    )
    out = back(experts(exchange(buffer)))
    picked = out.at[flat, slot].get(mode="fill", fill_value=0).reshape(N, k, -1)
    return jnp.sum(picked * weights[..., None].astype(x.dtype), axis=1)


def local_experts(
    x,
    ids,
    weights,
    kept,
    w: dict,
    capacity: int,
    activation: tuple = ("swiglu", 0.0, 0.0),
    owners: int = 1,
    exchange: Callable = _same,
    back: Callable = _same,
    reduce: Callable = _same,
):
    """The parallel context's default: every expert on this device.

    x [B, T, embed]; ids, weights, kept [B, T, k]; w: the experts' weights (swiglu_experts'); `capacity`: slots per
    expert per row (0: dropless). Inside expert parallelism's shard_map (parallel/expert_parallel.py) the same on this
    device's rows and experts: `owners` devices hold w["gate"].shape[0] experts each, `exchange`/`back` move the
    buffer to them and home, `reduce` sums outputs of a split width.
    """
    B, T, D = x.shape
    flat = (a.reshape(B * T, -1) for a in (x, ids, weights, kept))
    y = dispatch(
        *flat,
        w["gate"].shape[0] * owners,
        slots_for(B * T, B, capacity),
        lambda b: swiglu_experts(b, w, activation, reduce),
        exchange,
        back,
    )
    return y.reshape(B, T, D)


def ragged_experts(
    x, ids, weights, kept, w: dict, capacity: int = 0, activation: tuple = ("swiglu", 0.0, 0.0), reduce=_same
):
    """local_experts' sum with only the rows routed to each expert multiplied (model.moe_ragged).

    x [B, T, embed]; ids, weights, kept [B, T, k]: the kept choices sorted by expert (stable: token order within
    one), each projection one ragged_dot over the groups of rows, the outputs back in choice order. `capacity` is the
    router's (its drops are in `kept`); w, activation and reduce are swiglu_experts'.
    """
    del capacity
    B, T, D = x.shape
    E, k = w["gate"].shape[0], ids.shape[-1]
    choice = jnp.where(kept, ids, E).reshape(-1)  # a dropped choice sorts after every expert's rows
    order = jnp.argsort(choice, stable=True)
    sizes = jnp.bincount(choice, length=E + 1)[:E].astype(jnp.int32)  # the dropped rows lie past every group
    rows, expert = x.reshape(B * T, D)[order // k], choice[order]  # expert E: a dropped row
    bias = lambda name: w[name][jnp.minimum(expert, E - 1)] if name in w else 0
    gate = jax.lax.ragged_dot(rows, w["gate"], sizes) + bias("gate_bias")
    up = jax.lax.ragged_dot(rows, w["up"], sizes) + bias("up_bias")
    out = reduce(jax.lax.ragged_dot(gated(activation, gate, up), w["down"], sizes)) + bias("down_bias")
    out = jnp.where((expert < E)[:, None], out, 0)  # a dropped row's biases
    per_choice = jnp.zeros_like(out).at[order].set(out).reshape(B * T, k, D)
    return jnp.sum(per_choice * weights.reshape(B * T, k, 1).astype(x.dtype), axis=1).reshape(B, T, D)
