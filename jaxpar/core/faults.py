"""Fault injection for tests, shared by jaxpar.train and torchpar.train (no jax, no torch).

<PREFIX>_FAULT_KILL_AFTER_STEP=N: the process SIGKILLs itself once step N (and its checkpoint) is
done; <PREFIX>_FAULT_KILL_IN_SAVE_AFTER_STEP=N: it SIGKILLs itself as soon as step N's checkpoint has started
(an asynchronous save is then still being written); <PREFIX>_FAULT_SIGTERM_AFTER_STEP=N: it sends itself SIGTERM;
<PREFIX>_FAULT_NAN_AT_STEP=N: the parameters are made non-finite just before step N (1-based) runs;
<PREFIX>_FAULT_OVERFLOW_AT_STEP=N: step N's gradients are made non-finite, as a float16 overflow would;
<PREFIX>_FAULT_SLOW_STEP_S=X: every step takes X seconds longer (signals then land mid-run).
"""
from __future__ import annotations

import os
import signal
import time


def fault_hooks(prefix: str, step: int, settle) -> None:
    """Run at the end of step `step`; `settle()` waits for the checkpoints in flight."""
    if os.environ.get(f"{prefix}_FAULT_SLOW_STEP_S"):
        time.sleep(float(os.environ[f"{prefix}_FAULT_SLOW_STEP_S"]))
    if os.environ.get(f"{prefix}_FAULT_KILL_IN_SAVE_AFTER_STEP") == str(step):
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get(f"{prefix}_FAULT_KILL_AFTER_STEP") == str(step):
        settle()
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get(f"{prefix}_FAULT_SIGTERM_AFTER_STEP") == str(step):
        os.kill(os.getpid(), signal.SIGTERM)


def fault_at_step(prefix: str, what: str) -> int | None:
    value = os.environ.get(f"{prefix}_FAULT_{what}_AT_STEP")
    return int(value) if value else None
