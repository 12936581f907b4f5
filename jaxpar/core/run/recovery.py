"""Recovery, measured: how long a restarted run was away and how much it did twice.

The main process notes the step it starts in run.dir/progress.json (step, time, processes; at most once a second,
so a slow shared file system does not stall the steps; `finished` at the end). A run that resumes behind that note
-- its processes were lost and restarted, by torchrun's elastic agent or a requeue -- or on another number of
processes, or after an agent's restart, prints `recovered in N s, M steps replayed` before its first step and
appends the same to run.dir/recoveries.jsonl: N from the last step noted before the loss to the first step started
after it (the new group's rendezvous, start-up, restore and jaxpar's compilation included), M the steps between
the checkpoint and that note (at least: the note may lag by a second's steps, so a checkpoint newer than the note
counts 0). A run that ends -- finished, stopped by a signal with its checkpoint, or on an error -- notes the steps
it completed, so an agreed stop resumed elsewhere reports 0 replayed. A plain resume -- a clean stop, the same
processes, no restart -- reports nothing.
"""

from __future__ import annotations

import json
import os
import sys
import time

from jaxpar.core.run.hooks import Hook

PROGRESS = "progress.json"
RECOVERIES = "recoveries.jsonl"


def read_progress(run_dir: str) -> dict | None:
    try:
        with open(os.path.join(run_dir, PROGRESS)) as f:
            return json.load(f)
    except (OSError, ValueError):  # none yet, or a note cut short by a kill: nothing to measure against
        return None


def write_progress(run_dir: str, note: dict) -> None:
    """Atomically (a kill mid-write leaves the previous note)."""
    path = os.path.join(run_dir, PROGRESS)
    with open(path + ".tmp", "w") as f:
        json.dump(note, f)
    os.replace(path + ".tmp", path)


class Recovery(Hook):
    """Notes progress on the main process; reports the recovery as the first step of a restarted run starts."""

    def __init__(self, run_dir: str, trainer, start: int, steps: int, every_s: float = 1.0):
        self.run_dir, self.start, self.steps, self.processes = run_dir, start, steps, trainer.process_count
        self.on, self.every_s, self.noted = trainer.is_main, every_s, -float("inf")
        last = read_progress(run_dir) if self.on else None
        restarted = (
            last is not None
            and not last.get("finished")
            and (
                last["step"] > start
                or last.get("processes") != self.processes
                or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
            )
        )
        self.last = last if restarted else None
        self.step = start

    def before_step(self, step: int) -> None:
        now = time.time()
        if self.on and (now - self.noted >= self.every_s or self.last is not None):
            self.noted = now
            self.note({"step": step + 1, "time": now, "processes": self.processes})
            if self.last is not None:
                self.report(now)

    def note(self, progress: dict) -> None:
        """The note is for measuring only: a run.dir that cannot take it costs the report, not the run."""
        try:
            write_progress(self.run_dir, progress)
        except OSError as e:
            print(
                f"warning: cannot note progress in {self.run_dir} ({e.strerror}); no recovery report for this run",
                file=sys.stderr,
                flush=True,
            )
            self.on, self.last = False, None

    def after_step(self, step: int) -> None:
        self.step = step

    def report(self, now: float) -> None:
        last, self.last = self.last, None
        record = {
            "time": now,
            "recovered_s": round(now - last["time"], 3),
            "replayed_steps": max(0, last["step"] - self.start),
            "resumed_from": self.start,
            "processes": [last.get("processes"), self.processes],
            "agent_restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        }
        with open(os.path.join(self.run_dir, RECOVERIES), "a") as f:
            f.write(json.dumps(record) + "\n")
        print(
            f"recovered in {record['recovered_s']:.1f} s, {record['replayed_steps']} steps replayed "
            f"(resumed from step {self.start}; {last.get('processes')} -> {self.processes} processes)",
            flush=True,
        )

    def close(self) -> None:
        """The steps completed, not the last (rate-limited) note: a stop after a step just saved replays nothing."""
        if self.on:
            self.note(
                {
                    "step": self.step,
                    "time": time.time(),
                    "processes": self.processes,
                    **({"finished": True} if self.step >= self.steps else {}),
                }
            )
