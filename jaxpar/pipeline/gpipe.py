"""GPipe over the `pp` mesh axis, on GSPMD: stages shard the stacked `layers` axis.

The layer stack [L, ...] is viewed as [S, L/S, ...] with the stage axis on `pp`. A buffer
[S, microbatch, ...] holds what each stage works on; every tick all stages run their layers at
once (a vmap over the stage axis, which GSPMD partitions over `pp`), the last stage's output is
collected, and the buffer shifts one stage down (a roll on the pp-sharded axis, which XLA lowers
to a collective-permute: the stage-to-stage send). After M + S - 1 ticks every microbatch has
passed every stage. Backward comes from `jax.grad` through the ticks: all forwards, then all
backwards — the GPipe schedule, bubble (S-1)/(M+S-1).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jaxpar.context import constrain
from jaxpar.ops import join_microbatches, scan_layers, split_microbatches


def gpipe_layers(stages: int, microbatches: int, unroll: bool = False) -> Callable:
    """A `run_layers(layer, stacked, x, rows)` for the parallel context: the layer stack as a GPipe pipeline.

    The per-row `rows` (packed documents' positions and segment ids) travel with their microbatch's activations.
    """

    def run_layers(layer: Callable, stacked, x: jax.Array, rows: tuple = ()) -> jax.Array:
        if jax.tree.leaves(stacked)[0].shape[0] % stages:
            # a stack the stages cannot split: model.moe_first_dense's dense layers, which the hand-scheduled executor
            # runs whole on its first stage (gpipe's training refuses them: jaxpar/checks.py), run whole here too
            return scan_layers(layer, stacked, x, rows, unroll)

        def stage(params, carry):
            h, rows = carry
            return scan_layers(layer, params, h, rows, unroll), rows

        return gpipe(stage, stacked, (x, rows), stages, microbatches)[0]

    return run_layers


def _pin(tree):
    """Pin each stage's activations [stage, batch, seq, embed] on pp.

    The per-row statistics [stage, batch, n] and layer indices [stage, batch] are pinned likewise.
    """
    axes = {4: ("stage", "batch", "seq", "act_embed"), 3: ("stage", "batch", None), 2: ("stage", "batch")}
    return jax.tree.map(lambda a: constrain(a, axes[a.ndim]), tree)


def gpipe(stage_fn: Callable, stacked, x, stages: int, microbatches: int):
    """Run `stage_fn(stage_params, h) -> h` (one stage's layers) as a GPipe pipeline.

    stacked: pytree of arrays with a leading layers axis (L divisible by `stages`).
    x: activations [batch, seq, embed] (or a pytree of per-row arrays: with experts, their statistics beside);
    returns the same shapes after all L layers.
    """
    S, M = stages, microbatches
    staged = jax.tree.map(lambda w: w.reshape(S, w.shape[0] // S, *w.shape[1:]), stacked)
    micro = jax.tree.map(lambda a: split_microbatches(a, M), x)
    at = lambda tree, i: jax.tree.map(lambda a: a[i], tree)

    def tick(carry, t):
        buffer, outputs = carry
        fresh = jax.tree.map(lambda m: jax.lax.dynamic_index_in_dim(m, jnp.minimum(t, M - 1), keepdims=False), micro)
        buffer = jax.tree.map(lambda b, f: b.at[0].set(jnp.where(t < M, f, b[0])), buffer, fresh)
        out = _pin(jax.vmap(stage_fn, spmd_axis_name="pp")(staged, _pin(buffer)))
        done = jnp.maximum(t - (S - 1), 0)
        outputs = jax.tree.map(
            lambda o, last: jax.lax.dynamic_update_index_in_dim(o, jnp.where(t >= S - 1, last, o[done]), done, axis=0),
            outputs,
            at(out, S - 1),
        )
        return (jax.tree.map(lambda a: jnp.roll(a, 1, axis=0), out), outputs), None

    buffer = jax.tree.map(lambda m: jnp.zeros((S,) + m.shape[1:], m.dtype), micro)
    (_, outputs), _ = jax.lax.scan(tick, (buffer, jax.tree.map(jnp.zeros_like, micro)), jnp.arange(M + S - 1))
    return jax.tree.map(join_microbatches, outputs)
