"""The training loop, written once for both trainers: cadence (log, eval, checkpoint), stop signals,
the profiler window, throughput and MFU, metrics records, the non-finite guard, lost peers (peers.py)
and the fault hooks.

Each framework supplies a `Framework` (its step, eval, save, and the few collectives the loop needs);
the loop itself imports neither jax nor torch.
"""
from __future__ import annotations

import math
import os
import signal
import sys
import time
from typing import Any, Protocol

from jaxpar.core.config import Config, profile_window
from jaxpar.core.errors import UserError
from jaxpar.core.faults import fault_hooks, fault_at_step
from jaxpar.core.metrics_log import MetricsLog
from jaxpar.core.peers import PeerGuard


class Framework(Protocol):
    fault_prefix: str  # <PREFIX>_FAULT_* environment variables (jaxpar/core/faults.py)
    process_count: int

    def roll_call(self, wait_s: float) -> list[int]:
        """Announce this process in the launcher's store; the processes that did not within `wait_s`."""

    def batch(self, step: int) -> Any:
        """The global batch of data step `step` (0-based), placed where the step reads it."""

    def train_step(self, batch: Any) -> Any:
        """Start the update on `batch`; a handle on its metrics."""

    def agree_stop(self, requested: bool) -> bool:
        """Whether any process asked to stop; every process must get the same answer."""

    def fetch(self, handle: Any) -> dict:
        """The step's loss, grad_norm and lr as floats (waits for the step)."""

    def evaluate(self, batches: int) -> float:
        """The mean loss over the first `batches` validation batches."""

    def sample(self, step: int) -> list[int] | None:
        """train.sample_every: a prompt from the validation data and a sampled continuation (token ids, on
        process 0; None elsewhere)."""

    def save(self, step: int) -> None:
        """Checkpoint the state after `step` (a no-op if that step is saved already); may return before the
        checkpoint is complete on disk (jaxpar's saves are asynchronous)."""

    def settle(self) -> None:
        """Wait until the checkpoints started so far are complete."""

    def memory(self) -> dict:
        """{"memory_in_use_gib", "memory_gib" (the peak)} on this process's first device; None where unknown."""

    def profile_start(self) -> None: ...

    def profile_stop(self) -> None: ...

    def poison(self) -> None:
        """Test hook (<PREFIX>_FAULT_NAN_AT_STEP): make the parameters non-finite."""

    def inject_overflow(self) -> None:
        """Test hook (<PREFIX>_FAULT_OVERFLOW_AT_STEP): make the next step's gradients non-finite."""


def read_finite(fw: Framework, pending: list, saved: int | None, min_scale: float) -> dict:
    """Read the metrics of the steps run since the last read, oldest first; returns the newest. The first
    non-finite loss or gradient norm ends training there, before anything later is saved -- except under
    float16 loss scaling, where such a step was skipped and the scale reduced, until the scale is at its
    minimum (`min_scale`)."""
    m: dict = {}
    for step, handle in pending:
        m = fw.fetch(handle)
        skipped = m.get("loss_scale", 0.0) > min_scale  # float16: the update was skipped, the scale backed off
        if not (math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])) and not skipped:
            kept = f"the last checkpoint this run wrote is step {saved}" if saved else "this run wrote no checkpoint"
            at_min = f" at the minimum loss scale {min_scale:g}" if "loss_scale" in m else ""
            raise UserError(f"step {step}: loss {m['loss']}, grad_norm {m['grad_norm']} is not finite{at_min}; "
                            f"training stopped and nothing from step {step} on was saved ({kept})")
    pending.clear()
    return m


def stop_requests() -> dict:
    """From now on SIGTERM / SIGINT only ask for a stop (the dict gains "signal"): trainers call this early,
    so that a signal during start-up also ends in an agreed stop at the first step. A second signal ends
    the process at once, as if there were no handler."""
    stop: dict = {}

    def ask(signum, _frame) -> None:
        if "signal" in stop:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        stop["signal"] = signum
        print(f"signal {signum}: stopping after this step with a checkpoint (again: stop now)", file=sys.stderr,
              flush=True)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, ask)
    return stop


def ignore_stop_requests() -> None:
    """The run is over and saved: a late SIGTERM (a scheduler signals every process, at different moments)
    must not turn this process's clean exit into a kill."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


SAMPLE_PROMPT, SAMPLE_NEW = 16, 48  # train.sample_every: prompt and continuation lengths (tokens, at most)


def sample_lengths(max_seq_len: int) -> tuple[int, int]:
    """(prompt, new tokens) of a training-time sample that fits the model's context."""
    prompt = min(SAMPLE_PROMPT, max_seq_len // 2)
    return prompt, min(SAMPLE_NEW, max_seq_len - prompt)


def run_loop(cfg: Config, step: int, fw: Framework, log: MetricsLog, peak_flops_total: float | None,
             flops_per_token: float, stop: dict, extra: dict | None = None) -> int:
    """Train from data step `step` to train.steps or an agreed stop; returns the last completed step.
    `peak_flops_total`: the devices' summed peak (None: MFU not reported); `stop`: from `stop_requests()`;
    `extra`: constant record fields."""
    t = cfg.train
    window, profiling = profile_window(t.profile_steps), False
    mark, mark_step, poison_at = time.perf_counter(), step, fault_at_step(fw.fault_prefix, "NAN")
    overflow_at, min_scale = fault_at_step(fw.fault_prefix, "OVERFLOW"), cfg.optim.loss_scale_min
    pending, saved = [], None  # steps whose metrics are not read yet (read at log and save points only)
    data_s = 0.0  # host time spent getting batches since the last log (the rest: the device, or waiting on it)
    with PeerGuard(fw, cfg.run.peer_timeout_s, cfg.run.dir, step) as peers:
        while step < t.steps:
            peers.beat(step)
            if fw.agree_stop("signal" in stop):  # asked on any process: all stop after the same step
                read_finite(fw, pending, saved, min_scale)
                fw.save(step)
                print(f"stopped by signal {stop.get('signal', '(on another process)')} after step {step}; "
                      "checkpoint saved", file=sys.stderr)
                break
            if window and step == window[0]:
                fw.profile_start()
                profiling = True
            if poison_at == step + 1:
                fw.poison()
            if overflow_at == step + 1:
                fw.inject_overflow()
            t0 = time.perf_counter()
            batch = fw.batch(step)
            data_s += time.perf_counter() - t0
            pending.append((step + 1, fw.train_step(batch)))
            step += 1
            last = step == t.steps
            do_eval = last or (t.eval_every and step % t.eval_every == 0)
            logged = step % t.log_every == 0 or do_eval
            save = last or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0)
            metrics = read_finite(fw, pending, saved, min_scale) if logged or save else None
            if logged:
                now = time.perf_counter()
                tps = (step - mark_step) * t.global_batch_size * cfg.data.seq_len / (now - mark)
                record = {"step": step, **metrics, "tokens_per_sec": tps,
                          "step_time_s": (now - mark) / (step - mark_step),
                          "mfu": tps * flops_per_token / peak_flops_total if peak_flops_total else None,
                          "data_wait_share": data_s / (now - mark), **fw.memory(), **(extra or {})}
                if do_eval:
                    record["eval_loss"] = fw.evaluate(t.eval_batches)
                log.log(record)
            sampled = t.sample_every and step % t.sample_every == 0
            if sampled:
                log.sample(step, fw.sample(step))
            if save:
                fw.save(step)
                saved = peers.saved = step
            if logged or sampled:  # throughput covers training steps only, not evaluation, samples or saves
                mark, mark_step, data_s = time.perf_counter(), step, 0.0
            if profiling and step == window[1]:
                fw.profile_stop()
                profiling = False
            fault_hooks(fw.fault_prefix, step, fw.settle)  # test hooks
    if profiling:  # stopped inside the window (signal, or the window ends after train.steps)
        fw.profile_stop()
    return step
