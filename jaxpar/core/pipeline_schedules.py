"""Pipeline schedules as clock-cycle tables: GPipe, 1F1B and interleaved 1F1B.

Each device runs a fixed *program* (its order of forward/backward work); `simulate` plays the
programs against the dependencies (forward of virtual stage v needs v-1's forward of the same
microbatch; backward needs v+1's backward, and the last stage's backward needs its own forward),
one unit of time per operation, and returns the table. Pure Python: both frameworks read these.
"""
from __future__ import annotations

import dataclasses

from jaxpar.core.errors import UserError


@dataclasses.dataclass(frozen=True)
class Op:
    kind: str  # "F" or "B"
    microbatch: int
    chunk: int = 0  # virtual stage index on this device (interleaved); virtual stage = chunk * S + device

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


def gpipe_program(stage: int, S: int, M: int, V: int = 1) -> list[Op]:
    """All forwards, then all backwards."""
    return [Op("F", m) for m in range(M)] + [Op("B", m) for m in range(M)]


def one_f_one_b_program(stage: int, S: int, M: int, V: int = 1) -> list[Op]:
    """Warm up with S-1-stage forwards, then alternate one forward and one backward, then drain:
    at most S-stage microbatches' activations are alive on a stage at once (PipeDream-Flush)."""
    warmup = min(S - 1 - stage, M)
    ops = [Op("F", m) for m in range(warmup)]
    f, b = warmup, 0
    while f < M:
        ops += [Op("F", f), Op("B", b)]
        f, b = f + 1, b + 1
    return ops + [Op("B", m) for m in range(b, M)]


def interleaved_program(stage: int, S: int, M: int, V: int) -> list[Op]:
    """Megatron's interleaved 1F1B: microbatches in groups of S cycle through the V chunks."""
    total = M * V

    def forward(k: int) -> Op:
        group, within = divmod(k, S * V)
        return Op("F", group * S + within % S, (k // S) % V)

    def backward(k: int) -> Op:
        group, within = divmod(k, S * V)
        return Op("B", group * S + within % S, V - 1 - (k // S) % V)

    warmup = min((S - stage - 1) * 2 + (V - 1) * S, total)
    ops = [forward(k) for k in range(warmup)]
    f, b = warmup, 0
    while f < total:
        ops += [forward(f), backward(b)]
        f, b = f + 1, b + 1
    return ops + [backward(k) for k in range(b, total)]


PROGRAMS = {"gpipe": gpipe_program, "1f1b": one_f_one_b_program, "interleaved": interleaved_program}


def resolve_microbatches(stages: int, microbatches: int) -> int:
    """parallel.pipeline_microbatches, where 0 means two per stage."""
    return microbatches or 2 * stages


def check(schedule: str, S: int, M: int, V: int, n_layer: int | None = None) -> None:
    if schedule not in PROGRAMS:
        raise UserError(f"pipeline schedule {schedule!r} is not one of {', '.join(PROGRAMS)}")
    if S < 1 or M < 1 or V < 1:
        raise UserError(f"pipeline needs stages, microbatches and virtual stages >= 1 (got {S}, {M}, {V})")
    if schedule != "interleaved" and V != 1:
        raise UserError(f"virtual stages ({V}) need the interleaved schedule, not {schedule}")
    if schedule in ("1f1b", "interleaved") and M < S:
        raise UserError(f"{schedule} needs microbatches >= stages (got {M} < {S})")
    if schedule == "interleaved" and M % S:
        raise UserError(f"interleaved schedule needs microbatches ({M}) divisible by stages ({S})")
    if n_layer is not None and n_layer % (S * V):
        raise UserError(f"model.n_layer={n_layer} is not divisible by stages x virtual stages = {S * V}")


def simulate(schedule: str, S: int, M: int, V: int = 1) -> list[list[Op | None]]:
    """table[tick][device] = the op that device runs at that tick, or None (bubble)."""
    check(schedule, S, M, V)
    programs = [PROGRAMS[schedule](d, S, M, V) for d in range(S)]
    done: set[tuple[str, int, int]] = set()  # (kind, microbatch, virtual stage)
    pos, table, last = [0] * S, [], S * V - 1
    while any(p < len(prog) for p, prog in zip(pos, programs)):
        row, finished = [], []
        for d in range(S):
            op = programs[d][pos[d]] if pos[d] < len(programs[d]) else None
            if op is not None:
                v = op.chunk * S + d
                need = ([("F", op.microbatch, v - 1)] if v else []) if op.kind == "F" else \
                    [("F", op.microbatch, v)] + ([("B", op.microbatch, v + 1)] if v < last else [])
                if all(n in done for n in need):
                    pos[d] += 1
                    finished.append((op.kind, op.microbatch, v))
                else:
                    op = None
            row.append(op)
        if not finished:
            raise RuntimeError(f"{schedule} schedule deadlocked (S={S}, M={M}, V={V})")
        done.update(finished)  # visible from the next tick: one unit of time per op
        table.append(row)
    return table


def bubble_fraction(table: list[list[Op | None]]) -> float:
    cells = [op for row in table for op in row]
    return sum(op is None for op in cells) / len(cells)


def max_in_flight(table: list[list[Op | None]], device: int) -> int:
    """Most microbatch-chunks whose forward ran but backward has not, on one device."""
    live, peak = set(), 0
    for row in table:
        op = row[device]
        if op is not None:
            (live.add if op.kind == "F" else live.discard)((op.microbatch, op.chunk))
            peak = max(peak, len(live))
    return peak


def render(table: list[list[Op | None]]) -> str:
    width = max(len(str(op)) for row in table for op in row if op) + 1
    lines = ["tick  " + " ".join(f"{'stage ' + str(d):>{max(width, 7)}}" for d in range(len(table[0])))]
    for t, row in enumerate(table):
        lines.append(f"{t:>4}  " + " ".join(f"{str(op) if op else '.':>{max(width, 7)}}" for op in row))
    return "\n".join(lines)


def configured_bubble(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> float | None:
    """The idle fraction of a run's pipeline (parallel.pipeline_* on `stages` stages); None without one."""
    if stages == 1:
        return None
    return bubble_fraction(simulate(schedule, stages, resolve_microbatches(stages, microbatches), virtual))
