"""The jitted train and eval steps of a layout: loss and gradients (plain, GPipe, or on the
hand-scheduled pipeline executor), gradient accumulation over microbatches, the optimizer update."""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxpar import loss_scale
from jaxpar.context import use
from jaxpar.core.pipeline_schedules import resolve_microbatches
from jaxpar.core.sketches import stacked_sketches
from jaxpar.core.tokens import document_token
from jaxpar.layout import Layout
from jaxpar.mesh import make_mesh
from jaxpar.loss import cross_entropy, loss_fn, split_rows, token_order, token_share
from jaxpar.models.decoder import abstract_model
from jaxpar.models.moe import stats_width, update_router_bias
from jaxpar.ops import sum_over_microbatches
from jaxpar.optim import lr_fn, make_optimizer
from jaxpar.parallel import powersgd
from jaxpar.parallel.compression import compressed_loss_and_grads, data_axes
from jaxpar.parallel.pipeline_executor import HAND_SCHEDULED, StageFns, pipeline_value_and_grad
from jaxpar.parallelize import parallel_context
from jaxpar.state import abstract_state, init_state


def _loss(layout: Layout, graphdef, eod, params, batch, scale=1.0, balance=True):
    """The mean loss times `scale` (float16's loss scale; 1.0, a no-op, otherwise); `eod`: document_token's;
    `balance`: with the experts' balance loss (training), or the cross-entropy alone (evaluation)."""
    order = token_order(layout.cfg, layout.mesh, batch.shape[1] - 1)
    out = loss_fn(nnx.merge(graphdef, params), batch, order, eod, balance)
    return (out[0] * scale, out[1]) if isinstance(out, tuple) else out * scale  # with experts: (loss, statistics)


def hand_scheduled(layout: Layout, schedule: str):
    """(params, batch, scale) -> (loss, grads) of the loss times `scale`, on the pipeline executor running
    `schedule` over the layout's pp (any schedule: the memory benchmark also runs the GPipe order on it). Trace it in
    parallel_context(layout, on_executor=True): each stage runs its own layers as a scan."""
    cfg, mesh, p = layout.cfg, layout.mesh, layout.cfg.parallel
    graphdef, S, eod = abstract_model(cfg.model)[0], mesh.shape["pp"], document_token(cfg)

    def value_and_grad(params, batch, scale=1.0):
        rows = split_rows(batch, token_order(cfg, mesh, batch.shape[1] - 1), eod)
        # each microbatch's (tokens, positions, segments): with documents per row, else the order's for every row
        inputs = (rows.inputs, rows.positions, rows.segments) if rows.segments is not None else (rows.inputs,)
        where = lambda r: r[1:] if len(r) > 1 else (rows.positions, None)  # noqa: E731
        model = lambda rest, chunk: nnx.merge(graphdef, {**rest, "blocks": chunk})  # noqa: E731  a stage's view
        fns = StageFns(
            embed=lambda rest, chunk, r: model(rest, chunk).embed(r[0], where(r)[0]),
            layers=lambda rest, chunk, sketches, x, r: model(rest, chunk).run_blocks(x, *where(r), sketches),
            head_loss=lambda rest, chunk, h, targets: cross_entropy(model(rest, chunk).head(h), targets) * scale)
        rest = {k: v for k, v in params.items() if k != "blocks"}
        loss, g_rest, g_blocks = pipeline_value_and_grad(
            fns, rest, params["blocks"], stacked_sketches(cfg.model), inputs, rows.targets, mesh=mesh,
            schedule=schedule, S=S, M=resolve_microbatches(S, p.pipeline_microbatches), V=p.pipeline_virtual_stages,
            width=cfg.model.d_model, dtype=jnp.dtype(cfg.model.compute_dtype),
            weights_apart=cfg.model.remat == "none")  # a remat'ed layer recomputes its forward in B: W re-derives
        grads = {**g_rest, "blocks": g_blocks}
        # Pin the executor's gradients to the parameters' layout: left free, ZeRO-2's reduce-scatter layout
        # (step.py) propagates back into the schedule's per-tick branches, where XLA then places a resharding
        # collective that only the devices taking that branch reach -- a deadlock (docs/fuzz.md, case 91).
        return loss, jax.tree.map(jax.lax.with_sharding_constraint, grads, layout.shardings(layout.param_specs))

    return value_and_grad


def loss_and_grad(layout: Layout, schedule: str | None = None):
    """((params, batch, scale) -> (loss, grads) of the loss times scale, the parallel context to trace it in), as
    the train step computes
    them: jax.value_and_grad (GPipe over pp included: jax.grad through its ticks), or the pipeline executor
    for the hand-scheduled schedules. `schedule` puts any schedule on the executor (memory benchmark)."""
    p = layout.cfg.parallel
    if schedule is None and layout.mesh.shape["pp"] > 1 and p.pipeline_schedule in HAND_SCHEDULED:
        schedule = p.pipeline_schedule
    if schedule is not None:
        return hand_scheduled(layout, schedule), parallel_context(layout, on_executor=True)
    loss = partial(_loss, layout, abstract_model(layout.cfg.model)[0], document_token(layout.cfg))
    return jax.value_and_grad(loss, has_aux=layout.cfg.model.moe_experts > 0), parallel_context(layout)


def make_train_step(layout: Layout, inject_overflow: bool = False):
    """The jitted step (state, batch) -> (state, metrics). `inject_overflow` (a test hook,
    <PREFIX>_FAULT_OVERFLOW_AT_STEP) makes this step's gradients non-finite, as a float16 overflow would."""
    cfg, accum = layout.cfg, layout.cfg.train.microbatches  # M is the pipeline's (microbatches per schedule)
    tx, lr = make_optimizer(cfg), lr_fn(cfg)
    value_and_grad, context = loss_and_grad(layout)
    fp16, experts = loss_scale.enabled(cfg), cfg.model.moe_experts > 0
    zero_value = jnp.zeros((), jnp.float32)  # the loss's shape; with experts (loss, their summed statistics)
    if experts:
        zero_value = (zero_value, jnp.zeros((stats_width(cfg.model),), jnp.float32))
    compressed = psgd = None
    if cfg.parallel.grad_compression == "bf16" and data_axes(layout.mesh):
        compressed = compressed_loss_and_grads(layout, value_and_grad, accum)
    elif powersgd.enabled(layout):
        psgd = powersgd.powersgd_loss_and_grads(layout, value_and_grad, accum)

    def step(state, batch):
        state = to_device(layout, state)  # parallel.offload: host -> device for this step
        params = state["params"]
        scale = state["loss_scale"]["scale"] if fp16 else 1.0
        share = token_share(batch)  # 1.0 unless the data masks targets out of the loss

        if psgd is not None:  # parallel.grad_compression=powersgd: mean loss and gradients, its state updated
            loss, grads, new_psgd = psgd(params, batch, state["powersgd"], state["step"], share)
        else:
            if compressed is not None:  # parallel.grad_compression=bf16: the data axes' reduction in bfloat16
                loss, grads = compressed(params, batch, jnp.asarray(scale, jnp.float32) * share)
            else:
                loss, grads = sum_over_microbatches(value_and_grad, params, batch, scale * share, accum, lambda mb:
                                                    jax.lax.with_sharding_constraint(mb, layout.batch_sharding),
                                                    zero_value)
            if experts:
                loss, expert_stats = loss
            loss, grads = loss / (accum * scale), jax.tree.map(lambda g: g / (accum * scale), grads)
        if inject_overflow:
            grads = jax.tree.map(lambda g: g * jnp.inf, grads)
        grads = jax.tree.map(jax.lax.with_sharding_constraint, grads, layout.shardings(layout.grad_specs))
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new = {"params": optax.apply_updates(params, updates), "opt_state": opt_state, "step": state["step"] + 1}
        if psgd is not None:
            new["powersgd"] = new_psgd
        metrics = {"loss": loss, "grad_norm": optax.global_norm(grads), "lr": lr(state["step"])}
        if experts:  # core/experts.py: expert_records (the balance loss per row and layer); the balance bias moved
            metrics["expert_stats"] = expert_stats.at[-1].divide(batch.shape[0] * cfg.model.moe_layers)
            new["params"] = update_router_bias(new["params"], expert_stats, cfg.model)  # (a skipped step keeps it)
        if fp16:  # skip a step that overflowed (its parameters and optimizer state stay), adjust the scale
            ls, finite = state["loss_scale"], loss_scale.all_finite(grads)
            new["params"], new["opt_state"] = loss_scale.keep_if(finite, (new["params"], opt_state),
                                                                 (params, state["opt_state"]))
            new["loss_scale"] = loss_scale.update(ls, finite, cfg)
            metrics.update(lr=lr(state["step"] - ls["skipped"]),  # the schedule counts applied updates
                           loss_scale=scale, skipped_steps=new["loss_scale"]["skipped"])
        return to_rest(layout, new), metrics

    def traced(state, batch):
        with use(context):
            return step(state, batch)

    return jax.jit(traced, in_shardings=(layout.state_shardings, layout.batch_sharding),
                   out_shardings=(layout.state_shardings, None), donate_argnums=0)


def compiled_train_step(layout: Layout, state, compiler_options: dict | None = None, shape=None):
    """The train step compiled ahead of time for `state` (arrays or shapes) and the layout's batch (or a batch of
    `shape`: one of train.batch_rampup's or a bucket's, core/batch_shapes.py)."""
    batch = jax.ShapeDtypeStruct(shape or layout.batch_shape, "int32", sharding=layout.batch_sharding)
    return make_train_step(layout).lower(state, batch).compile(compiler_options)


def build_step(cfg, sizes: dict[str, int], devices=None, abstract: bool = False, compiler_options=None):
    """(layout, state, compiled step) of a config on a mesh -- the one assembly the trainer's tools, the tests and
    the benchmarks share. `abstract`: the state as shapes only, nothing allocated (plan, gpu_check)."""
    layout = Layout(cfg, make_mesh(sizes, devices))
    state = abstract_state(layout) if abstract else init_state(layout)
    return layout, state, compiled_train_step(layout, state, compiler_options)


def to_device(layout: Layout, state: dict) -> dict:
    """The offloaded parts of the state (parallel.offload) moved into device memory, inside the jitted step."""
    return {k: jax.device_put(v, layout.device_shardings[k]) if k in layout.offloaded else v for k, v in state.items()}


def to_rest(layout: Layout, state: dict) -> dict:
    """...and back to host memory, where they stay between steps."""
    return {k: jax.device_put(v, layout.state_shardings[k]) if k in layout.offloaded else v for k, v in state.items()}


def make_eval_step(layout: Layout):
    graphdef, context, eod = abstract_model(layout.cfg.model)[0], parallel_context(layout), document_token(layout.cfg)

    def evaluate(params, batch):
        params = to_device(layout, {"params": params})["params"]
        with use(context):
            loss = _loss(layout, graphdef, eod, params, batch, balance=False)
            return (loss[0] if isinstance(loss, tuple) else loss) * token_share(batch)

    return jax.jit(evaluate, in_shardings=(layout.state_shardings["params"], layout.batch_sharding))
