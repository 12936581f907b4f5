"""jaxpar's adapter for the shared run (jaxpar/core/run/loop.py, the `Trainer` it drives) and its collaborators.

Restore or initialise the state, compile the train step, read batches ahead, evaluate, sample, save with orbax; the
collectives the run needs across processes, the measurements, the profiler and the test faults
(jaxpar/core/run/adapter.py).
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import nullcontext

import jax
from jax._src.distributed import global_state  # the coordination service's store has no public handle
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jaxpar import state as st
from jaxpar.checkpoint import Checkpointer
from jaxpar.comm import CommTrace
from jaxpar.context import use
from jaxpar.core.config.schema import Config
from jaxpar.core.data.order import unmasked
from jaxpar.core.model.experts import expert_records
from jaxpar.core.model.flops import optimizer_phrase, params_phrase, peak_flops
from jaxpar.core.run.hooks import sample_lengths
from jaxpar.core.config.mesh_spec import format_mesh
from jaxpar.core.run.peers import roll_call
from jaxpar.core.pipeline.schedules import concrete, configured_bubble, resolve_microbatches
from jaxpar.core.data.prefetch import Prefetch
from jaxpar.core.data.tokens import document_token
from jaxpar.core.weights.names import flatten, load_weights, save_weights, unflatten
from jaxpar.data import device_batch
from jaxpar.decode import make_generate
from jaxpar.layout import Layout
from jaxpar.mesh import device_memory
from jaxpar.models.decoder import abstract_model
from jaxpar.parallel import diloco
from jaxpar.parallelize import parallel_context
from jaxpar.scoring import JaxScorer
from jaxpar.step import compiled_train_step, make_eval_step, make_train_step


def any_process(flag: bool) -> bool:
    """Whether `flag` is true on any process.

    A tiny all-gather of one flag per process (nothing to agree on with one process).
    """
    if jax.process_count() == 1:
        return flag
    return bool(multihost_utils.process_allgather(np.array([flag], np.int32)).max())


class JaxTrainer:
    """The run on a Layout of (config, mesh): the state, its compiled steps by batch shape, the data, orbax saves."""

    processes: JaxProcesses
    probes: JaxProbes
    profiling: JaxProfiling
    faults: JaxFaults

    def __init__(self, cfg: Config, layout: Layout, data):
        self.cfg, self.layout = cfg, layout
        self.train_data, self.val_data = data
        self.is_main, self.process_count, self.rank = jax.process_index() == 0, jax.process_count(), jax.process_index()
        self.state, self.ckpt, self.prefetch = None, None, None
        self.processes, self.probes, self.profiling, self.faults = (
            JaxProcesses(),
            JaxProbes(self),
            JaxProfiling(self),
            JaxFaults(self),
        )

    # the run sequence
    def initial_state(self):
        """model.init_from, else the seed's random initialisation."""
        if not self.cfg.model.init_from:
            return st.init_state(self.layout)
        shapes = {k: v.shape for k, v in flatten(st.abstract_state(self.layout)["params"]).items()}
        return st.state_from_params(self.layout, unflatten(load_weights(self.cfg.model.init_from, shapes)))

    def restore_or_init(self) -> int:
        self.ckpt = Checkpointer(self.cfg.run.dir, self.cfg.checkpoint.keep, trainer=True)
        restored = st.restore_latest(self.ckpt, self.layout) if self.cfg.checkpoint.resume else None
        if restored:
            print(f"resumed from {self.ckpt.dir}/{restored[1]['step']}", file=sys.stderr)
        self.state = restored[0] if restored else self.initial_state()
        return int(self.state["step"])

    def run_config(self) -> dict:
        return {"framework": "jaxpar", "resolved_mesh": format_mesh(dict(self.layout.mesh.shape))}

    def start(self) -> str:
        """Compile the step for the next batch's shape and start reading ahead.

        train.batch_rampup's and the buckets' other shapes are compiled at their first step.
        """
        t0, layout = time.perf_counter(), self.layout
        first = self.train_data.shape(int(jax.device_get(self.state["step"])))
        self._train_steps = {(first, None): compiled_train_step(layout, self.state, shape=first)}  # by shape, carry
        self._eval_step = make_eval_step(layout)
        self._meet = diloco.Meetings(layout) if layout.group is not None else None  # DiLoCo's groups meet
        self._generate = None  # train.sample_every's decoder, made on first use
        self._task_model = None  # train.eval_tasks' lm-eval model, made on first use
        self.overflow_step = False  # the test fault's step next (<PREFIX>_FAULT_OVERFLOW_AT_STEP: JaxFaults)
        self.prefetch = Prefetch(lambda step: device_batch(self.train_data, step, layout.batch_sharding))
        return self.describe(time.perf_counter() - t0)

    def describe(self, compile_s: float) -> str:
        n = sum(x.size for x in jax.tree.leaves(self.state["params"]))
        line = (
            f"mesh {format_mesh(dict(self.layout.mesh.shape))} on {jax.device_count()} "
            f"{jax.devices()[0].platform} devices; {params_phrase(self.cfg.model, n)}; "
            f"{optimizer_phrase(self.cfg.optim.name, self._optimizer_bytes(), 'device')}; "
            f"compiled in {compile_s:.1f}s"
        )
        if self.layout.group is not None:
            n, o = diloco.groups(self.layout.mesh), self.cfg.optim
            line += (
                f"\nDiLoCo: {n} groups of {jax.device_count() // n} device{'s' * (jax.device_count() > n)}, meeting "
                "after every "
                f"{self.cfg.parallel.diloco_inner_steps} steps (outer SGD lr {o.outer_lr}, momentum {o.outer_momentum}"
                f"{', Nesterov' if o.outer_nesterov and o.outer_momentum else ''})"
                + (f" in {F} staggered fragments" if (F := self.cfg.parallel.diloco_fragments) > 1 else "")
                + (f", each exchange behind {d} inner steps" if (d := self.cfg.parallel.diloco_delay) else "")
            )
        bubble, p = self.probes.record_extra()["pipeline_bubble"], self.cfg.parallel
        if bubble is not None:
            line += (
                f"\npipeline {concrete(p.pipeline_schedule)}: {self.layout.mesh.shape['pp']} stages x "
                f"{p.pipeline_virtual_stages} virtual, "
                f"{resolve_microbatches(self.layout.mesh.shape['pp'], p.pipeline_microbatches)} microbatches, "
                f"bubble {bubble:.3f}"
            )
        return line

    def _optimizer_bytes(self) -> list[int]:
        """The optimizer state's bytes on each of this process's devices (in host memory under parallel.offload)."""
        held = dict.fromkeys(jax.local_devices(), 0)
        for x in jax.tree.leaves(self.state["opt_state"]):
            for shard in x.addressable_shards:
                held[shard.device] += shard.data.nbytes
        return list(held.values())

    def write_weights(self, path: str, which: str) -> None:
        """Gather the parameters (every process takes part) and write the shared file from process 0."""
        params = multihost_utils.process_allgather(self.state["params"], tiled=True)
        if self.is_main:
            save_weights(path, params, vars(self.cfg.model))
            print(f"wrote {which} weights to {path}", file=sys.stderr)

    def close(self) -> None:
        if self.prefetch is not None:
            self.prefetch.close()
        if self.ckpt is not None:
            self.ckpt.close()  # the save in flight completes, also when training stopped on an error

    # the loop
    def step_for(self, shape: tuple[int, int], carry: int | None = None):
        """The step for a batch shape (train.batch_rampup's and the buckets' are compiled at their first step).

        `carry`: DiLoCo's fragment whose exchange the step carries (parallel/diloco.py), compiled at its first step.
        """
        if (shape, carry) not in self._train_steps:
            t0 = time.perf_counter()
            self._train_steps[shape, carry] = compiled_train_step(self.layout, self.state, shape=shape, carry=carry)
            if jax.process_index() == 0:
                what = (
                    f"batch {shape[0]} x {shape[1] - 1}"
                    if carry is None
                    else f"the step carrying fragment {carry}'s exchange"
                )
                print(f"{what}: compiled in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        return self._train_steps[shape, carry]

    def train_step(self, step: int):
        batch = self.prefetch(step)  # the next one is read ahead
        carry = self._meet.carry(self.state, step) if self._meet is not None else None  # DiLoCo's exchange in flight
        if self.overflow_step:  # the test fault: this one step's gradients overflow (JaxFaults.overflow)
            step_fn, self.overflow_step = make_train_step(self.layout, inject_overflow=True, carry=carry), False
        else:
            step_fn = self.step_for(tuple(batch.shape), carry)
        self.state, metrics = step_fn(self.state, batch)
        if self._meet is not None:  # the groups meet: their mean delta, the outer optimizer
            self.state = self._meet(self.state, step)
        return metrics

    def fetch(self, metrics) -> dict:
        if self.layout.group is not None:  # one value per DiLoCo group, sharded over the groups' processes
            metrics = diloco.mean_over_groups(multihost_utils.process_allgather(metrics, tiled=True))
        got = jax.device_get(metrics)
        stats = got.pop("expert_stats", None)
        records = {} if stats is None else expert_records(stats, self.cfg.model.moe_experts)
        return {**{k: float(v) for k, v in got.items()}, **records}

    # the hooks' work
    def evaluate(self, batches: int) -> float:
        params, sharding = self.state["params"], self.layout.batch_sharding
        losses = [self._eval_step(params, device_batch(self.val_data, i, sharding)) for i in range(batches)]
        return float(sum(jax.device_get(losses)) / len(losses))

    def sample(self, step: int) -> list[int] | None:
        """Every process decodes (the parameters are sharded); process 0 returns the tokens."""
        prompt_len, new = sample_lengths(self.cfg.model.max_seq_len)
        prompt = jnp.asarray(unmasked(self.val_data.rows(0, 0, 1)[:, :prompt_len]), jnp.int32)
        self._generate = self._generate or make_generate(
            abstract_model(self.cfg.model)[0],  # compiled once
            document_token(self.cfg),
        )
        with use(parallel_context(self.layout)):
            params = jax.device_put(self.state["params"], self.layout.device_shardings["params"])  # if offloaded
            out = self._generate(params, prompt, jax.random.key(step), new_tokens=new, temperature=0.8, top_k=40)
        out = multihost_utils.process_allgather(out, tiled=True)
        return prompt[0].tolist() + out[0].tolist() if jax.process_index() == 0 else None

    def task_model(self, batch_size: int):
        """Every process scores alike (the parameters are sharded); each is one process to lm-eval."""
        from jaxpar.core.evaluation.harness import ProjectLM  # deferred: lm-eval (~1 s), only with train.eval_tasks

        if self._task_model is None:  # kept: its compiled programs serve every evaluation of the run
            scorer = JaxScorer(self.layout, lambda: self.state["params"], batch_size)
            self._task_model = ProjectLM(scorer, self.cfg.data.tokenizer, batch_size)
        return self._task_model

    def synchronised(self):
        """Readers read state["params"], DiLoCo's synchronised parameters already."""
        return nullcontext()

    def save(self, step: int) -> None:
        self.ckpt.save(
            step, self.state, {"step": step, "data_step": step, "mesh": format_mesh(dict(self.layout.mesh.shape))}
        )


class JaxProcesses:
    """The process group's work (jaxpar/core/run/adapter.py's `Processes`): jax's multihost collectives and store."""

    def __init__(self):
        self.synced_s = 0.0

    def any_of(self, flag: bool) -> bool:
        """Whether `flag` is true on any process; the time spent here counts as `sync_wait_s`."""
        t0 = time.perf_counter()  # the loop agrees once per step: the time spent here is waiting for the others
        try:
            return any_process(flag)
        finally:
            self.synced_s += time.perf_counter() - t0

    def sync_wait_s(self) -> float:
        return self.synced_s

    def gather(self, values: list[float]) -> list[list[float]]:
        """Every process's `values` (a row each, by process index), on every process."""
        rows = multihost_utils.process_allgather(np.asarray(values, np.float64))
        return rows.reshape(jax.process_count(), -1).tolist()

    def roll_call(self, wait_s: float) -> list[int]:
        """The processes missing from the coordination service's store after `wait_s`.

        Each process writes its key there; every process but this one is missing if the service, hosted by process
        0, is gone.
        """
        client, me = global_state.client, jax.process_index()
        return roll_call(
            lambda: client.key_value_set(f"jaxpar/present/{me}", "1"),
            lambda: {int(k.rsplit("/", 1)[1]) for k, _ in client.key_value_dir_get("jaxpar/present/")},
            me,
            jax.process_count(),
            wait_s,
        )

    def rejoined_at(self) -> None:
        """Never: a jaxpar run is one SPMD program; a lost group is an elastic restart (docs/diloco.md)."""
        return None


class JaxProbes:
    """A JaxTrainer's measurements (`Probes`): peak FLOP/s, the pipeline bubble, the data wait, device memory."""

    def __init__(self, trainer: JaxTrainer):
        self.trainer = trainer

    def peak_flops(self) -> float | None:
        peak = peak_flops(jax.devices()[0].device_kind, self.trainer.cfg.model.compute_dtype)
        return peak * jax.device_count() if peak else None

    def record_extra(self) -> dict:
        """The pipeline schedule table's idle fraction (None without pp)."""
        p, pp = self.trainer.cfg.parallel, self.trainer.layout.mesh.shape["pp"]
        return {
            "pipeline_bubble": configured_bubble(
                p.pipeline_schedule, pp, p.pipeline_microbatches, p.pipeline_virtual_stages
            )
        }

    def data_wait_s(self) -> float:
        return self.trainer.prefetch.waited_s

    def memory(self) -> dict:
        return device_memory(jax.local_devices()[0])

    def device_utilization(self) -> float | None:
        return None  # jax exposes no device utilisation


class JaxProfiling:
    """jax.profiler for a JaxTrainer (`Profiling`): train.profile_steps's trace, the sampled step's collectives."""

    def __init__(self, trainer: JaxTrainer):
        self.trainer, self.comm = trainer, None

    def start(self) -> None:
        jax.profiler.start_trace(os.path.join(self.trainer.cfg.run.dir, "profile"))

    def stop(self) -> None:
        jax.profiler.stop_trace()

    def comm_axes(self) -> list[str]:
        return [a for a, n in self.trainer.layout.mesh.shape.items() if n > 1]

    def comm_start(self) -> None:
        self.comm = CommTrace()

    def comm_stop(self, step: int | None) -> dict[str, float]:
        """Seconds data step `step`'s collectives were in flight per axis (None: just stop)."""
        t = self.trainer
        compiled = None if step is None else t.step_for(t.train_data.shape(step))
        comm, self.comm = self.comm, None
        return comm.stop(compiled, t.layout.mesh)


class JaxFaults:
    """The test faults on a JaxTrainer's state (`Faults`: JAXPAR_FAULT_*, jaxpar/core/run/faults.py)."""

    prefix = "JAXPAR"

    def __init__(self, trainer: JaxTrainer):
        self.trainer = trainer

    def poison(self) -> None:
        """The parameters the next step reads made NaN: the synchronised ones, and under DiLoCo every group's."""
        t = self.trainer
        nan = lambda x: jax.device_put(x * float("nan"), x.sharding)
        t.state = {**t.state, "params": jax.tree.map(nan, t.state["params"])}
        if "diloco" in t.state:
            t.state["diloco"] = {**t.state["diloco"], "params": jax.tree.map(nan, t.state["diloco"]["params"])}

    def overflow(self) -> None:
        self.trainer.overflow_step = True  # the next step alone

    def settle(self) -> None:
        self.trainer.ckpt.wait()
