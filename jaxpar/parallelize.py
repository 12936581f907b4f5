"""jaxpar's parallelism, applied from outside the model in one fixed order (torchpar/parallelize.py is its twin):.

1. rules: logical axis names -> mesh axes, jaxpar/sharding.py's table (ZeRO-3 adds dp beside fsdp: layout.rules_for)
2. ZeRO and offload: the train state's shardings, ZeRO stages 0-3, and parallel.offload's host memory, which the step
   moves onto the devices and back (jaxpar/layout.py: Layout, Layout.to_device, Layout.to_rest)
3. sp, pp, ep: the parallel context the model is traced in (jaxpar/context.py): attention across `sp` shards
   (parallel/sequence.py), the layer stack as GPipe stages over `pp` (pipeline/gpipe.py) -- or, for the hand-scheduled
   schedules, each stage's layers run by pipeline/executor.py (jaxpar/pipeline/gradients.py) -- and a mixture of
   experts' tokens sent to their experts over `ep` (parallel/expert_parallel.py)
4. remat: the context's layer runner recomputes each layer in the backward pass (model.remat: ops.remat_layers)
5. gradient reduction and compression: loss and gradients summed over the microbatches (ops.sum_over_microbatches),
   reduced over the data axes by GSPMD, in bfloat16 (parallel/compression.py) or by PowerSGD (parallel/powersgd.py)

A Layout is stages 1 and 2; `parallelize(layout)` applies 3 to 5 and is what jaxpar/step.py builds the step from.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from jaxpar.context import ParallelContext
from jaxpar.core.pipeline.schedules import resolve_microbatches
from jaxpar.core.data.tokens import document_token
from jaxpar.parallel.expert_dispatch import local_experts
from jaxpar.layout import Layout
from jaxpar.loss import aux_zeros, has_aux, model_loss
from jaxpar.pipeline.gradients import hand_scheduled
from jaxpar.models.decoder import abstract_model
from jaxpar.ops import local_attention, remat_layers, scan_layers, sum_over_microbatches
from jaxpar.parallel import powersgd
from jaxpar.parallel.compression import compressed_loss_and_grads, data_axes
from jaxpar.parallel.expert_parallel import expert_parallel
from jaxpar.pipeline.gpipe import gpipe_layers
from jaxpar.pipeline.tick_plan import HAND_SCHEDULED
from jaxpar.parallel.sequence import sequence_attention


@dataclasses.dataclass(frozen=True)
class Parallel:
    """A layout's model, parallelized: what the train step is built from."""

    context: ParallelContext  # stages 3 and 4: what the model asks for while it is traced
    value_and_grad: Callable  # (params, microbatch, scale) -> (loss, grads) of the loss times scale, in `context`
    # stage 5: (params, batch, state, scale, token share) -> (mean loss, mean gradients, extras: the experts'
    # statistics "expert_stats", multi-token prediction's per-depth losses "mtp_losses", PowerSGD's next state
    # "powersgd")
    gradients: Callable


def parallelize(layout: Layout, schedule: str | None = None) -> Parallel:
    """Stages 3 to 5 (the module docstring) for a layout, in order.

    `schedule` puts any pp schedule on the executor (the memory benchmark); by default parallel.pipeline_schedule's
    hand-scheduled ones run there.
    """
    cfg, p = layout.cfg, layout.cfg.parallel
    if schedule is None and layout.mesh.shape["pp"] > 1 and p.pipeline_schedule in HAND_SCHEDULED:
        schedule = p.pipeline_schedule
    context = mesh_context(layout, on_executor=schedule is not None)  # 3. sp, pp, ep
    context = dataclasses.replace(context, run_layers=remat_layers(context.run_layers, cfg.model.remat))  # 4. remat
    if schedule is not None:  # pp on the executor: it computes the stages' gradients itself
        value_and_grad = hand_scheduled(layout, schedule)
    else:  # jax.grad, through GPipe's ticks too
        loss = functools.partial(model_loss, layout, abstract_model(cfg.model)[0], document_token(cfg))
        value_and_grad = jax.value_and_grad(loss, has_aux=has_aux(cfg.model))
    return Parallel(context, value_and_grad, reduce_gradients(layout, value_and_grad))  # 5. gradient reduction


def unrolled_layers(setting: str, mesh) -> bool:
    """Whether the layer stack is unrolled rather than scanned, per train.scan_layers.

    auto unrolls on a GPU, where the scan's per-layer copies are costly (docs/gpu.md), and scans elsewhere, where
    compile time matters more (tests, CPU runs).
    """
    return setting == "off" or (setting == "auto" and mesh.devices.flat[0].platform == "gpu")


def mesh_context(layout: Layout, on_executor: bool = False) -> ParallelContext:
    """Stage 3: the parallel context for the mesh's sp, pp and ep axes.

    Attention across `sp` shards with the configured strategy, the layer stack as a GPipe pipeline over `pp` -- or a
    plain scan when the stages run on the executor, which calls each stage's layers itself -- and a mixture of
    experts' tokens sent to their experts over `ep`.
    """
    mesh, p, S = layout.mesh, layout.cfg.parallel, layout.mesh.shape["pp"]
    unroll = unrolled_layers(layout.cfg.train.scan_layers, mesh)
    attention = (
        sequence_attention(mesh, layout.rules, p.sequence_attention) if mesh.shape["sp"] > 1 else local_attention
    )
    if S > 1 and not on_executor:
        run_layers = gpipe_layers(S, resolve_microbatches(S, p.pipeline_microbatches), unroll)
    else:
        run_layers = functools.partial(scan_layers, unroll=unroll)
    m = layout.cfg.model
    experts = expert_parallel(mesh, layout.rules, m.moe_ragged) if m.moe_experts else local_experts
    return ParallelContext(mesh, layout.rules, attention, run_layers, experts, layout.cfg.model.float8)


def parallel_context(layout: Layout, on_executor: bool = False) -> ParallelContext:
    """Stages 3 and 4 alone.

    The context a forward pass is traced in (evaluation, decoding; GPipe over pp for every schedule unless
    `on_executor`).
    """
    context = mesh_context(layout, on_executor)
    return dataclasses.replace(context, run_layers=remat_layers(context.run_layers, layout.cfg.model.remat))


def reduce_gradients(layout: Layout, value_and_grad: Callable) -> Callable:
    """Stage 5, Parallel.gradients.

    `value_and_grad` over the batch's train.microbatches, the gradients reduced over the data axes as
    parallel.grad_compression says: by GSPMD wherever the shardings place it (none), in bfloat16 in a shard_map over
    the data axes (bf16), or by PowerSGD (powersgd, its state in the train state).
    """
    cfg, accum = layout.cfg, layout.cfg.train.microbatches
    zero = jnp.zeros((), jnp.float32)  # the loss's shape; with its aux (loss, the experts' statistics or a dict)
    zero = (zero, aux_zeros(cfg.model)) if has_aux(cfg.model) else zero
    if powersgd.enabled(layout):
        psgd = powersgd.powersgd_loss_and_grads(layout, value_and_grad, accum, zero)

        def powersgd_reduced(params, batch, state, scale, share):  # the mean already; float16's scale unused
            loss, grads, new = psgd(params, batch, state["powersgd"], state["step"], share)
            loss, extras = split_aux(cfg.model, loss)
            return loss, grads, {**extras, "powersgd": new}

        return powersgd_reduced
    if cfg.parallel.grad_compression == "bf16" and data_axes(layout.mesh):
        compressed = compressed_loss_and_grads(layout, value_and_grad, accum, zero)
        summed = lambda params, batch, scale, share: compressed(params, batch, jnp.asarray(scale, jnp.float32) * share)
    else:
        pin = lambda mb: jax.lax.with_sharding_constraint(mb, layout.shardings(layout.batch_sharding.spec))
        summed = lambda params, batch, scale, share: sum_over_microbatches(
            value_and_grad, params, batch, scale * share, accum, pin, zero
        )

    def reduced(params, batch, state, scale, share):
        loss, grads = summed(params, batch, scale, share)
        loss, extras = split_aux(cfg.model, loss, accum * scale)
        return loss / (accum * scale), jax.tree.map(lambda g: g / (accum * scale), grads), extras

    return reduced


def split_aux(m, loss, divisor=1.0):
    """(loss, extras) of a loss that may come with its aux (loss.loss_fn).

    The experts' statistics ("expert_stats", summed), or with multi-token prediction a dict whose "mtp_losses" are
    scaled as the loss and divided by `divisor` as it will be.
    """
    if not has_aux(m):
        return loss, {}
    loss, aux = loss
    extras = dict(aux) if isinstance(aux, dict) else {"expert_stats": aux}
    if "mtp_losses" in extras:
        extras["mtp_losses"] = extras["mtp_losses"] / divisor
    return loss, extras
