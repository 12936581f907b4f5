"""Train state (params, optimizer state, step), its shardings, and the jitted train/eval steps.

The state is a plain pytree: {"params": nested dict, "opt_state": optax state, "step": int32}.
Shardings come from the model's logical axes through the rules table; GSPMD inserts every
collective (gradient all-reduce, FSDP gathers, TP all-reduces) — nothing is hand-written here.
"""
from __future__ import annotations

import contextlib
from functools import partial

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.config import Config
from jaxpar.errors import UserError
from jaxpar.models.gpt import GPT, loss_fn
from jaxpar.optim import make_optimizer, schedule_fn
from jaxpar.parallel.pipeline import check_pipeline, resolve_microbatches, use_pipeline
from jaxpar.parallel.pipeline_executor import HAND_SCHEDULED, pipeline_value_and_grad
from jaxpar.parallel.sequence import check_sequence, use_sequence
from jaxpar.sharding import spec_for, use_rules, with_extra_axis


def abstract_model(cfg: Config):
    """(graphdef, {path: logical axes}, abstract params) without allocating anything."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: GPT(cfg.model, nnx.Rngs(0))), nnx.Param)
    axes: dict = {}
    for path, var in nnx.to_flat_state(state):
        axes[tuple(path)] = var.get_metadata()["logical_axes"]
    return graphdef, axes, state.to_pure_dict()


def _is_spec(x) -> bool:
    return isinstance(x, P)


def _path_keys(path) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", None))) for k in path)


def check_layout(cfg: Config, mesh) -> None:
    """Divisibility the sharded program needs, stated in the user's terms."""
    s, m, t = mesh.shape, cfg.model, cfg.train
    if m.n_head % s["tp"]:
        raise UserError(f"model.n_head={m.n_head} is not divisible by tp={s['tp']}")
    data_ways = s["dp"] * s["fsdp"]
    micro = t.global_batch_size // t.microbatches
    if micro % data_ways:
        raise UserError(f"batch per microbatch {micro} (train.global_batch_size={t.global_batch_size} / "
                        f"train.microbatches={t.microbatches}) is not divisible by the data axes dp*fsdp={data_ways}")
    p = cfg.parallel
    check_sequence(cfg.data.seq_len, m.n_head, s, p.sequence_attention, p.sequence_zigzag)
    check_pipeline(cfg, s)


class Layout:
    """Everything that depends on (config, mesh): shardings of state and batch."""

    def __init__(self, cfg: Config, mesh, rules):
        check_layout(cfg, mesh)
        self.cfg, self.mesh, self.rules = cfg, mesh, rules
        self.tx = make_optimizer(cfg)
        self.graphdef, self.axes, abstract_params = abstract_model(cfg)
        ns = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
        self.param_specs = jax.tree_util.tree_map_with_path(
            lambda p, x: spec_for(self.axes[_path_keys(p)], x.shape, mesh, rules), abstract_params)
        abstract_opt = jax.eval_shape(self.tx.init, abstract_params)
        opt_specs = jax.tree_util.tree_map_with_path(self._opt_spec, abstract_opt)
        self.state_shardings = {
            "params": jax.tree.map(ns, self.param_specs, is_leaf=_is_spec),
            "opt_state": jax.tree.map(ns, opt_specs, is_leaf=_is_spec),
            "step": ns(P()),
        }
        # ZeRO-2: gradients reduce-scattered to the optimizer-state layout instead of all-reduced.
        self.grad_specs = (jax.tree_util.tree_map_with_path(self._opt_spec, abstract_params)
                           if cfg.parallel.zero_stage >= 2 else self.param_specs)
        self.batch_sharding = ns(spec_for(("batch", None), (cfg.train.global_batch_size // cfg.train.microbatches, 1),
                                          mesh, rules))

    @contextlib.contextmanager
    def active(self):
        """What model code reads while tracing: sharding rules, sequence- and pipeline-parallel options."""
        p, stages = self.cfg.parallel, self.mesh.shape["pp"]
        with use_rules(self.mesh, self.rules), use_sequence(p.sequence_attention, p.sequence_zigzag), \
                use_pipeline(stages, resolve_microbatches(stages, p.pipeline_microbatches)):
            yield

    def _opt_spec(self, path, leaf) -> P:
        """Optimizer moments follow their parameter (matched by path suffix); ZeRO>=1 adds dp."""
        keys = _path_keys(path)
        for start in range(len(keys)):
            axes = self.axes.get(keys[start:])
            if axes is not None and len(axes) == len(leaf.shape):
                spec = spec_for(axes, leaf.shape, self.mesh, self.rules)
                if self.cfg.parallel.zero_stage >= 1:
                    spec = with_extra_axis(spec, leaf.shape, self.mesh, "dp")
                return spec
        return P()  # counters and other scalars: replicated


def init_state(layout: Layout):
    """Initialise directly into the target shardings (never materialised on one device)."""
    cfg = layout.cfg

    def create():
        params = nnx.state(GPT(cfg.model, nnx.Rngs(cfg.train.seed)), nnx.Param).to_pure_dict()
        return {"params": params, "opt_state": layout.tx.init(params), "step": jnp.zeros((), jnp.int32)}

    with layout.active():
        return jax.jit(create, out_shardings=layout.state_shardings)()


def state_from_params(layout: Layout, params):
    """A fresh state around given parameters (e.g. weights loaded with model.init_from)."""
    create = lambda p: {"params": p, "opt_state": layout.tx.init(p), "step": jnp.zeros((), jnp.int32)}  # noqa: E731
    return jax.jit(create, out_shardings=layout.state_shardings)(params)


def _loss(layout: Layout, params, batch):
    return loss_fn(nnx.merge(layout.graphdef, params), batch)


def _value_and_grad(layout: Layout):
    """jax.value_and_grad of the loss (GPipe over pp included: jax.grad through its ticks), or the
    hand-scheduled pipeline executor for 1F1B and interleaved schedules."""
    p = layout.cfg.parallel
    if layout.mesh.shape["pp"] == 1 or p.pipeline_schedule not in HAND_SCHEDULED:
        return jax.value_and_grad(partial(_loss, layout))
    return hand_scheduled(layout, p.pipeline_schedule)


def hand_scheduled(layout: Layout, schedule: str):
    """(params, batch) -> (loss, grads) on the pipeline executor running `schedule` over the layout's pp
    (any schedule: the memory benchmark also runs the GPipe order on it)."""
    p, S = layout.cfg.parallel, layout.mesh.shape["pp"]
    return partial(pipeline_value_and_grad, layout.graphdef, layout.cfg.model, mesh=layout.mesh, schedule=schedule,
                   S=S, M=resolve_microbatches(S, p.pipeline_microbatches), V=p.pipeline_virtual_stages)


def make_train_step(layout: Layout):
    cfg, M = layout.cfg, layout.cfg.train.microbatches
    lr = schedule_fn(cfg)

    def step(state, batch):
        params = state["params"]
        # Microbatch m takes rows m, m+M, m+2M, ...: each device keeps its own rows (no reshuffle).
        micro = batch.reshape(-1, M, batch.shape[-1]).swapaxes(0, 1)

        value_and_grad = _value_and_grad(layout)

        def accumulate(carry, mb):
            mb = jax.lax.with_sharding_constraint(mb, layout.batch_sharding)
            loss, grads = value_and_grad(params, mb)
            return jax.tree.map(jnp.add, carry, (loss, grads)), None

        zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
        (loss, grads), _ = jax.lax.scan(accumulate, zero, micro)
        loss, grads = loss / M, jax.tree.map(lambda g: g / M, grads)
        grads = jax.tree.map(lambda s, g: jax.lax.with_sharding_constraint(g, NamedSharding(layout.mesh, s)),
                             layout.grad_specs, grads, is_leaf=_is_spec)
        updates, opt_state = layout.tx.update(grads, state["opt_state"], params)
        new = {"params": optax.apply_updates(params, updates), "opt_state": opt_state, "step": state["step"] + 1}
        return new, {"loss": loss, "grad_norm": optax.global_norm(grads), "lr": lr(state["step"])}

    def traced(state, batch):
        with layout.active():
            return step(state, batch)

    return jax.jit(traced, in_shardings=(layout.state_shardings, layout.batch_sharding),
                   out_shardings=(layout.state_shardings, None), donate_argnums=0)


def device_batch(data, step: int, sharding, shape):
    """The global batch at `step` as a sharded array; this process reads only the rows it holds."""
    index_map = sharding.addressable_devices_indices_map(shape)
    lo = min(ix[0].start or 0 for ix in index_map.values())
    hi = max(ix[0].stop or shape[0] for ix in index_map.values())
    rows = data.rows(step, lo, hi)
    return jax.make_array_from_callback(
        shape, sharding, lambda ix: rows[(ix[0].start or 0) - lo:(ix[0].stop or shape[0]) - lo])


def make_eval_step(layout: Layout):
    def evaluate(params, batch):
        with layout.active():
            return _loss(layout, params, batch)

    return jax.jit(evaluate, in_shardings=(layout.state_shardings["params"], layout.batch_sharding))
