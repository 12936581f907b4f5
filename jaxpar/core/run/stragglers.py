"""Which process is slow, and where a step's time goes: two loop hooks shared by both trainers (no jax, no torch).

`Stragglers` (multi-process runs, every record): at each record every process's step time, data wait, the time it
spent where it may be waiting for the others -- in the trainer's step (less its data wait), reading the step's
metrics, at the loop's per-step agreement (`trainer.processes.any_of`) -- and, where known, its device's utilisation
(`trainer.probes`) are gathered through the framework's collective (`trainer.processes.gather`). In synchronous
training every process's wall time per step is the same: the fast ones wait, inside the step's collectives or at the
agreement, for the slow one. So a process's own pace is its step time less the time it spent in those places beyond
the least any process spent there; the slowest process is the one the others wait for. The record gains
`slowest_rank` and `straggler_ratio` (its pace / the median pace); above 1 + train.straggler_threshold on two
records in a row (one alone is often a tiny step's noise: a page fault, a thread switch) one console line names it.
A process slow on its device alone (the host waits for its own device as long as the others wait for it) is not told
apart this way.

`CommShare` (once per run start): the profiler of the trainer (`trainer.profiling`) traces one sampled step after
the first record; the time its collectives were in flight, per mesh axis (the union of their intervals on each
device, averaged over this process's devices), over that step's own wall time (both under the profiler: a share, at
most 1 per axis), joins the next record as `comm_share_<axis>`, and their sum as `comm_share`. A run whose step has
no collectives (one device) logs `comm_share` 0.0 and no axis.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from typing import Iterable


def paces(step_s: list[float], waited_s: list[float]) -> list[float]:
    """Each process's seconds per step less its time where it may wait for others beyond the least any spent there."""
    least = min(waited_s)
    return [t - (w - least) for t, w in zip(step_s, waited_s)]


def slowest(step_s: list[float], waited_s: list[float]) -> tuple[int, float]:
    """(the slowest process, its pace over the median pace)."""
    pace = paces(step_s, waited_s)
    rank = max(range(len(pace)), key=pace.__getitem__)
    median = statistics.median(pace)
    return rank, (pace[rank] / median if median > 0 else 1.0)


def union_s(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals: overlapping collectives count once."""
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def in_flight_s(spans: Iterable[tuple[object, str, float, float]]) -> dict[str, float]:
    """Seconds some collective of each axis was in flight, from (device, axis, start, end) spans.

    The union per device, averaged over the devices seen.
    """
    by: dict[tuple, list] = {}
    devices = set()
    for device, axis, a, b in spans:
        by.setdefault((device, axis), []).append((a, b))
        devices.add(device)
    out: dict[str, float] = {}
    for (_, axis), intervals in by.items():
        out[axis] = out.get(axis, 0.0) + union_s(intervals) / len(devices)
    return out


def due(step: int, every: int, progress) -> bool:
    """The loop's record steps (hooks.Log's rule): train.log_every, and any step whose record exists already."""
    return step % every == 0 or progress.current is not None


class Stragglers:
    """A loop hook before hooks.Log: every record of a multi-process run names the slowest process."""

    def __init__(self, cfg, trainer, log, progress):
        self.every, self.threshold = cfg.train.log_every, cfg.train.straggler_threshold
        self.trainer, self.log, self.progress = trainer, log, progress
        self.suspect: int | None = None  # the process over the threshold at the last record

    def before_step(self, step: int) -> None:
        pass

    def after_step(self, step: int) -> None:
        if not due(step, self.every, self.progress):
            return
        record, progress = self.progress.record(step), self.progress
        t, steps = record["step_time_s"], max(step - progress.meter.step, 1)
        data = record["data_wait_share"] * t
        processes = self.trainer.processes
        waited = ((progress.blocked - progress.blocked_mark) + (processes.sync_wait_s() - progress.synced)) / steps
        util = self.trainer.probes.device_utilization()
        rows = processes.gather([t, data, waited - data, math.nan if util is None else util])
        rank, ratio = slowest([r[0] for r in rows], [r[2] for r in rows])
        record.update(slowest_rank=rank, straggler_ratio=ratio)
        suspect, self.suspect = self.suspect, (rank if ratio > 1 + self.threshold else None)
        if self.suspect is not None and suspect == self.suspect:
            _, data, _, util = rows[rank]
            busy = "" if math.isnan(util) else f", device {util:.0f}% busy"
            self.log.note(
                f"straggler at step {step}: process {rank} is {ratio:.2f}x the median pace "
                f"(data wait {data:.3f} s/step{busy}); the others wait for it"
            )

    def close(self) -> None:
        pass


class CommShare:
    """A loop hook first in the list (its trace ends before evaluation): one sampled step's collectives per axis."""

    def __init__(self, cfg, profiling, progress, start: int, window: tuple[int, int] | None):
        """`profiling`: the trainer's (jaxpar/core/run/adapter.py's `Profiling`)."""
        self.every, self.profiling, self.progress, self.on = cfg.train.log_every, profiling, progress, False
        self.result: dict[str, float] | None = None if profiling.comm_axes() else {}  # {}: no collectives, share 0
        self.sample = sample_step(start, cfg.train.log_every, cfg.train.eval_every, cfg.train.steps)
        if window and self.sample is not None and window[0] <= self.sample < window[1]:
            self.sample = None  # train.profile_steps traces then: one profiler at a time
        self.steps = cfg.train.steps

    def before_step(self, step: int) -> None:
        if self.result is None and step == self.sample:
            self.on = self.guarded(lambda: self.profiling.comm_start() or True, False)
            self.began = time.perf_counter()

    def after_step(self, step: int) -> None:
        if self.on:
            self.progress.metrics()  # the sampled step is complete
            took = time.perf_counter() - self.began
            spent = self.guarded(lambda: self.profiling.comm_stop(step - 1), None)
            self.result = None if spent is None else {axis: s / took for axis, s in spent.items()}
            self.on, self.progress.busy = False, True  # the trace's cost is not training time: the meter restarts
        elif self.result is not None and (step % self.every == 0 or step == self.steps):
            record = self.progress.record(step)
            shares = {f"comm_share_{axis}": share for axis, share in sorted(self.result.items())}
            record.update(comm_share=sum(shares.values()), **shares)
            self.result, self.sample = None, None  # once per run start

    def close(self) -> None:
        if self.on:
            self.guarded(lambda: self.profiling.comm_stop(None), None)
            self.on = False

    def guarded(self, work, failed):
        """The profiler is for measuring only.

        One that fails (already tracing, a full /tmp, a cut trace) costs this run's comm_share -- one warning,
        per process, with no collective waiting on it -- not the run.
        """
        try:
            return work()
        except Exception as e:  # noqa: BLE001 - any profiler failure
            print(
                f"warning: no comm_share this run: the profiler failed ({type(e).__name__}: {str(e)[:120]})",
                file=sys.stderr,
                flush=True,
            )
            self.sample = None
            return failed


def sample_step(start: int, every: int, eval_every: int, steps: int) -> int | None:
    """The data step (0-based) to trace.

    After the first record past `start` (warmed up), and ending neither on a record step (whose throughput would
    carry the trace) nor on an evaluation, where one such step exists.
    """
    first = (start // every + 1) * every
    for s in range(first, min(first + 2 * every + 2, steps)):
        done = s + 1
        if every == 1 or (done % every and not (eval_every and done % eval_every == 0) and done != steps):
            return s
    return None
