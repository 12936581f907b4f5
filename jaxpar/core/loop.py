"""The training loop, written once for both trainers: cadence (log, eval, checkpoint), stop signals,
metrics records with throughput and MFU, the non-finite guard, lost peers (peers.py); and its hooks,
each owning its cadence: the profiler window, the test faults (faults.py).

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

from jaxpar.core.batch_shapes import batch_shapes
from jaxpar.core.config import Config
from jaxpar.core.config_checks import profile_window
from jaxpar.core.errors import UserError
from jaxpar.core.faults import FaultInjector
from jaxpar.core.flops import flops_per_token as flops_at
from jaxpar.core.metrics_log import MetricsLog
from jaxpar.core.peers import PeerGuard
from jaxpar.core.rampup import BatchSizes


class Framework(Protocol):
    fault_prefix: str  # <PREFIX>_FAULT_* environment variables (jaxpar/core/faults.py)
    process_count: int
    train_data: Any  # the training GlobalBatches (jaxpar/core/data_order.py)

    def roll_call(self, wait_s: float) -> list[int]:
        """Announce this process in the launcher's store; the processes that did not within `wait_s`."""

    def train_step(self, step: int) -> Any:
        """Start the update on the global batch of data step `step` (0-based; read ahead); a handle on its
        metrics."""

    def data_wait_s(self) -> float:
        """Seconds spent so far waiting for training batches (the read-ahead was not ready)."""

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
        """Test fault (<PREFIX>_FAULT_NAN_AT_STEP, called by faults.FaultInjector): make the parameters non-finite."""

    def inject_overflow(self) -> None:
        """Test fault (<PREFIX>_FAULT_OVERFLOW_AT_STEP): make the next step's gradients non-finite."""

    def close(self) -> None:
        """The loop is over (also on an error): stop reading ahead."""


class Hook(Protocol):
    """Something the loop runs around every step; it decides itself on which steps it acts."""

    def before_step(self, step: int) -> None:
        """Data step `step` (0-based) is about to run."""

    def after_step(self, step: int) -> None:
        """Step `step` (1-based, the completed count) ran, with its log, sample and checkpoint."""

    def close(self) -> None:
        """The loop ended, at train.steps, on a stop or on an error."""


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


class Profiler:
    """train.profile_steps=a:b: the framework's profiler runs from before step a to after step b."""

    def __init__(self, fw: Framework, window: tuple[int, int]):
        self.fw, self.window, self.on = fw, window, False

    def before_step(self, step: int) -> None:
        if step == self.window[0]:
            self.fw.profile_start()
            self.on = True

    def after_step(self, step: int) -> None:
        if self.on and step == self.window[1]:
            self.close()

    def close(self) -> None:  # also when the loop stopped inside the window
        if self.on:
            self.fw.profile_stop()
            self.on = False


class Throughput:
    """Tokens per second, step time, MFU and the share of time spent waiting for data, over the training
    steps since the last record (evaluation, samples and saves are not counted)."""

    def __init__(self, cfg: Config, flops_per_token: float, peak_flops_total: float | None, data=None):
        """`data`: the training GlobalBatches (or buckets.py's), whose steps' shapes and padding are counted."""
        sizes = BatchSizes.of(cfg)
        self.tokens = data.tokens if data is not None else lambda k: sizes.size(k) * cfg.data.seq_len
        self.rows = data.batch_size if data is not None else sizes.size
        self.padding = data.padding if data is not None and data.masked else None
        self.varies, self.peak = len(batch_shapes(cfg)) > 1, peak_flops_total
        if data is not None and cfg.data.batching == "buckets":  # attention's FLOPs grow with each bucket's length
            per_token = {T: flops_at(cfg.model, T) for _, T in batch_shapes(cfg)}
            self.flops = lambda k: self.tokens(k) * per_token[data.shape(k)[1] - 1]
        else:
            self.flops = lambda k: self.tokens(k) * flops_per_token

    def restart(self, step: int, data_wait_s: float) -> None:
        self.mark, self.step, self.waited = time.perf_counter(), step, data_wait_s

    def record(self, step: int, data_wait_s: float) -> dict:
        elapsed, steps = time.perf_counter() - self.mark, range(self.step, step)
        tokens = sum(map(self.tokens, steps))
        extra = {"batch_size": self.rows(step - 1)} if self.varies else {}  # the last step's
        if self.padding is not None:  # padded rows: tokens/s and MFU count the real tokens alone
            extra["padding_share"] = sum(map(self.padding, steps)) / (tokens + sum(map(self.rows, steps)))
        real = 1 - extra.get("padding_share", 0.0)
        flops = sum(map(self.flops, steps)) * real / elapsed
        return {**extra, "tokens_per_sec": tokens * real / elapsed, "step_time_s": elapsed / (step - self.step),
                "mfu": flops / self.peak if self.peak else None,
                "data_wait_share": (data_wait_s - self.waited) / elapsed}


def hooks_of(cfg: Config, fw: Framework) -> list[Hook]:
    window = profile_window(cfg.train.profile_steps)
    return [h for h in (Profiler(fw, window) if window else None, FaultInjector.from_env(fw)) if h]


def run_loop(cfg: Config, step: int, fw: Framework, log: MetricsLog, peak_flops_total: float | None,
             flops_per_token: float, stop: dict, extra: dict | None = None, data=None) -> int:
    """Train from data step `step` to train.steps or an agreed stop; returns the last completed step.
    `peak_flops_total`: the devices' summed peak (None: MFU not reported); `stop`: from `stop_requests()`;
    `extra`: constant record fields; `data`: the training GlobalBatches (padding_share, with a loss mask)."""
    t, min_scale, hooks = cfg.train, cfg.optim.loss_scale_min, hooks_of(cfg, fw)
    meter = Throughput(cfg, flops_per_token, peak_flops_total, data)
    meter.restart(step, fw.data_wait_s())
    pending, saved = [], None  # steps whose metrics are not read yet (read at log and save points only)
    try:
        with PeerGuard(fw, cfg.run.peer_timeout_s, cfg.run.dir, step) as peers:
            while step < t.steps:
                peers.beat(step)
                if fw.agree_stop("signal" in stop):  # asked on any process: all stop after the same step
                    read_finite(fw, pending, saved, min_scale)
                    fw.save(step)
                    print(f"stopped by signal {stop.get('signal', '(on another process)')} after step {step}; "
                          "checkpoint saved", file=sys.stderr)
                    break
                for hook in hooks:
                    hook.before_step(step)
                pending.append((step + 1, fw.train_step(step)))
                step += 1
                last = step == t.steps
                evaluated = last or (t.eval_every and step % t.eval_every == 0)
                logged = step % t.log_every == 0 or evaluated
                save = last or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0)
                metrics = read_finite(fw, pending, saved, min_scale) if logged or save else None
                if logged:
                    record = {"step": step, **metrics, **meter.record(step, fw.data_wait_s()), **fw.memory(), **(extra or {})}
                    log.log({**record, "eval_loss": fw.evaluate(t.eval_batches)} if evaluated else record)
                sampled = t.sample_every and step % t.sample_every == 0
                if sampled:
                    log.sample(step, fw.sample(step))
                if save:
                    fw.save(step)
                    saved = peers.saved = step
                if logged or sampled:
                    meter.restart(step, fw.data_wait_s())
                for hook in hooks:
                    hook.after_step(step)
    finally:
        for hook in hooks:
            hook.close()
    return step
