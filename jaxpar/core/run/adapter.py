"""A trainer adapter's collaborators: the work beside jaxpar/core/run/loop.py's `Trainer` methods.

The run sequence and the loop call the `Trainer` itself for the run's steps; the process group's work, the
measurements, the profiler and the test faults go to these. A trainer exposes each as an attribute -- `processes`,
`probes`, `profiling`, `faults` -- implemented by classes of its own in jaxpar/trainer.py and torchpar/trainer.py.
Nothing here imports jax or torch.
"""

from __future__ import annotations

from typing import Protocol


class Processes(Protocol):
    """The process group's work: the loop's per-step agreement, the stragglers' gather, the lost peers' roll call."""

    def any_of(self, flag: bool) -> bool:
        """Whether `flag` is true on any process (every process gets the same answer; a barrier too)."""

    def sync_wait_s(self) -> float:
        """Seconds spent so far in `any_of` (waiting, maybe, for the others)."""

    def gather(self, values: list[float]) -> list[list[float]]:
        """Every process's `values`, a row each by rank, on every process."""

    def roll_call(self, wait_s: float) -> list[int]:
        """Announce this process in the launcher's store; the processes that did not within `wait_s`."""

    def rejoined_at(self) -> int | None:
        """The data step to continue from where this group healed from a live one in the last step (torchft), once."""


class Probes(Protocol):
    """Measurements for the metrics record (jaxpar/core/run/hooks.py) and the stragglers' rows (stragglers.py)."""

    def peak_flops(self) -> float | None:
        """The summed peak FLOP/s of all devices for model.compute_dtype (None where unknown: no MFU)."""

    def record_extra(self) -> dict:
        """Constant fields of every metrics record (jaxpar: the pipeline bubble)."""

    def data_wait_s(self) -> float:
        """Seconds spent so far waiting for training batches (the read-ahead was not ready)."""

    def memory(self) -> dict:
        """{"memory_in_use_gib", "memory_gib" (the peak)} on this process's first device; None where unknown."""

    def device_utilization(self) -> float | None:
        """This process's device's busy percentage, where the framework can tell (else None)."""


class Profiling(Protocol):
    """The framework's profiler: train.profile_steps's window and the sampled step's collectives (stragglers.py)."""

    def start(self) -> None:
        """Start tracing into <run.dir>/profile (train.profile_steps)."""

    def stop(self) -> None:
        """Stop tracing and write the trace."""

    def comm_axes(self) -> list[str]:
        """The mesh axes (or process groups) with more than one device."""

    def comm_start(self) -> None:
        """Start tracing the sampled step's collectives."""

    def comm_stop(self, step: int | None) -> dict[str, float]:
        """Seconds data step `step`'s collectives were in flight, per axis (None: stop only)."""


class Faults(Protocol):
    """The test faults' work (jaxpar/core/run/faults.py); called from its hook only."""

    prefix: str  # <PREFIX>_FAULT_* environment variables

    def poison(self) -> None:
        """<PREFIX>_FAULT_NAN_AT_STEP: make the parameters non-finite."""

    def overflow(self) -> None:
        """<PREFIX>_FAULT_OVERFLOW_AT_STEP: make the next step's gradients non-finite."""

    def settle(self) -> None:
        """<PREFIX>_FAULT_KILL_AFTER_STEP: wait until the checkpoints started so far are complete."""
