"""Stopping on a signal.

SIGTERM / SIGINT ask the run to stop after the current step with a checkpoint (the loop in jaxpar/core/run/loop.py
agrees on the stop across processes); once the run is saved, late signals are ignored.
"""

from __future__ import annotations

import os
import signal
import sys


def stop_requests() -> dict:
    """From now on SIGTERM / SIGINT only ask for a stop (the dict gains "signal").

    Trainers call this early, so that a signal during start-up also ends in an agreed stop at the first step. A
    second signal ends the process at once, as if there were no handler.
    """
    stop: dict = {}

    def ask(signum, _frame) -> None:
        if "signal" in stop:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        stop["signal"] = signum
        print(
            f"signal {signum}: stopping after this step with a checkpoint (again: stop now)",
            file=sys.stderr,
            flush=True,
        )

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, ask)
    return stop


def ignore_stop_requests() -> None:
    """The run is over and saved.

    A late SIGTERM (a scheduler signals every process, at different moments) must not turn this process's clean exit
    into a kill.
    """
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
