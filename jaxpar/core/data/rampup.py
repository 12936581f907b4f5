"""train.batch_rampup=START,INCREMENT,SAMPLES (as Megatron's rampup_batch_size).

The global batch starts at START samples and grows by INCREMENT in equal shares of the first SAMPLES samples, up to
train.global_batch_size. A step's batch size is a function of the samples read before it, so the data cursor counts
samples: step s reads samples first(s) .. first(s) + size(s) - 1 of the shared order (data_order.py), the same on any
mesh and in both frameworks, and a resume from step s, on any mesh, reads on from first(s). The learning-rate schedule
counts steps (optim.warmup_steps, optim.decay_steps, train.steps), as without it.
"""

from __future__ import annotations

from jaxpar.core.errors import UserError


def parse_rampup(spec: str, global_batch_size: int, microbatches: int = 1) -> tuple[int, int, int] | None:
    """(START, INCREMENT, SAMPLES) of train.batch_rampup, or None where it is empty; one line where it is wrong."""
    if not spec:
        return None
    key = f"train.batch_rampup={spec}"
    try:
        start, increment, samples = (int(x) for x in spec.split(","))
    except ValueError:
        raise UserError(f"{key}: not START,INCREMENT,SAMPLES (three integers)") from None
    if min(start, increment, samples) < 1 or start >= global_batch_size:
        raise UserError(
            f"{key}: needs START, INCREMENT, SAMPLES >= 1 and START below train.global_batch_size={global_batch_size}"
        )
    if (global_batch_size - start) % increment:
        raise UserError(
            f"{key}: INCREMENT {increment} does not divide train.global_batch_size - START = "
            f"{global_batch_size - start}"
        )
    if start % microbatches or increment % microbatches:
        raise UserError(f"{key}: START and INCREMENT must be multiples of train.microbatches={microbatches}")
    return start, increment, samples


class BatchSizes:
    """The global batch size of every step, and the samples read before it."""

    def __init__(self, global_batch_size: int, rampup: str = "", microbatches: int = 1):
        self.full, ramp = global_batch_size, parse_rampup(rampup, global_batch_size, microbatches)
        self._firsts = [0]  # samples read before step k, for the steps of the ramp and the first full step
        if ramp is not None:
            start, increment, samples = ramp
            steps = (global_batch_size - start) // increment
            self._at = lambda read: start + increment * min(steps, read * steps // samples)
            while self._at(self._firsts[-1]) < global_batch_size:
                self._firsts.append(self._firsts[-1] + self._at(self._firsts[-1]))

    @classmethod
    def of(cls, cfg) -> "BatchSizes":
        return cls(cfg.train.global_batch_size, cfg.train.batch_rampup, cfg.train.microbatches)

    def first(self, step: int) -> int:
        """Samples read before `step`."""
        ramp = len(self._firsts) - 1
        return self._firsts[step] if step <= ramp else self._firsts[ramp] + (step - ramp) * self.full

    def size(self, step: int) -> int:
        return self.first(step + 1) - self.first(step)

    @property
    def sizes(self) -> list[int]:
        """Every batch size the run takes, smallest first."""
        return sorted({self.size(k) for k in range(len(self._firsts))})
