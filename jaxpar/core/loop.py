"""The training loop, written once for both trainers: cadence (log, eval, checkpoint), stop signals,
the profiler window, throughput and MFU, metrics records and the fault-injection hooks.

Each framework supplies a `Framework` (its step, eval, save, and the few collectives the loop needs);
the loop itself imports neither jax nor torch.
"""
from __future__ import annotations

import signal
import sys
import time
from typing import Any, Protocol

from jaxpar.core.config import Config, profile_window
from jaxpar.core.faults import fault_hooks
from jaxpar.core.metrics_log import MetricsLog


class Framework(Protocol):
    fault_prefix: str  # <PREFIX>_FAULT_* environment variables (jaxpar/core/faults.py)

    def train_step(self, step: int) -> Any:
        """Start the update on the global batch of data step `step` (0-based); a handle on its metrics."""

    def agree_stop(self, requested: bool) -> bool:
        """Whether any process asked to stop; every process must get the same answer."""

    def fetch(self, handle: Any) -> dict:
        """The step's loss, grad_norm and lr as floats (waits for the step)."""

    def evaluate(self) -> float: ...

    def save(self, step: int) -> None:
        """Checkpoint the state after `step` (a no-op if that step is saved already)."""

    def memory_gib(self) -> float | None: ...

    def profile_start(self) -> None: ...

    def profile_stop(self) -> None: ...


def run_loop(cfg: Config, step: int, fw: Framework, log: MetricsLog, peak_flops_total: float | None,
             flops_per_token: float, extra: dict | None = None) -> int:
    """Train from data step `step` to train.steps or an agreed stop; returns the last completed step.
    `peak_flops_total`: the devices' summed peak (None: MFU not reported); `extra`: constant record fields."""
    t = cfg.train
    stop: dict = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _: stop.setdefault("signal", signum))
    window, profiling = profile_window(t.profile_steps), False
    mark, mark_step = time.perf_counter(), step
    while step < t.steps:
        if fw.agree_stop("signal" in stop):  # asked on any process: all stop after the same step
            fw.save(step)
            print(f"stopped by signal {stop.get('signal', '(on another process)')} after step {step}; "
                  "checkpoint saved", file=sys.stderr)
            break
        if window and step == window[0]:
            fw.profile_start()
            profiling = True
        handle = fw.train_step(step)
        step += 1
        last = step == t.steps
        do_eval = last or (t.eval_every and step % t.eval_every == 0)
        logged = step % t.log_every == 0 or do_eval
        if logged:
            now = time.perf_counter()
            tps = (step - mark_step) * t.global_batch_size * cfg.data.seq_len / (now - mark)
            record = {"step": step, **fw.fetch(handle), "tokens_per_sec": tps,
                      "step_time_s": (now - mark) / (step - mark_step),
                      "mfu": tps * flops_per_token / peak_flops_total if peak_flops_total else None,
                      "memory_gib": fw.memory_gib(), **(extra or {})}
            if do_eval:
                record["eval_loss"] = fw.evaluate()
            log.log(record)
        if last or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
            fw.save(step)
        if logged:  # throughput covers training steps only, not evaluation or checkpoint saves
            mark, mark_step = time.perf_counter(), step
        if profiling and step == window[1]:
            fw.profile_stop()
            profiling = False
        fault_hooks(fw.fault_prefix, step)  # test hooks
    if profiling:  # stopped inside the window (signal, or the window ends after train.steps)
        fw.profile_stop()
    return step
