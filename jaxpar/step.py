"""The jitted train and eval steps of a layout: loss and gradients (plain, GPipe, or on the
hand-scheduled pipeline executor), gradient accumulation over microbatches, the optimizer update."""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxpar.context import use
from jaxpar.core.pipeline_schedules import resolve_microbatches
from jaxpar.core.sketches import stacked_sketches
from jaxpar.layout import Layout
from jaxpar.loss import cross_entropy, loss_fn, split_rows, token_order
from jaxpar.models.gpt import abstract_model
from jaxpar.ops import split_microbatches
from jaxpar.optim import lr_fn, make_optimizer
from jaxpar.parallel.pipeline_executor import HAND_SCHEDULED, pipeline_value_and_grad
from jaxpar.parallelize import parallel_context


def _loss(layout: Layout, graphdef, params, batch):
    return loss_fn(nnx.merge(graphdef, params), batch, token_order(layout.cfg, layout.mesh, batch.shape[1] - 1))


def hand_scheduled(layout: Layout, schedule: str):
    """(params, batch) -> (loss, grads) on the pipeline executor running `schedule` over the layout's pp
    (any schedule: the memory benchmark also runs the GPipe order on it). Trace it in
    parallel_context(layout, on_executor=True): each stage runs its own layers as a scan."""
    cfg, mesh, p = layout.cfg, layout.mesh, layout.cfg.parallel
    graphdef, S = abstract_model(cfg.model)[0], mesh.shape["pp"]

    def value_and_grad(params, batch):
        order = token_order(cfg, mesh, batch.shape[1] - 1)

        def stage_forward(rest, chunk, sketches, x, tokens, targets, first: bool, last: bool):
            model = nnx.merge(graphdef, {**rest, "blocks": chunk})
            h = model.run_blocks(model.embed(tokens, order) if first else x, order, sketches)
            return h, (cross_entropy(model.head(h), targets) if last else jnp.zeros((), jnp.float32))

        rest = {k: v for k, v in params.items() if k != "blocks"}
        loss, g_rest, g_blocks = pipeline_value_and_grad(
            stage_forward, rest, params["blocks"], stacked_sketches(cfg.model), *split_rows(batch, order), mesh=mesh,
            schedule=schedule, S=S, M=resolve_microbatches(S, p.pipeline_microbatches), V=p.pipeline_virtual_stages,
            width=cfg.model.d_model, dtype=jnp.dtype(cfg.model.compute_dtype))
        return loss, {**g_rest, "blocks": g_blocks}

    return value_and_grad


def loss_and_grad(layout: Layout, schedule: str | None = None):
    """((params, batch) -> (loss, grads), the parallel context to trace it in), as the train step computes
    them: jax.value_and_grad (GPipe over pp included: jax.grad through its ticks), or the pipeline executor
    for the hand-scheduled schedules. `schedule` puts any schedule on the executor (memory benchmark)."""
    p = layout.cfg.parallel
    if schedule is None and layout.mesh.shape["pp"] > 1 and p.pipeline_schedule in HAND_SCHEDULED:
        schedule = p.pipeline_schedule
    if schedule is not None:
        return hand_scheduled(layout, schedule), parallel_context(layout, on_executor=True)
    return jax.value_and_grad(partial(_loss, layout, abstract_model(layout.cfg.model)[0])), parallel_context(layout)


def make_train_step(layout: Layout):
    cfg, M = layout.cfg, layout.cfg.train.microbatches
    tx, lr = make_optimizer(cfg), lr_fn(cfg)
    value_and_grad, context = loss_and_grad(layout)

    def step(state, batch):
        params = state["params"]

        def accumulate(carry, mb):
            mb = jax.lax.with_sharding_constraint(mb, layout.batch_sharding)
            loss, grads = value_and_grad(params, mb)
            return jax.tree.map(jnp.add, carry, (loss, grads)), None

        zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
        (loss, grads), _ = jax.lax.scan(accumulate, zero, split_microbatches(batch, M))
        loss, grads = loss / M, jax.tree.map(lambda g: g / M, grads)
        grads = jax.tree.map(jax.lax.with_sharding_constraint, grads, layout.shardings(layout.grad_specs))
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new = {"params": optax.apply_updates(params, updates), "opt_state": opt_state, "step": state["step"] + 1}
        return new, {"loss": loss, "grad_norm": optax.global_norm(grads), "lr": lr(state["step"])}

    def traced(state, batch):
        with use(context):
            return step(state, batch)

    return jax.jit(traced, in_shardings=(layout.state_shardings, layout.batch_sharding),
                   out_shardings=(layout.state_shardings, None), donate_argnums=0)


def make_eval_step(layout: Layout):
    graphdef, context = abstract_model(layout.cfg.model)[0], parallel_context(layout)

    def evaluate(params, batch):
        with use(context):
            return _loss(layout, graphdef, params, batch)

    return jax.jit(evaluate, in_shardings=(layout.state_shardings["params"], layout.batch_sharding))
