"""Fault injection for tests, shared by jaxpar.train and torchpar.train (no jax, no torch).

A loop hook that exists only when one of these variables is set.

<PREFIX>_FAULT_KILL_AFTER_STEP=N: the process SIGKILLs itself once step N (and its checkpoint) is
done; <PREFIX>_FAULT_KILL_IN_SAVE_AFTER_STEP=N: it SIGKILLs itself as soon as step N's checkpoint has started
(an asynchronous save is then still being written); <PREFIX>_FAULT_SIGTERM_AFTER_STEP=N: it sends itself SIGTERM;
<PREFIX>_FAULT_NAN_AT_STEP=N: the parameters are made non-finite just before step N (1-based) runs;
<PREFIX>_FAULT_OVERFLOW_AT_STEP=N: step N's gradients are made non-finite, as a float16 overflow would;
<PREFIX>_FAULT_SLOW_STEP_S=X: every step takes X seconds longer (signals then land mid-run);
<PREFIX>_FAULT_SLOW_RANK=R: only process R is slow, by X seconds before each step starts (a straggler: the others
wait for it inside the step; jaxpar/core/run/stragglers.py names it).
"""

from __future__ import annotations

import os
import signal
import time

FAULTS = (
    "KILL_AFTER_STEP",
    "KILL_IN_SAVE_AFTER_STEP",
    "SIGTERM_AFTER_STEP",
    "NAN_AT_STEP",
    "OVERFLOW_AT_STEP",
    "SLOW_STEP_S",
    "SLOW_RANK",
)


class FaultInjector:
    """A loop hook (jaxpar/core/run/hooks.py) injecting the faults the environment asks for into a trainer.

    The trainer's `faults` (jaxpar/core/run/adapter.py's `Faults`) are called from here only.
    """

    def __init__(self, faults, rank: int):
        """`faults`: the trainer's; `rank`: this process's (<PREFIX>_FAULT_SLOW_RANK)."""
        self.faults, self.rank = faults, rank
        self.env = {name: os.environ.get(f"{faults.prefix}_FAULT_{name}") for name in FAULTS}

    @classmethod
    def from_env(cls, trainer) -> "FaultInjector | None":
        """The hook if any <PREFIX>_FAULT_* variable is set, else None (a normal run carries no test code)."""
        hook = cls(trainer.faults, trainer.rank)
        return hook if any(hook.env.values()) else None

    def _is(self, name: str, step: int) -> bool:
        return self.env[name] == str(step)

    def before_step(self, step: int) -> None:
        """`step` (0-based) is about to run, as step step+1."""
        if self._is("NAN_AT_STEP", step + 1):
            self.faults.poison()
        if self._is("OVERFLOW_AT_STEP", step + 1):
            self.faults.overflow()
        if self.env["SLOW_STEP_S"] and self.env["SLOW_RANK"] == str(self.rank):
            time.sleep(float(self.env["SLOW_STEP_S"]))

    def after_step(self, step: int) -> None:
        """Step `step` (1-based) and its checkpoint, if any, have started."""
        if self.env["SLOW_STEP_S"] and self.env["SLOW_RANK"] is None:
            time.sleep(float(self.env["SLOW_STEP_S"]))
        if self._is("KILL_IN_SAVE_AFTER_STEP", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self._is("KILL_AFTER_STEP", step):
            self.faults.settle()
            os.kill(os.getpid(), signal.SIGKILL)
        if self._is("SIGTERM_AFTER_STEP", step):
            os.kill(os.getpid(), signal.SIGTERM)

    def close(self) -> None:
        pass
