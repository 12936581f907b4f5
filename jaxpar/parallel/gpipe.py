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
    """A `run_layers(layer, stacked, x)` for the parallel context: the layer stack as a GPipe pipeline."""
    def run_layers(layer: Callable, stacked, x: jax.Array) -> jax.Array:
        return gpipe(lambda params, h: scan_layers(layer, params, h, unroll), stacked, x, stages, microbatches)

    return run_layers


def gpipe(stage_fn: Callable, stacked, x: jax.Array, stages: int, microbatches: int) -> jax.Array:
    """Run `stage_fn(stage_params, h) -> h` (one stage's layers) as a GPipe pipeline.

    stacked: pytree of arrays with a leading layers axis (L divisible by `stages`).
    x: activations [batch, seq, embed]; returns the same shape after all L layers.
    """
    S, M = stages, microbatches
    staged = jax.tree.map(lambda w: w.reshape(S, w.shape[0] // S, *w.shape[1:]), stacked)
    micro = split_microbatches(x, M)
    act_axes = ("stage", "batch", "seq", "act_embed")

    def tick(carry, t):
        buffer, outputs = carry
        fresh = jax.lax.dynamic_index_in_dim(micro, jnp.minimum(t, M - 1), keepdims=False)
        buffer = buffer.at[0].set(jnp.where(t < M, fresh, buffer[0]))
        out = constrain(jax.vmap(stage_fn)(staged, constrain(buffer, act_axes)), act_axes)
        done = jnp.maximum(t - (S - 1), 0)
        outputs = jax.lax.dynamic_update_index_in_dim(
            outputs, jnp.where(t >= S - 1, out[S - 1], outputs[done]), done, axis=0)
        return (jnp.roll(out, 1, axis=0), outputs), None

    buffer = jnp.zeros((S,) + micro.shape[1:], x.dtype)
    (_, outputs), _ = jax.lax.scan(tick, (buffer, jnp.zeros_like(micro)), jnp.arange(M + S - 1))
    return join_microbatches(outputs)
