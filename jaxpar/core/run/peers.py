"""Lost peers, bounded: a survivor names the processes that died or hang and leaves with one line.

When another process dies or hangs, a survivor must neither wait forever in a collective nor end in a library's abort (a
core dump after pages of coordination-service log).

Two detectors, both run by the shared loop in multi-process runs: a step that raises (gloo reports a
closed connection at once) and a watchdog thread that sees no step finish for run.peer_timeout_s (NCCL
waits instead). Either way the survivor holds a roll call in the launcher's key-value store (jax's
coordination service, torch's TCPStore) to name the processes that do not answer, prints one line with
the last checkpoint and leaves with status 3 without running exit handlers: a clean shutdown would wait
on the dead peer, then abort. The libraries' own failure timeouts (jax heartbeats, the torch process-group
timeout) are set above ours, by `library_timeout_s`, so that this path is the one that runs.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable, NoReturn

from jaxpar.core.errors import UserError

LOST_PEER_EXIT = 3
STORE_LINGER_S = 2.0  # how much longer the process hosting the launcher's store stays (leave_if_peers_lost)
ELASTIC_ROLL_CALL_S = 5.0  # the roll call under an elastic agent with restarts left (roll_call_wait_s)


def under_elastic_agent() -> bool:
    """Whether torchrun's elastic agent runs this process and will restart the group when it fails."""
    restarts_left = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) - int(
        os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    )
    return bool(os.environ.get("TORCHELASTIC_RUN_ID")) and restarts_left > 0


def roll_call_wait_s(timeout_s: float) -> float:
    """How long a survivor waits for the others to answer the roll call.

    Briefly under an elastic agent with restarts left (it re-forms the group at once, so the survivors' quick exit
    is the recovery's start), else long enough for a slow peer to answer.
    """
    return min(ELASTIC_ROLL_CALL_S if under_elastic_agent() else 30.0, timeout_s / 2)


def library_timeout_s(timeout_s: float) -> int:
    """jax's heartbeat timeout / torch's process-group timeout: past our detection and roll call."""
    return int(timeout_s + roll_call_wait_s(timeout_s) + 60)


def roll_call(
    announce: Callable[[], None], answered: Callable[[], set[int]], me: int, processes: int, wait_s: float
) -> list[int]:
    """Roll call: the processes that do not answer within `wait_s`.

    `announce()` this process in a key-value store, then poll `answered()` (the processes that announced) until all have
    or `wait_s` passes; returns the missing ones (every other process if the store itself is gone).
    """
    try:
        announce()
        deadline = time.monotonic() + wait_s
        while True:
            missing = sorted(set(range(processes)) - answered() - {me})
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.2)
    except Exception:  # noqa: BLE001 - the store is unreachable
        return [i for i in range(processes) if i != me]


def leave_if_peers_lost(
    roll_call: Callable[[float], list[int]],
    processes: int,
    what: str,
    timeout_s: float,
    last_checkpoint: str,
    always: bool = False,
    hosts_store: bool = False,
) -> None:
    """Hold the roll call; if someone is missing (or `always`), print one line and exit now.

    Returns only when every process answered and `always` is false (the failure was not about peers). The process
    that `hosts_store` (jax's coordination service) leaves a moment after the others: losing it first, they would
    end in the library's abort instead of their own line.
    """
    missing = roll_call(roll_call_wait_s(timeout_s))
    if not missing and not always:
        return
    who = (
        f"process {', '.join(map(str, missing))} of {processes} did not answer"
        if missing
        else f"all {processes} processes answer, so a collective hangs"
    )
    print(f"error: {who} ({what}; run.peer_timeout_s={timeout_s:g}); {last_checkpoint}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    if hosts_store:
        time.sleep(STORE_LINGER_S)
    os._exit(LOST_PEER_EXIT)


class Watchdog:
    """Calls `on_stall()` from a daemon thread when `beat()` has not been called for `timeout_s`."""

    def __init__(self, timeout_s: float, on_stall: Callable[[], NoReturn]):
        self.timeout_s, self.on_stall = timeout_s, on_stall
        self.last, self.stopped = time.monotonic(), threading.Event()
        self.thread = threading.Thread(target=self._watch, name="peer-watchdog", daemon=True)
        self.thread.start()

    def beat(self) -> None:
        self.last = time.monotonic()

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()

    def _watch(self) -> None:
        while not self.stopped.wait(min(1.0, self.timeout_s / 10)):
            if time.monotonic() - self.last > self.timeout_s:
                self.on_stall()
                return


class PeerGuard:
    """Both detectors around the shared loop (nothing to guard with one process): `beat(step)` once per step.

    `last_saved()` names the newest checkpoint this run wrote (None: none yet). An exception leaving the `with`
    (other than a UserError) first holds the roll call.
    """

    def __init__(self, trainer, timeout_s: float, run_dir: str, step: int, last_saved):
        self.trainer, self.timeout_s, self.run_dir = trainer, timeout_s, run_dir
        self.step, self.resumed_from, self.last_saved = step, step or None, last_saved  # resumed: from a checkpoint
        self.dog = Watchdog(timeout_s, self._stalled) if trainer.process_count > 1 else None

    def beat(self, step: int) -> None:
        self.step = step
        if self.dog:
            self.dog.beat()

    def _leave(self, what: str, always: bool = False) -> None:
        saved = self.last_saved() or self.resumed_from
        where = f"the last checkpoint is step {saved} in {self.run_dir}/checkpoints" if saved else "no checkpoint yet"
        t = self.trainer
        leave_if_peers_lost(
            t.processes.roll_call, t.process_count, what, self.timeout_s, where, always, hosts_store=t.is_main
        )

    def _stalled(self) -> NoReturn:
        self._leave(f"no step finished for {self.timeout_s:g} s after step {self.step}", always=True)

    def __enter__(self) -> "PeerGuard":
        return self

    def __exit__(self, kind, error, _tb) -> bool:
        if self.dog:
            self.dog.stop()
            if error is not None and not isinstance(error, UserError):
                first = (str(error).strip().splitlines() or [kind.__name__])[0][:200]
                self._leave(f"step {self.step + 1}: {first}")
        return False
