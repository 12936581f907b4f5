"""The run sequence, written once for both trainers: lock run.dir (jaxpar/core/run_lock.py), move an old run aside,
restore or initialise, record the config, train in the shared loop (jaxpar/core/loop.py), write the final weights.

A trainer (jaxpar/train.py, torchpar/train.py) parses its arguments, checks them, sets up its devices or
process group and reads its inputs, then hands a `Trainer` -- its adapter -- to `run_training`. Nothing here
imports jax or torch.
"""
from __future__ import annotations

import os
from typing import Protocol

from jaxpar.core.config import Config
from jaxpar.core.errors import UserError
from jaxpar.core.flops import flops_per_token
from jaxpar.core.loop import Framework, ignore_stop_requests, run_loop
from jaxpar.core.metrics_log import MetricsLog
from jaxpar.core.resume import already_complete, start_anew, write_run_config
from jaxpar.core.run_lock import RunLock
from jaxpar.core.trackers import open_trackers


class Trainer(Protocol):
    """A framework's side of the run sequence."""
    is_main: bool  # process 0 / rank 0: the one that writes the run's shared files and prints

    def any_of(self, flag: bool) -> bool:
        """Whether `flag` is true on any process (every process gets the same answer; a barrier too)."""

    def restore_or_init(self) -> int:
        """The state: the latest checkpoint in run.dir (checkpoint.resume), else model.init_from, else the seeded
        initialisation. Returns the data step to continue from (0 for a new run)."""

    def run_config(self) -> dict:
        """What config.json records beside the config: the resolved mesh, or the backend and world size."""

    def framework(self) -> Framework:
        """What the loop drives: the compiled step, data, evaluation, saves."""

    def describe(self) -> str:
        """The start-up line(s): layout, devices, parameter count (every process calls it: it may gather)."""

    def peak_flops(self) -> float | None:
        """The summed peak FLOP/s of all devices for model.compute_dtype (None where unknown: no MFU)."""

    def record_extra(self) -> dict:
        """Constant fields of every metrics record (jaxpar: the pipeline bubble)."""

    def write_weights(self, path: str, which: str) -> None:
        """The parameters in the shared safetensors format (every process takes part; one writes)."""

    def close(self) -> None:
        """Saves in flight complete; run even when training stopped on an error."""


def run_training(cfg: Config, trainer: Trainer, stop: dict, write_final: str | None = None) -> int:
    """After the trainer's own checks and set-up (a refused run moves and writes nothing): the run, with run.dir
    locked by the main process until its end (the kernel lets go if the process dies)."""
    with RunLock(cfg.run.dir) as lock:
        claim_run_dir(cfg, trainer, lock)
        try:
            step = trainer.restore_or_init()
            if trainer.is_main:
                write_run_config(cfg, **trainer.run_config())
            if not already_complete(cfg, step, trainer.is_main):
                train_from(cfg, trainer, step, stop)
            if write_final:
                trainer.write_weights(write_final, "final")
        finally:
            trainer.close()
    ignore_stop_requests()  # the run is saved: a late SIGTERM must not turn the clean exit into a kill
    return 0


def claim_run_dir(cfg: Config, trainer: Trainer, lock: RunLock) -> None:
    """The main process locks run.dir (another run there refuses this one) and, for checkpoint.resume=false on a run
    directory, moves the old run aside -- its lock file goes with it: the new run.dir is locked too. No process
    touches run.dir before -- or all stop, when the main process could not."""
    failure = None
    try:
        if trainer.is_main:
            lock.acquire()
        start_anew(cfg, trainer.is_main)
        if trainer.is_main:
            lock.acquire()
    except (OSError, UserError) as e:
        failure = e
    if trainer.any_of(failure is not None):
        raise failure or UserError(f"{cfg.run.dir}: the main process could not move the old run aside, or not lock "
                                   "run.dir (its line says why)")
    os.makedirs(cfg.run.dir, exist_ok=True)


def train_from(cfg: Config, trainer: Trainer, step: int, stop: dict) -> None:
    fw = trainer.framework()
    line = trainer.describe()
    if trainer.is_main:
        print(line, flush=True)
    log = MetricsLog(cfg.run.dir, trainer.is_main, cfg.train.steps, step, open_trackers(cfg, trainer.is_main),
                     cfg.data.tokenizer)
    try:
        run_loop(cfg, step, fw, log, trainer.peak_flops(), flops_per_token(cfg.model, cfg.data.seq_len), stop,
                 trainer.record_extra(), fw.train_data)
    finally:
        fw.close()
        log.close()
