"""The jitted train and eval steps of a layout.

The loss and gradients jaxpar/parallelize.py makes of the model (over the microbatches, reduced over the data axes), the
optimizer update, float16's loss scale, the experts' balance bias.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxpar import loss_scale
from jaxpar.context import use
from jaxpar.core.data.tokens import document_token
from jaxpar.layout import Layout
from jaxpar.loss import model_loss, token_share
from jaxpar.mesh import make_mesh
from jaxpar.models.decoder import abstract_model
from jaxpar.models.moe import update_router_bias
from jaxpar.optim import lr_fn, make_optimizer
from jaxpar.parallel import diloco
from jaxpar.parallelize import parallel_context, parallelize
from jaxpar.state import abstract_state, init_state


def loss_and_grad(layout: Layout, schedule: str | None = None):
    """The train step's loss-and-gradients function and the parallel context to trace it in.

    Returns ((params, batch, scale) -> (loss, grads) of the loss times scale, the parallel context), as the train step
    computes them (jaxpar/parallelize.py): jax.value_and_grad (GPipe over pp included: jax.grad through its ticks), or
    the pipeline executor for the hand-scheduled schedules. `schedule` puts any schedule on the executor (memory
    benchmark).
    """
    parallel = parallelize(layout, schedule)
    return parallel.value_and_grad, parallel.context


def make_train_step(layout: Layout, inject_overflow: bool = False, carry: int | None = None):
    """The jitted step (state, batch) -> (state, metrics), of the layout's model parallelized (jaxpar/parallelize.py).

    `inject_overflow` (a test hook, <PREFIX>_FAULT_OVERFLOW_AT_STEP) makes this step's gradients non-finite, as a
    float16 overflow would. `carry`: DiLoCo's fragment whose exchange the step carries (parallel/diloco.py).
    """
    cfg, group = layout.cfg, layout.group or layout  # DiLoCo: the step below is each group's (parallel/diloco.py)
    tx, lr = make_optimizer(cfg), lr_fn(cfg)
    parallel = parallelize(group)
    fp16, experts = loss_scale.enabled(cfg), cfg.model.moe_experts > 0

    def step(state, batch):
        state = group.to_device(state)  # parallel.offload: host -> device for this step
        params = state["params"]
        scale = state["loss_scale"]["scale"] if fp16 else 1.0
        share = token_share(batch)  # 1.0 unless the data masks targets out of the loss
        # mean loss and gradients over the batch, reduced over the data axes (parallel.grad_compression)
        loss, grads, extras = parallel.gradients(params, batch, state, scale, share)
        if inject_overflow:
            grads = jax.tree.map(lambda g: g * jnp.inf, grads)
        grads = jax.tree.map(jax.lax.with_sharding_constraint, grads, group.shardings(group.grad_specs))
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new = {"params": optax.apply_updates(params, updates), "opt_state": opt_state, "step": state["step"] + 1}
        if "powersgd" in extras:  # its error buffers and factors after this step
            new["powersgd"] = extras["powersgd"]
        metrics = {"loss": loss, "grad_norm": optax.global_norm(grads), "lr": lr(state["step"])}
        # core/model/experts.py: expert_records (the balance loss per row and layer); the balance bias moved
        if experts:
            expert_stats = extras["expert_stats"]
            metrics["expert_stats"] = expert_stats.at[-1].divide(batch.shape[0] * cfg.model.moe_layers)
            new["params"] = update_router_bias(new["params"], expert_stats, cfg.model)  # (a skipped step keeps it)
        for d in range(cfg.model.mtp_depth):  # multi-token prediction: each depth's cross-entropy, as "loss" is
            metrics[f"mtp_loss_{d + 1}"] = extras["mtp_losses"][d]
        if fp16:  # skip a step that overflowed (its parameters and optimizer state stay), adjust the scale
            ls, finite = state["loss_scale"], loss_scale.all_finite(grads)
            new["params"], new["opt_state"] = loss_scale.keep_if(
                finite, (new["params"], opt_state), (params, state["opt_state"])
            )
            new["loss_scale"] = loss_scale.update(ls, finite, cfg)
            metrics.update(
                lr=lr(state["step"] - ls["skipped"]),  # the schedule counts applied updates
                loss_scale=scale,
                skipped_steps=new["loss_scale"]["skipped"],
            )
        return group.to_rest(new), metrics

    def traced(state, batch):
        with use(parallel.context):
            return step(state, batch)

    if layout.group is not None:  # every group's step at once, nothing between groups
        traced = diloco.group_step(layout, traced, carry)

    return jax.jit(
        traced,
        in_shardings=(layout.state_shardings, layout.batch_sharding),
        out_shardings=(layout.state_shardings, None),
        donate_argnums=0,
    )


def compiled_train_step(layout: Layout, state, compiler_options: dict | None = None, shape=None, carry=None):
    """The train step compiled ahead of time for `state` (arrays or shapes) and the layout's batch.

    Or for a batch of `shape`: one of train.batch_rampup's or a bucket's (core/data/batch_shapes.py). `carry`:
    make_train_step's.
    """
    batch = jax.ShapeDtypeStruct(shape or layout.batch_shape, "int32", sharding=layout.batch_sharding)
    return make_train_step(layout, carry=carry).lower(state, batch).compile(compiler_options)


def build_step(cfg, sizes: dict[str, int], devices=None, abstract: bool = False, compiler_options=None):
    """(layout, state, compiled step) of a config on a mesh.

    The one assembly the trainer's tools, the tests and the benchmarks share. `abstract`: the state as shapes only,
    nothing allocated (plan, gpu_check).
    """
    layout = Layout(cfg, make_mesh(sizes, devices))
    state = abstract_state(layout) if abstract else init_state(layout)
    return layout, state, compiled_train_step(layout, state, compiler_options)


def make_eval_step(layout: Layout):
    graphdef, context, eod = abstract_model(layout.cfg.model)[0], parallel_context(layout), document_token(layout.cfg)

    def evaluate(params, batch):
        params = layout.to_device({"params": params})["params"]
        with use(context):
            loss = model_loss(layout, graphdef, eod, params, batch, balance=False)
            return (loss[0] if isinstance(loss, tuple) else loss) * token_share(batch)

    return jax.jit(evaluate, in_shardings=(layout.state_shardings["params"], layout.batch_sharding))
