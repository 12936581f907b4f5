"""python -m jaxpar.train --config configs/gpt2-tiny.yaml --mesh dp=2,tp=4 [section.key=value ...]"""
from __future__ import annotations

if __name__ == "__main__":  # before jax is imported: glibc reads its malloc tunables at process start
    from jaxpar.core.malloc import relaunch_with_huge_pages
    relaunch_with_huge_pages("jaxpar.train")

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jaxpar import state as st
from jaxpar.checkpoint import Checkpointer
from jaxpar.core.config import Config, load_config
from jaxpar.core.contract import Run, check_contract
from jaxpar.core.data_order import open_splits
from jaxpar.core.errors import UserError, cli
from jaxpar.core.flops import flops_per_token, peak_flops
from jaxpar.core.loop import ignore_stop_requests, run_loop, sample_lengths, stop_requests
from jaxpar.core.mesh_spec import format_mesh, parse_mesh
from jaxpar.core.metrics_log import MetricsLog
from jaxpar.core.peers import roll_call
from jaxpar.core.prefetch import Prefetch
from jaxpar.core.pipeline_schedules import configured_bubble, resolve_microbatches
from jaxpar.core.resume import already_complete, check_resume, start_anew, write_run_config
from jaxpar.core.trackers import check_trackers, open_trackers
from jaxpar.core.weights import flatten, load_weights, save_weights, unflatten
from jaxpar.context import use
from jaxpar.data import device_batch, grain_batches
from jaxpar.decode import make_generate
from jaxpar.layout import Layout
from jaxpar.mesh import device_memory, make_mesh, setup_devices
from jaxpar.models.gpt import abstract_model
from jaxpar.parallelize import parallel_context
from jaxpar.step import make_eval_step, make_train_step


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m jaxpar.train", description=__doc__)
    p.add_argument("--config", help="YAML config (configs/*.yaml); built-in defaults if omitted")
    p.add_argument("--mesh", help="mesh axes, e.g. dp=2,fsdp=2,tp=2 (overrides parallel.mesh)")
    p.add_argument("--write-init", metavar="PATH",
                   help="write the initial weights (shared safetensors format) to PATH and exit")
    p.add_argument("--write-final", metavar="PATH",
                   help="after training, also write the final weights (shared safetensors format) to PATH")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    return p.parse_intermixed_args(argv)


class JaxFramework:
    """What the shared loop (jaxpar/core/loop.py) needs from jax: the compiled steps, data, checkpoints."""
    fault_prefix = "JAXPAR"

    def __init__(self, cfg: Config, data, layout, state, ckpt):
        self.cfg, self.layout, self.state, self.ckpt = cfg, layout, state, ckpt
        self.train_data, self.val_data = data
        batch = jax.ShapeDtypeStruct(layout.batch_shape, "int32", sharding=layout.batch_sharding)
        self._train_step = make_train_step(layout).lower(state, batch).compile()
        self._eval_step = make_eval_step(layout)
        self._generate = None  # train.sample_every's decoder, made on first use
        self._overflow_step = None  # the test hook's step (<PREFIX>_FAULT_OVERFLOW_AT_STEP)
        self.prefetch = Prefetch(lambda step: device_batch(self.train_data, step, layout.batch_sharding))

    def batch(self, step: int, data=None):
        """A training batch (the next one is read ahead), or one of `data` (evaluation)."""
        return self.prefetch(step) if data is None else device_batch(data, step, self.layout.batch_sharding)

    def train_step(self, batch):
        step_fn, self._overflow_step = self._overflow_step or self._train_step, None
        self.state, metrics = step_fn(self.state, batch)
        return metrics

    def inject_overflow(self) -> None:
        self._overflow_step = make_train_step(self.layout, inject_overflow=True)  # compiled for this one step

    def agree_stop(self, requested: bool) -> bool:
        """Every process learns whether any was signalled, before the same step: a tiny all-gather of one
        flag per process (nothing to agree on with one process)."""
        if jax.process_count() == 1:
            return requested
        return bool(multihost_utils.process_allgather(np.array([requested], np.int32)).max())

    @property
    def process_count(self) -> int:
        return jax.process_count()

    def roll_call(self, wait_s: float) -> list[int]:
        """Each process writes its key in the coordination service's store; the missing ones after `wait_s`
        (every process but this one if the service, hosted by process 0, is gone)."""
        from jax._src.distributed import global_state  # the service's key-value store has no public handle

        client, me = global_state.client, jax.process_index()
        return roll_call(lambda: client.key_value_set(f"jaxpar/present/{me}", "1"),
                         lambda: {int(k.rsplit("/", 1)[1]) for k, _ in client.key_value_dir_get("jaxpar/present/")},
                         me, jax.process_count(), wait_s)

    def sample(self, step: int) -> list[int] | None:
        """Every process decodes (the parameters are sharded); process 0 returns the tokens."""
        prompt_len, new = sample_lengths(self.cfg.model.max_seq_len)
        prompt = jnp.asarray(self.val_data.rows(0, 0, 1)[:, :prompt_len], jnp.int32)
        self._generate = self._generate or make_generate(abstract_model(self.cfg.model)[0])  # compiled once
        with use(parallel_context(self.layout)):
            params = jax.device_put(self.state["params"], self.layout.device_shardings["params"])  # if offloaded
            out = self._generate(params, prompt, jax.random.key(step), new_tokens=new, temperature=0.8,
                                 top_k=40)
        out = multihost_utils.process_allgather(out, tiled=True)
        return prompt[0].tolist() + out[0].tolist() if jax.process_index() == 0 else None

    def fetch(self, metrics) -> dict:
        return {k: float(v) for k, v in jax.device_get(metrics).items()}

    def evaluate(self, batches: int) -> float:
        losses = [self._eval_step(self.state["params"], self.batch(i, self.val_data)) for i in range(batches)]
        return float(sum(jax.device_get(losses)) / len(losses))

    def save(self, step: int) -> None:
        self.ckpt.save(step, self.state, {"step": step, "data_step": step,
                                          "mesh": format_mesh(dict(self.layout.mesh.shape))})

    def settle(self) -> None:
        self.ckpt.wait()

    def memory(self) -> dict:
        return device_memory(jax.local_devices()[0])

    def profile_start(self) -> None:
        jax.profiler.start_trace(os.path.join(self.cfg.run.dir, "profile"))

    def profile_stop(self) -> None:
        jax.profiler.stop_trace()

    def poison(self) -> None:
        nan = lambda x: jax.device_put(x * float("nan"), x.sharding)  # noqa: E731
        self.state = {**self.state, "params": jax.tree.map(nan, self.state["params"])}


def write_weights(path: str, params, which: str, cfg: Config) -> None:
    """Gather the parameters (every process takes part) and write the shared file from process 0."""
    params = multihost_utils.process_allgather(params, tiled=True)
    if jax.process_index() == 0:
        save_weights(path, params, vars(cfg.model))
        print(f"wrote {which} weights to {path}", file=sys.stderr)


def initial_state(cfg: Config, layout, ckpt):
    """The latest checkpoint in run.dir, else model.init_from, else a random init."""
    abstract = st.abstract_state(layout)
    restored = ckpt.restore_latest(abstract) if cfg.checkpoint.resume else None
    if restored:
        print(f"resumed from {ckpt.dir}/{restored[1]['step']}", file=sys.stderr)
        return restored[0]
    if cfg.model.init_from:
        shapes = {k: v.shape for k, v in flatten(abstract["params"]).items()}
        return st.state_from_params(layout, unflatten(load_weights(cfg.model.init_from, shapes)))
    return st.init_state(layout)


def pipeline_bubble(cfg: Config, stages: int) -> float | None:
    """The schedule table's idle fraction; printed once and reported in every metrics record."""
    p = cfg.parallel
    bubble = configured_bubble(p.pipeline_schedule, stages, p.pipeline_microbatches, p.pipeline_virtual_stages)
    if bubble is None:
        return None
    M = resolve_microbatches(stages, p.pipeline_microbatches)
    print(f"pipeline {p.pipeline_schedule}: {stages} stages x {p.pipeline_virtual_stages} virtual, "
          f"{M} microbatches, bubble {bubble:.3f}", flush=True)
    return bubble


def show_library_logs() -> None:
    """run.debug: jax's and orbax's (absl's) logs at INFO on stderr; otherwise warnings and up only."""
    from absl import logging as absl_logging

    jax.config.update("jax_logging_level", "INFO")
    absl_logging.set_verbosity(absl_logging.INFO)


def train(cfg: Config, mesh_spec: str, write_init: str | None = None, write_final: str | None = None) -> int:
    sizes = parse_mesh(mesh_spec)
    check_resume(cfg)
    check_trackers(cfg)
    if cfg.run.debug:
        show_library_logs()
    setup_devices(sizes, cfg.run.peer_timeout_s)
    stop = stop_requests()  # after jax.distributed, whose preemption notifier would take SIGTERM otherwise
    if cfg.train.matmul_precision != "default":
        jax.config.update("jax_default_matmul_precision", cfg.train.matmul_precision)
    mesh = make_mesh(sizes)
    check_contract(Run(cfg, "jaxpar", mesh=dict(mesh.shape)))
    main_proc = jax.process_index() == 0
    data = open_splits(cfg, grain_batches)
    layout = Layout(cfg, mesh)
    start_anew(cfg, main_proc and not write_init)  # after the refusals above: a refused run moves nothing
    if jax.process_count() > 1:  # no process touches run.dir before the main one has moved an old run aside
        multihost_utils.sync_global_devices("jaxpar/start_anew")
    os.makedirs(cfg.run.dir, exist_ok=True)
    ckpt = Checkpointer(cfg.run.dir, cfg.checkpoint.keep, trainer=True)
    try:
        state = initial_state(cfg, layout, ckpt)
        if write_init:
            write_weights(write_init, state["params"], "initial", cfg)
            return 0
        if main_proc:
            write_run_config(cfg, resolved_mesh=format_mesh(dict(mesh.shape)))
        if not already_complete(cfg, int(state["step"]), main_proc):
            state = fit(cfg, data, layout, state, ckpt, stop)
        if write_final:
            write_weights(write_final, state["params"], "final", cfg)
    finally:
        ckpt.close()  # the save in flight completes, also when training stopped on an error
    ignore_stop_requests()
    return 0


def fit(cfg: Config, data, layout, state, ckpt, stop: dict):
    """Compile the step, then the shared loop; the state it ends with."""
    main_proc, mesh = jax.process_index() == 0, layout.mesh
    t0 = time.perf_counter()
    fw = JaxFramework(cfg, data, layout, state, ckpt)
    if main_proc:
        print(f"mesh {format_mesh(dict(mesh.shape))} on {jax.device_count()} {jax.devices()[0].platform} devices; "
              f"{sum(x.size for x in jax.tree.leaves(state['params'])):,} params; compiled in "
              f"{time.perf_counter() - t0:.1f}s", flush=True)
    bubble = pipeline_bubble(cfg, mesh.shape["pp"]) if main_proc else None
    peak = peak_flops(jax.devices()[0].device_kind, cfg.model.compute_dtype)
    log = MetricsLog(cfg.run.dir, main_proc, cfg.train.steps, int(state["step"]), open_trackers(cfg, main_proc),
                     cfg.data.tokenizer)
    run_loop(cfg, int(state["step"]), fw, log, peak * jax.device_count() if peak else None,
             flops_per_token(cfg.model, cfg.data.seq_len), stop, {"pipeline_bubble": bubble})
    fw.prefetch.close()
    log.close()
    return fw.state


@cli
def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    cfg = load_config(args.config, args.overrides)
    return train(cfg, args.mesh or cfg.parallel.mesh, args.write_init, args.write_final)


if __name__ == "__main__":
    sys.exit(main())
