"""The run, written once for both trainers and read top to bottom.

Lock run.dir, move an old run aside, restore or initialise, record the config, train in the loop below (its hooks in
jaxpar/core/run/hooks.py), write the final weights, say what the run did and what comes next
(jaxpar/core/run/summary.py).

A trainer's entry point (jaxpar/train.py, torchpar/train.py) parses its arguments, validates them, sets up its devices
or process group and reads its inputs, then hands its adapter -- a `Trainer`: jaxpar/trainer.py, torchpar/trainer.py
-- to `run_training`. Nothing here imports jax or torch.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any, ContextManager, Protocol

from jaxpar.core.config.schema import Config
from jaxpar.core.errors import UserError
from jaxpar.core.run.adapter import Faults, Probes, Processes, Profiling
from jaxpar.core.run.hooks import Progress, hooks_of
from jaxpar.core.run.metrics import MetricsLog
from jaxpar.core.run.peers import PeerGuard
from jaxpar.core.run.recovery import Recovery
from jaxpar.core.run.resume import already_complete, schedule_change, start_anew, write_run_config
from jaxpar.core.run.lock import RunLock
from jaxpar.core.run.summary import Outcome, start_line, summary_lines
from jaxpar.core.run.signals import ignore_stop_requests
from jaxpar.core.run.trackers import open_trackers


class Trainer(Protocol):
    """A framework's adapter: the one interface between the shared run and jax or torch.

    Its methods are the run sequence's and the loop's; the rest of the hooks' work goes to its collaborators
    (jaxpar/core/run/adapter.py), each a class of the trainer's own.
    """

    is_main: bool  # process 0 / rank 0: the one that writes the run's shared files and prints
    process_count: int
    rank: int  # this process's index among them
    train_data: Any  # the training GlobalBatches (jaxpar/core/data/order.py)
    processes: Processes  # the process group: the loop's agreement, the stragglers' gather, the roll call
    probes: Probes  # measurements for the metrics record
    profiling: Profiling  # train.profile_steps and the sampled step's collectives
    faults: Faults  # <PREFIX>_FAULT_* (jaxpar/core/run/faults.py)

    # the run sequence
    def restore_or_init(self) -> int:
        """The data step to continue from (0: a new run): run.dir's latest checkpoint, model.init_from or the seed's."""

    def run_config(self) -> dict:
        """What config.json records beside the config: the resolved mesh, or the backend and world size."""

    def start(self) -> str:
        """Compile or build what the loop drives; the start-up line(s) (every process: it may gather)."""

    def write_weights(self, path: str, which: str) -> None:
        """The parameters in the shared safetensors format (every process takes part; one writes)."""

    def close(self) -> None:
        """Read-ahead stopped, saves in flight complete; runs even when training stopped on an error."""

    # the loop and its hooks
    def train_step(self, step: int) -> Any:
        """Start the update on the batch of data step `step` (0-based; read ahead); a handle on its metrics."""

    def fetch(self, handle: Any) -> dict:
        """The step's loss, grad_norm and lr as floats (waits for the step)."""

    def evaluate(self, batches: int) -> float:
        """The mean loss over the first `batches` validation batches."""

    def sample(self, step: int) -> list[int] | None:
        """A validation prompt and a sampled continuation (token ids, on process 0; None elsewhere)."""

    def task_model(self, batch_size: int) -> Any:
        """The live parameters as lm-eval's model (jaxpar/core/evaluation/harness.py ProjectLM): train.eval_tasks."""

    def synchronised(self) -> ContextManager:
        """Inside it the model holds what readers of the parameters read (DiLoCo's synchronised parameters)."""

    def save(self, step: int) -> None:
        """Checkpoint the state after `step` (a no-op if saved already); may return before it is on disk."""


def run_training(cfg: Config, trainer: Trainer, stop: dict, write_final: str | None = None) -> int:
    """After the trainer's own checks and set-up (a refused run moves and writes nothing).

    The run, with run.dir locked by the main process until its end (the kernel lets go if the process dies).
    """
    if not cfg.run.dir:
        raise UserError("run.dir is empty: name the run's directory (the trainers' default: runs/<framework>/<config>)")
    t0, outcome = time.monotonic(), None
    with RunLock(cfg.run.dir) as lock:
        claim_run_dir(cfg, trainer, lock)
        try:
            step = trainer.restore_or_init()
            info = trainer.run_config()
            framework = info.get("framework", "jaxpar")
            complete = already_complete(cfg, step, trainer.is_main)  # says so; its config.json is kept
            if trainer.is_main and not complete:
                lines = [schedule_change(cfg, step), start_line(cfg, framework, step)]
                print("\n".join(filter(None, lines)), flush=True)
            if trainer.is_main and not (complete and os.path.isfile(os.path.join(cfg.run.dir, "config.json"))):
                write_run_config(cfg, **info)  # over the old config.json, which schedule_change has read
            if not complete:
                outcome = train_from(cfg, trainer, step, stop)
            if write_final:
                trainer.write_weights(write_final, "final")
        finally:
            trainer.close()
    ignore_stop_requests()  # the run is saved: a late SIGTERM must not turn the clean exit into a kill
    if outcome is not None and trainer.is_main:  # after close: every checkpoint is on disk
        info["processes"] = trainer.process_count
        print("\n".join(summary_lines(cfg, framework, info, outcome, time.monotonic() - t0)), flush=True)
    return 0


def claim_run_dir(cfg: Config, trainer: Trainer, lock: RunLock) -> None:
    """Locks run.dir for this run, moving an old run aside for checkpoint.resume=false.

    The main process locks run.dir (another run there refuses this one) and, for checkpoint.resume=false on a run
    directory, moves the old run aside -- its lock file goes with it: the new run.dir is locked too. No process touches
    run.dir before -- or all stop, when the main process could not.
    """
    failure = None
    try:
        if trainer.is_main:
            lock.acquire()
        start_anew(cfg, trainer.is_main)
        if trainer.is_main:
            lock.acquire()
    except (OSError, UserError) as e:
        failure = e
    if trainer.processes.any_of(failure is not None):
        raise failure or UserError(
            f"{cfg.run.dir}: the main process could not move the old run aside, or not lock run.dir (its line says why)"
        )
    os.makedirs(cfg.run.dir, exist_ok=True)


def train_from(cfg: Config, trainer: Trainer, step: int, stop: dict) -> Outcome:
    line = trainer.start()
    if trainer.is_main:
        print(line, flush=True)
    outcome = Outcome(first_step=step)
    log = MetricsLog(
        cfg.run.dir,
        trainer.is_main,
        cfg.train.steps,
        step,
        open_trackers(cfg, trainer.is_main),
        cfg.data.tokenizer,
        outcome,
    )
    try:
        outcome.last_step = train_loop(cfg, trainer, step, log, stop)
    finally:
        log.close()
    if outcome.last_step < cfg.train.steps:  # the loop ends early on an agreed stop alone
        outcome.stopped_by = signal.Signals(stop["signal"]).name if "signal" in stop else "a signal to another process"
    return outcome


def train_loop(cfg: Config, trainer: Trainer, step: int, log: MetricsLog, stop: dict) -> int:
    """Train from data step `step` to train.steps or a stop all processes agree on; returns the last step done.

    `stop`: from `stop_requests()`. Everything but the step itself is a hook acting on its own cadence.
    """
    progress = Progress(cfg, trainer, step)
    hooks = [Recovery(cfg.run.dir, trainer, step, cfg.train.steps), *hooks_of(cfg, trainer, log, progress)]
    try:
        with PeerGuard(trainer, cfg.run.peer_timeout_s, cfg.run.dir, step, lambda: progress.saved) as peers:
            while step < cfg.train.steps:
                peers.beat(step)
                if trainer.processes.any_of("signal" in stop):  # asked on any process: all stop after the same step
                    progress.metrics()
                    trainer.save(step)
                    if trainer.is_main:
                        print(
                            f"stopped by signal {stop.get('signal', '(on another process)')} after step {step}; "
                            "checkpoint saved",
                            file=sys.stderr,
                        )
                    break
                for hook in hooks:
                    hook.before_step(step)
                progress.started(step + 1, trainer.train_step(step))
                step = trainer.processes.rejoined_at() or step + 1  # torchft: a group back from a loss heals ahead
                for hook in hooks:
                    hook.after_step(step)
                progress.step_done(step)
    finally:
        for hook in hooks:
            hook.close()
    return step
