"""What the shared loop (jaxpar/core/loop.py) drives on the jax side: the compiled train step, the read-ahead
data, evaluation, sampling, orbax saves, and the collectives the loop needs across processes."""
from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jaxpar.context import use
from jaxpar.core.config import Config
from jaxpar.core.loop import sample_lengths
from jaxpar.core.experts import expert_records
from jaxpar.core.data_order import unmasked
from jaxpar.core.mesh_spec import format_mesh
from jaxpar.core.peers import roll_call
from jaxpar.core.prefetch import Prefetch
from jaxpar.data import device_batch
from jaxpar.decode import make_generate
from jaxpar.core.tokens import document_token
from jaxpar.mesh import device_memory
from jaxpar.models.decoder import abstract_model
from jaxpar.parallelize import parallel_context
from jaxpar.step import compiled_train_step, make_eval_step, make_train_step


def any_process(flag: bool) -> bool:
    """Whether `flag` is true on any process: a tiny all-gather of one flag per process (nothing to agree on
    with one process)."""
    if jax.process_count() == 1:
        return flag
    return bool(multihost_utils.process_allgather(np.array([flag], np.int32)).max())


class JaxFramework:
    """What the shared loop (jaxpar/core/loop.py) needs from jax: the compiled steps, data, checkpoints."""
    fault_prefix = "JAXPAR"

    def __init__(self, cfg: Config, data, layout, state, ckpt):
        self.cfg, self.layout, self.state, self.ckpt = cfg, layout, state, ckpt
        self.train_data, self.val_data = data
        first = self.train_data.shape(int(jax.device_get(state["step"])))  # the next step's (the describe line's)
        self._train_steps = {first: compiled_train_step(layout, state, shape=first)}  # by batch shape
        self._eval_step = make_eval_step(layout)
        self._generate = None  # train.sample_every's decoder, made on first use
        self._overflow_step = None  # the test hook's step (<PREFIX>_FAULT_OVERFLOW_AT_STEP)
        self.prefetch = Prefetch(lambda step: device_batch(self.train_data, step, layout.batch_sharding))

    def close(self) -> None:
        self.prefetch.close()

    def _compiled(self, shape: tuple[int, int]):
        """The step for a batch shape (train.batch_rampup's and the buckets' are compiled at their first step)."""
        if shape not in self._train_steps:
            t0 = time.perf_counter()
            self._train_steps[shape] = compiled_train_step(self.layout, self.state, shape=shape)
            if jax.process_index() == 0:
                print(f"batch {shape[0]} x {shape[1] - 1}: compiled in {time.perf_counter() - t0:.1f}s",
                      file=sys.stderr)
        return self._train_steps[shape]

    def train_step(self, step: int):
        batch = self.prefetch(step)  # the next one is read ahead
        step_fn, self._overflow_step = self._overflow_step or self._compiled(tuple(batch.shape)), None
        self.state, metrics = step_fn(self.state, batch)
        return metrics

    def data_wait_s(self) -> float:
        return self.prefetch.waited_s

    def inject_overflow(self) -> None:
        self._overflow_step = make_train_step(self.layout, inject_overflow=True)  # compiled for this one step

    def agree_stop(self, requested: bool) -> bool:
        """Every process learns whether any was signalled, before the same step."""
        return any_process(requested)

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
        prompt = jnp.asarray(unmasked(self.val_data.rows(0, 0, 1)[:, :prompt_len]), jnp.int32)
        self._generate = self._generate or make_generate(abstract_model(self.cfg.model)[0],  # compiled once
                                                         document_token(self.cfg))
        with use(parallel_context(self.layout)):
            params = jax.device_put(self.state["params"], self.layout.device_shardings["params"])  # if offloaded
            out = self._generate(params, prompt, jax.random.key(step), new_tokens=new, temperature=0.8,
                                 top_k=40)
        out = multihost_utils.process_allgather(out, tiled=True)
        return prompt[0].tolist() + out[0].tolist() if jax.process_index() == 0 else None

    def fetch(self, metrics) -> dict:
        got = jax.device_get(metrics)
        stats = got.pop("expert_stats", None)
        records = {} if stats is None else expert_records(stats, self.cfg.model.moe_experts)
        return {**{k: float(v) for k, v in got.items()}, **records}

    def evaluate(self, batches: int) -> float:
        losses = [self._eval_step(self.state["params"], device_batch(self.val_data, i, self.layout.batch_sharding)) for i in range(batches)]
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
