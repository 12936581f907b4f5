"""The shared loop's hooks (jaxpar/core/run/loop.py), each owning its cadence.

Evaluation, the metrics record, samples, checkpoints, the profiler window, the slowest process and the sampled step's
collectives (stragglers.py), and the test faults (faults.py). Also what they share for one step (`Progress`: the metrics
not read yet, the non-finite guard, the record, the throughput meter).

Nothing here imports jax or torch: a hook calls the trainer (the run's `Trainer` adapter) or its collaborators
(jaxpar/core/run/adapter.py) for the work.
"""

from __future__ import annotations

import math
import time

from jaxpar.core.data.batch_shapes import batch_shapes
from jaxpar.core.config.schema import Config
from jaxpar.core.config.consistency import profile_window
from jaxpar.core.errors import UserError
from jaxpar.core.run.faults import FaultInjector
from jaxpar.core.model.flops import flops_per_token as flops_at
from jaxpar.core.optimizer.torchft_mode import launch_groups
from jaxpar.core.run.metrics import MetricsLog
from jaxpar.core.data.rampup import BatchSizes
from jaxpar.core.run.stragglers import CommShare, Stragglers


class Hook:
    """Something the loop runs around every step; it decides itself on which steps it acts."""

    def before_step(self, step: int) -> None:
        """Data step `step` (0-based) is about to run."""

    def after_step(self, step: int) -> None:
        """Step `step` (1-based, the completed count) ran; the hooks before this one have acted."""

    def close(self) -> None:
        """The loop ended, at train.steps, on a stop or on an error."""


def read_finite(trainer, pending: list, saved: int | None, min_scale: float) -> dict:
    """Read the metrics of the steps run since the last read, oldest first; returns the newest.

    The first non-finite loss or gradient norm ends training there, before anything later is saved -- except under
    float16 loss scaling, where such a step was skipped and the scale reduced, until the scale is at its minimum
    (`min_scale`).
    """
    m: dict = {}
    for step, handle in pending:
        m = trainer.fetch(handle)
        skipped = m.get("loss_scale", 0.0) > min_scale  # float16: the update was skipped, the scale backed off
        if not (math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])) and not skipped:
            kept = f"the last checkpoint this run wrote is step {saved}" if saved else "this run wrote no checkpoint"
            at_min = f" at the minimum loss scale {min_scale:g}" if "loss_scale" in m else ""
            raise UserError(
                f"step {step}: loss {m['loss']}, grad_norm {m['grad_norm']} is not finite{at_min}; "
                f"training stopped and nothing from step {step} on was saved ({kept})"
            )
    pending.clear()
    return m


class Throughput:
    """Tokens per second, step time, MFU and the share of time spent waiting for data.

    Measured over the training steps since the last record (evaluation, samples and saves are not counted), on the
    tokens this launch trains.
    """

    def __init__(self, cfg: Config, flops_per_token: float, peak_flops_total: float | None, data=None):
        """`data`: the training GlobalBatches (or buckets.py's), whose steps' shapes and padding are counted."""
        sizes = BatchSizes.of(cfg)
        self.tokens = data.tokens if data is not None else lambda k: sizes.size(k) * cfg.data.seq_len
        self.rows = data.batch_size if data is not None else sizes.size
        self.padding = data.padding if data is not None and data.masked else None
        self.varies, self.peak = len(batch_shapes(cfg)) > 1, peak_flops_total
        # torchft's mode: this launch is one of the groups, and trains its group's block of each global batch alone
        # (cfg is the run's config, whose mesh names every group; the trainer's own has the diloco axis left out)
        self.share = 1 / launch_groups(cfg)[1][1] if cfg.parallel.torchft_lighthouse else 1.0
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
        real = (1 - extra.get("padding_share", 0.0)) * self.share
        flops = sum(map(self.flops, steps)) * real / elapsed
        return {
            **extra,
            "tokens_per_sec": tokens * real / elapsed,
            "step_time_s": elapsed / (step - self.step),
            "mfu": flops / self.peak if self.peak else None,
            "data_wait_share": (data_wait_s - self.waited) / elapsed,
        }


class Progress:
    """What the hooks of one loop share.

    The steps whose metrics are not read yet (read at log and save points only: reading waits for the step), the
    last checkpoint this run wrote, and the current step's record. Also the seconds spent in the trainer's step and
    in reading its metrics (`blocked`: with several processes, partly waiting for the others) and, with several
    processes, at the loop's agreement (`synced`), when the meter started.
    """

    def __init__(self, cfg: Config, trainer, step: int):
        self.trainer, self.min_scale, self.saved = trainer, cfg.optim.loss_scale_min, None
        self.pending, self.latest, self.current, self.busy = [], {}, None, False
        self.blocked, self.handed, self.ran = 0.0, None, step
        self.extra = trainer.probes.record_extra()
        self.meter = Throughput(
            cfg, flops_at(cfg.model, cfg.data.seq_len), trainer.probes.peak_flops(), trainer.train_data
        )
        self.restart(step)

    def restart(self, step: int) -> None:
        self.meter.restart(step, self.trainer.probes.data_wait_s())
        self.synced = self.trainer.processes.sync_wait_s() if self.trainer.process_count > 1 else 0.0
        self.blocked_mark = self.blocked

    def started(self, step: int, handle) -> None:
        """Step `step` (1-based) was started; `handle` fetches its metrics."""
        if self.handed is not None:  # StepClock: the trainer had the step since then
            self.blocked += time.perf_counter() - self.handed
        self.pending.append((step, handle))
        self.current, self.busy, self.handed, self.ran = None, False, None, step

    def metrics(self) -> dict:
        """The newest step's metrics, every step run so far checked to be finite."""
        if self.pending:
            t0 = time.perf_counter()
            self.latest = read_finite(self.trainer, self.pending, self.saved, self.min_scale)
            self.blocked += time.perf_counter() - t0
        return self.latest

    def record(self, step: int) -> dict:
        """The metrics record of step `step`, made once (its throughput up to now: before any evaluation)."""
        if self.current is None:
            probes = self.trainer.probes
            self.current = {
                "step": step,
                **self.metrics(),
                **self.meter.record(self.ran, probes.data_wait_s()),  # the steps run (torchft's heal jumps ahead)
                **probes.memory(),
                **self.extra,
            }
            self.busy = True
        return self.current

    def step_done(self, step: int) -> None:
        """Time spent on records and samples is not training time: the meter starts again after it (and a heal's)."""
        if self.busy or step != self.ran:
            self.restart(step)


def due(step: int, every: int, last: bool = False) -> bool:
    return last or bool(every and step % every == 0)


class Evaluate(Hook):
    """train.eval_every and the last step: the validation loss joins the step's record."""

    def __init__(self, cfg: Config, trainer, progress: Progress):
        self.t, self.trainer, self.progress = cfg.train, trainer, progress

    def after_step(self, step: int) -> None:
        if due(step, self.t.eval_every, step == self.t.steps):
            self.progress.record(step)["eval_loss"] = self.trainer.evaluate(self.t.eval_batches)


EVAL_TASKS_BATCH = 8  # train.eval_tasks: requests scored at once


class EvalTasks(Hook):
    """train.eval_tasks every train.eval_tasks_every steps and at the last: lm-eval's scores join the step's record.

    The trainers check the tasks before the run (check_eval_tasks); the results go to run.dir/evals/<step>.json, the
    scores to the record (eval/<task>/<metric>) and one line to the console. The trainer's `task_model` scores the live
    parameters.
    """

    def __init__(self, cfg: Config, trainer, log: MetricsLog, progress: Progress):
        from jaxpar.core.evaluation import cli, results, tasks  # deferred: lm-eval (~1 s), only with train.eval_tasks

        self.t, self.run_dir, self.trainer, self.log, self.progress = cfg.train, cfg.run.dir, trainer, log, progress
        self.cli, self.results = cli, results
        self.tasks = tasks.parse_tasks(cfg.train.eval_tasks, name="train.eval_tasks")  # checked by the trainers
        self.manager = tasks.task_manager(self.tasks)  # lm-eval's task index (~1 s), once for every evaluation

    def after_step(self, step: int) -> None:
        if not due(step, self.t.eval_tasks_every, step == self.t.steps):
            return
        t, record = self.t, self.progress.record(step)  # its throughput measured before the evaluation
        fewshot, limit = (None if t.eval_tasks_fewshot < 0 else t.eval_tasks_fewshot), (t.eval_tasks_limit or None)
        with self.trainer.synchronised():
            out = self.cli.run_tasks(
                self.trainer.task_model(EVAL_TASKS_BATCH), self.tasks, fewshot, limit, manager=self.manager
            )
        if out is None:  # a rank other than 0 under torchrun: rank 0 holds the gathered scores
            return
        scores = self.results.scores(out)
        record.update(scores)
        if self.trainer.is_main:
            path = self.results.evals_path(self.run_dir, step)
            self.results.save(path, step, out, {"framework": "training", "tasks": t.eval_tasks})
            shown = " | ".join(f"{k[len('eval/') :]} {v:.4g}" for k, v in scores.items())
            self.log.note(f"eval tasks at step {step}: {shown} ({path})")


class Log(Hook):
    """train.log_every, and every step that has a record already (an evaluated one).

    It writes to metrics.jsonl, the console and the trackers.
    """

    def __init__(self, cfg: Config, log: MetricsLog, progress: Progress):
        self.every, self.log, self.progress = cfg.train.log_every, log, progress

    def after_step(self, step: int) -> None:
        if due(step, self.every) or self.progress.current is not None:
            self.log.log(self.progress.record(step))


SAMPLE_PROMPT, SAMPLE_NEW = 16, 48  # train.sample_every: prompt and continuation lengths (tokens, at most)


def sample_lengths(max_seq_len: int) -> tuple[int, int]:
    """(prompt, new tokens) of a training-time sample that fits the model's context."""
    prompt = min(SAMPLE_PROMPT, max_seq_len // 2)
    return prompt, min(SAMPLE_NEW, max_seq_len - prompt)


class Sample(Hook):
    """train.sample_every: a prompt from the validation data and its continuation, in the log."""

    def __init__(self, cfg: Config, trainer, log: MetricsLog, progress: Progress):
        self.every, self.trainer, self.log, self.progress = cfg.train.sample_every, trainer, log, progress

    def after_step(self, step: int) -> None:
        if due(step, self.every):
            self.log.sample(step, self.trainer.sample(step))
            self.progress.busy = True


class Checkpoint(Hook):
    """checkpoint.every and the last step, once every step so far is known finite."""

    def __init__(self, cfg: Config, trainer, progress: Progress):
        self.every, self.steps, self.trainer, self.progress = cfg.checkpoint.every, cfg.train.steps, trainer, progress

    def after_step(self, step: int) -> None:
        if due(step, self.every, step == self.steps):
            self.progress.metrics()
            self.trainer.save(step)
            self.progress.saved = step


class Profiler(Hook):
    """train.profile_steps=a:b: the trainer's profiler (its `profiling`) runs from before step a to after step b."""

    def __init__(self, profiling, window: tuple[int, int]):
        self.profiling, self.window, self.on = profiling, window, False

    def before_step(self, step: int) -> None:
        if step == self.window[0]:
            self.profiling.start()
            self.on = True

    def after_step(self, step: int) -> None:
        if self.on and step == self.window[1]:
            self.close()

    def close(self) -> None:  # also when the loop stopped inside the window
        if self.on:
            self.profiling.stop()
            self.on = False


class StepClock(Hook):
    """Notes when the step is handed to the trainer, for Progress.blocked.

    Last in the list of hooks: the step is handed over once every hook's before_step (test faults included) is done.
    """

    def __init__(self, progress: Progress):
        self.progress = progress

    def before_step(self, step: int) -> None:
        self.progress.handed = time.perf_counter()


def hooks_of(cfg: Config, trainer, log: MetricsLog, progress: Progress) -> list[Hook]:
    """In the order they act after a step: the sampled step's trace ends first (before any evaluation).

    The record is made before evaluation (whose time is not training time), gains the slowest process and is written
    before the sample and the checkpoint; the test faults come last (a kill after the save).
    """
    window = profile_window(cfg.train.profile_steps)
    several = trainer.process_count > 1
    hooks = [
        CommShare(cfg, trainer.profiling, progress, progress.meter.step, window),
        Evaluate(cfg, trainer, progress),
        EvalTasks(cfg, trainer, log, progress) if cfg.train.eval_tasks else None,
        Stragglers(cfg, trainer, log, progress) if several else None,
        Log(cfg, log, progress),
        Sample(cfg, trainer, log, progress),
        Checkpoint(cfg, trainer, progress),
        Profiler(trainer.profiling, window) if window else None,
        FaultInjector.from_env(trainer),
        StepClock(progress) if several else None,
    ]
    return [h for h in hooks if h is not None]
