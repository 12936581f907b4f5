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

import contextlib
import contextvars
from typing import Callable

import jax
import jax.numpy as jnp

from jaxpar.errors import UserError
from jaxpar.parallel.schedules import check
from jaxpar.sharding import constrain

# (stages, microbatches) while tracing a pipelined model; unset or 1 stage: plain layer scan.
_PIPELINE: contextvars.ContextVar = contextvars.ContextVar("jaxpar_pipeline", default=None)


@contextlib.contextmanager
def use_pipeline(stages: int, microbatches: int):
    token = _PIPELINE.set((stages, microbatches))
    try:
        yield
    finally:
        _PIPELINE.reset(token)


def resolve_microbatches(stages: int, microbatches: int) -> int:
    return microbatches or 2 * stages


def check_pipeline(cfg, sizes) -> None:
    """One-line errors for layouts the pipeline cannot run (sizes: mesh axis -> size)."""
    stages = sizes["pp"]
    if stages == 1:
        return
    p, t = cfg.parallel, cfg.train
    M = resolve_microbatches(stages, p.pipeline_microbatches)
    check(p.pipeline_schedule, stages, M, p.pipeline_virtual_stages, cfg.model.n_layer)
    data_ways = sizes["dp"] * sizes["fsdp"]
    batch = t.global_batch_size // t.microbatches
    if batch % (M * data_ways):
        raise UserError(f"batch per microbatch {batch} is not divisible by parallel.pipeline_microbatches={M} "
                        f"x data axes dp*fsdp={data_ways}")
    if p.pipeline_schedule != "gpipe" and sizes["sp"] > 1:
        # inside the executor's shard_map (manual over pp), jax 0.10 / XLA:CPU give wrong values for ring
        # attention's nested shard_map and crash partitioning dilated attention's sp-sharded segments
        if cfg.model.attention == "dilated":
            raise UserError(f"parallel.pipeline_schedule={p.pipeline_schedule} with sp>1 does not run "
                            "model.attention=dilated (it runs with the gpipe schedule)")
        if p.sequence_attention == "ring":
            raise UserError(f"parallel.pipeline_schedule={p.pipeline_schedule} with sp>1 needs "
                            "parallel.sequence_attention=all_gather or ulysses (ring runs with the gpipe schedule)")


def run_layers(layer: Callable, stacked, x: jax.Array) -> jax.Array:
    """Apply the layer stack: a scan, or a GPipe pipeline over `pp` while one is active."""
    def stage_fn(stage_params, h):
        return jax.lax.scan(lambda c, p: (layer(c, p), None), h, stage_params)[0]

    active = _PIPELINE.get()
    if active is None or active[0] == 1:
        return stage_fn(stacked, x)
    return gpipe(stage_fn, stacked, x, *active)


def split_microbatches(x: jax.Array, M: int) -> jax.Array:
    """[B, ...] -> [M, B/M, ...]; microbatch m takes rows m, m+M, ... so each device keeps its rows."""
    return x.reshape(x.shape[0] // M, M, *x.shape[1:]).swapaxes(0, 1)


def join_microbatches(x: jax.Array) -> jax.Array:
    return x.swapaxes(0, 1).reshape(-1, *x.shape[2:])


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
