"""Pipeline schedules as clock-cycle tables: GPipe, 1F1B, interleaved 1F1B, zero-bubble ZB-H1 and ZB-V, and DualPipeV.

Each device runs a fixed *program* (its order of forward/backward work); `simulate` plays the
programs against the dependencies (forward of virtual stage v needs v-1's forward of the same
microbatch; backward needs v+1's backward, and the last stage's backward needs its own forward),
one unit of time per operation, and returns the table. Pure Python: both frameworks read these.

ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2024) splits each backward into B, the gradient
of the stage input (on the critical path: the previous stage waits for it), and W, the gradient of the
weights (nobody waits for it), and runs W where 1F1B would idle. A W needs its own B. With F, B and W a
unit each, its bubble is (S-1)/(3M+S-1), about a third of 1F1B's (S-1)/(M+S-1) counted in the same
units (1F1B's backward is B and W together: two units, the fraction is unchanged).

DualPipeV (DeepSeek's V-shaped DualPipe) places chunks as ZB-V and runs, in its steady state, one chunk's forward
overlapped with the other chunk's whole backward (of another microbatch) in one tick: op "FB". Its ops are not unit
work, so its tables are compared in `lockstep_bubble`, where a tick lasts as long as the slowest device's op (the
executor ends every tick with an exchange between devices).
"""

from __future__ import annotations

import dataclasses
import functools

from jaxpar.core.errors import UserError


@dataclasses.dataclass(frozen=True)
class Op:
    # "F", "B" (1F1B/GPipe: the whole backward; ZB, DualPipeV: the input gradient), "W" (weight gradient),
    # "BW" (DualPipeV: B and W at once) or "FB" (DualPipeV: F of (microbatch, chunk) and BW of (b_microbatch, b_chunk))
    kind: str
    microbatch: int
    chunk: int = 0  # which of the device's chunks (interleaved, zb_v); its virtual stage: virtual_stage()
    b_microbatch: int = -1  # FB's backward
    b_chunk: int = -1

    def __str__(self) -> str:
        if self.kind == "FB":
            return f"{Op('F', self.microbatch, self.chunk)}+{Op('BW', self.b_microbatch, self.b_chunk)}"
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")

    def parts(self) -> list[tuple[str, int, int]]:
        """(kind, microbatch, chunk) of each computation in the op: two for FB, else one."""
        if self.kind == "FB":
            return [("F", self.microbatch, self.chunk), ("BW", self.b_microbatch, self.b_chunk)]
        return [(self.kind, self.microbatch, self.chunk)]


def gpipe_program(stage: int, S: int, M: int, V: int = 1) -> list[Op]:
    """All forwards, then all backwards."""
    return [Op("F", m) for m in range(M)] + [Op("B", m) for m in range(M)]


def one_f_one_b_program(stage: int, S: int, M: int, V: int = 1) -> list[Op]:
    """Warm up with S-1-stage forwards, then alternate one forward and one backward, then drain.

    At most S-stage microbatches' activations are alive on a stage at once (PipeDream-Flush).
    """
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


def zb_h1_program(stage: int, S: int, M: int, V: int = 1) -> list[Op]:
    """1F1B's order of F and B; a W runs whenever the next F or B cannot (its input has not arrived), and at the end.

    A stage keeps at most S microbatches between F and W: 1F1B's peak (stage 0's), so the pipeline's peak memory is
    1F1B's.
    """
    return _zb_h1_programs(S, M)[stage]


@functools.lru_cache(maxsize=32)
def _zb_h1_programs(S: int, M: int) -> tuple[tuple[Op, ...], ...]:
    """The rule above played on all stages at once; each stage's order is its program."""
    fb = [one_f_one_b_program(d, S, M) for d in range(S)]
    pos, forwards, backwards, weights = [0] * S, [0] * S, [0] * S, [0] * S
    programs: list[list[Op]] = [[] for _ in range(S)]
    done: set[tuple[str, int, int]] = set()
    while any(w < M for w in weights):
        finished = []
        for d in range(S):
            op = fb[d][pos[d]] if pos[d] < len(fb[d]) else None
            if op is not None and op.kind == "F":
                ready = (d == 0 or ("F", op.microbatch, d - 1) in done) and forwards[d] - weights[d] < S
            else:
                ready = (
                    op is not None
                    and ("F", op.microbatch, d) in done
                    and (d == S - 1 or ("B", op.microbatch, d + 1) in done)
                )
            if ready:
                pos[d] += 1
                forwards[d] += op.kind == "F"
                backwards[d] += op.kind == "B"
            elif weights[d] < backwards[d]:
                op, weights[d] = Op("W", weights[d]), weights[d] + 1
            else:
                continue
            programs[d].append(op)
            finished.append((op.kind, op.microbatch, d))
        done.update(finished)
    return tuple(tuple(p) for p in programs)


def zb_v_program(stage: int, S: int, M: int, V: int = 1) -> list[Op]:
    """ZB-V (Qi et al. 2024, the V-shaped zero-bubble schedule).

    Two chunks per device placed in a V (`placement`), F, B and W split as ZB-H1's. Each tick a device runs the
    first of: a B whose inputs are there (chunk 0's first: its input gradient unblocks the device before it), an F
    (chunk 1's first: it heads for the loss) while fewer than 2S chunk-microbatches are between their F and their W,
    the oldest W. 2S chunks of half a stage's layers are 1F1B's peak of S microbatches of a whole stage.
    """
    return _zb_v_programs(S, M)[stage]


@functools.lru_cache(maxsize=32)
def _zb_v_programs(S: int, M: int) -> tuple[tuple[Op, ...], ...]:
    """The rule above played on all devices at once; each device's order is its program.

    The least bubble a unit-time table allows is (S-1)/(6M+S-1) (the last device starts after S-1 chunk forwards);
    the rule reaches it at S = 2, 3, 4 and 8 (M = 2S..4S) and stays above it at 5-7 (S=6, M=12: 0.089 against 0.065;
    tests/core/test_pipeline_schedules.py).
    """
    last, limit = 2 * S - 1, 2 * S
    nxt = {(kind, d, c): 0 for kind in "FB" for d in range(S) for c in (0, 1)}
    waiting: list[list[tuple[int, int]]] = [[] for _ in range(S)]  # (microbatch, chunk) whose W is due, oldest first
    live, programs, done = [0] * S, [[] for _ in range(S)], set()
    while any(nxt[("B", d, c)] < M or waiting[d] for d in range(S) for c in (0, 1)):
        finished = []
        for d in range(S):
            op = None
            for c in (0, 1):
                m, v = nxt[("B", d, c)], virtual_stage("zb_v", S, d, c)
                if m < M and ("F", m, v) in done and (v == last or ("B", m, v + 1) in done):
                    op = Op("B", m, c)
                    break
            for c in (1, 0):
                m, v = nxt[("F", d, c)], virtual_stage("zb_v", S, d, c)
                if op is None and m < M and (v == 0 or ("F", m, v - 1) in done) and live[d] < limit:
                    op = Op("F", m, c)
            if op is None and waiting[d]:
                op = Op("W", *waiting[d].pop(0))
            if op is None:
                continue
            if op.kind in "FB":
                nxt[(op.kind, d, op.chunk)] += 1
            if op.kind == "B":
                waiting[d].append((op.microbatch, op.chunk))
            live[d] += {"F": 1, "B": 0, "W": -1}[op.kind]
            programs[d].append(op)
            finished.append((op.kind, op.microbatch, virtual_stage("zb_v", S, d, op.chunk)))
        if not finished:
            raise RuntimeError(f"zb_v's rule deadlocked (S={S}, M={M})")
        done.update(finished)
    return tuple(tuple(p) for p in programs)


def dualpipev_program(stage: int, S: int, M: int, V: int = 1) -> list[Op]:
    """DualPipeV (DeepSeek's DualPipe cut in a V; torch.distributed.pipelining's ScheduleDualPipeV).

    With r the device, 2(S-1-r) forwards of chunk 0; r+1 pairs F0 F1; S-1-r times B1 W1 F1; M-2S+r+1 times F0+BW1
    then F1+BW0, each an overlapped tick (the last device's first F0, BW1 apart); S-1-r times BW1 then F1+BW0; r+1
    pairs of backwards B1 B0 whose second half splits off W; S-1-r times W then B0; the W's left. Needs M >= 2S-1.
    """
    count = {(kind, c): 0 for kind in "FB" for c in (0, 1)}
    due: list[tuple[int, int]] = []  # (microbatch, chunk) whose B ran without its W, oldest first

    def take(kind: str, c: int) -> int:
        count[(kind, c)] += 1
        return count[(kind, c)] - 1

    def backward(c: int, split: bool) -> Op:
        m = take("B", c)
        if split:
            due.append((m, c))
        return Op("B" if split else "BW", m, c)

    def overlapped(f: int, b: int) -> Op:
        m = take("F", f)
        return Op("FB", m, f, take("B", b), b)

    r, ops = stage, []
    ops += [Op("F", take("F", 0), 0) for _ in range(2 * (S - 1 - r))]
    for _ in range(r + 1):
        ops += [Op("F", take("F", 0), 0), Op("F", take("F", 1), 1)]
    for _ in range(S - 1 - r):
        ops += [backward(1, True), Op("W", *due.pop(0)), Op("F", take("F", 1), 1)]
    for i in range(M - 2 * S + r + 1):
        ops += [Op("F", take("F", 0), 0), backward(1, False)] if i == 0 and r == S - 1 else [overlapped(0, 1)]
        ops.append(overlapped(1, 0))
    for _ in range(S - 1 - r):
        ops += [backward(1, False), overlapped(1, 0)]
    half = (r + 1) // 2  # the second half of these backwards leaves its W for the drain's idle ticks
    for i in range(r + 1):
        ops += [backward(1, i > half or (i == half and r % 2 == 1)), backward(0, i >= half)]
    for _ in range(S - 1 - r):
        ops += [Op("W", *due.pop(0)), backward(0, True)]
    return ops + [Op("W", *w) for w in due]


PROGRAMS = {
    "gpipe": gpipe_program,
    "1f1b": one_f_one_b_program,
    "interleaved": interleaved_program,
    "zb_h1": zb_h1_program,
    "zb_v": zb_v_program,
    "dualpipev": dualpipev_program,
}
SPLIT_BACKWARD = ("zb_h1", "zb_v")  # B is the input gradient alone, W the weights'
V_SHAPED = ("zb_v", "dualpipev")  # two chunks per device, chunk 0 down the devices and chunk 1 back up
AUTO = "auto"  # parallel.pipeline_schedule's default: the least modeled step time (jaxpar/core/pipeline/choice.py)
# what a layout built without an entry point's choice runs (library calls such as build_step, and their tests):
# GSPMD GPipe, which runs every config; jaxpar.train, torchpar.train, plan and bench resolve auto first
UNRESOLVED = "gpipe"


def concrete(schedule: str) -> str:
    return UNRESOLVED if schedule == AUTO else schedule


def chunks(schedule: str, V: int) -> int:
    """Chunks of layers per device: parallel.pipeline_virtual_stages for interleaved, ZB-V's two, else one."""
    return 2 if schedule in V_SHAPED else V


def virtual_stage(schedule: str, S: int, device: int, chunk: int) -> int:
    """Which of the S x chunks virtual stages (layer slices, in model order) a device's chunk runs.

    Round robin (chunk * S + device), or ZB-V's V (chunk 0 down the devices, chunk 1 back up: device d holds d and
    2S-1-d, so the first and the last virtual stage, embedding and loss, are both on device 0).
    """
    return 2 * S - 1 - device if schedule in V_SHAPED and chunk else chunk * S + device


def placement(schedule: str, S: int, v: int) -> tuple[int, int]:
    """(device, chunk) of virtual stage v: virtual_stage's inverse."""
    if schedule in V_SHAPED and v >= S:
        return 2 * S - 1 - v, 1
    return v % S, v // S


def resolve_microbatches(stages: int, microbatches: int) -> int:
    """parallel.pipeline_microbatches, where 0 means two per stage."""
    return microbatches or 2 * stages


def check_schedule(schedule: str, S: int, M: int, V: int, n_layer: int | None = None) -> None:
    if schedule not in PROGRAMS:
        raise UserError(f"pipeline schedule {schedule!r} is not one of {', '.join(PROGRAMS)}")
    if S < 1 or M < 1 or V < 1:
        raise UserError(f"pipeline needs stages, microbatches and virtual stages >= 1 (got {S}, {M}, {V})")
    if schedule != "interleaved" and V != 1:
        raise UserError(
            f"virtual stages ({V}) need the interleaved schedule, not {schedule}"
            + (f" ({schedule} places two chunks per stage itself)" if schedule in V_SHAPED else "")
        )
    if schedule in ("1f1b", "interleaved", "zb_h1", "zb_v") and M < S:
        raise UserError(f"{schedule} needs microbatches >= stages (got {M} < {S})")
    if schedule == "dualpipev" and M < 2 * S:
        raise UserError(f"dualpipev needs microbatches >= 2 x stages (got {M} < {2 * S})")
    if schedule == "interleaved" and M % S:
        raise UserError(f"interleaved schedule needs microbatches ({M}) divisible by stages ({S})")
    if n_layer is not None and n_layer % (S * chunks(schedule, V)):
        what = f"2 chunks ({schedule})" if schedule in V_SHAPED else "virtual stages"
        raise UserError(f"model.n_layer={n_layer} is not divisible by stages x {what} = {S * chunks(schedule, V)}")


def _needs(kind: str, m: int, v: int, last: int) -> list[tuple[str, int, int]]:
    """What a computation (kind, microbatch, virtual stage) waits for.

    A forward its input, a backward its forward and the next stage's input gradient, a W its B.
    """
    if kind == "F":
        return [("F", m, v - 1)] if v else []
    if kind == "W":
        return [("B", m, v)]
    return [("F", m, v)] + ([("B", m, v + 1)] if v < last else [])


def simulate(schedule: str, S: int, M: int, V: int = 1) -> list[list[Op | None]]:
    """table[tick][device] = the op that device runs at that tick, or None (bubble)."""
    check_schedule(schedule, S, M, V)
    programs = [PROGRAMS[schedule](d, S, M, V) for d in range(S)]
    done: set[tuple[str, int, int]] = set()  # (kind, microbatch, virtual stage); BW makes a B and a W
    pos, table, last = [0] * S, [], S * chunks(schedule, V) - 1
    while any(p < len(prog) for p, prog in zip(pos, programs)):
        row, finished = [], []
        for d in range(S):
            op = programs[d][pos[d]] if pos[d] < len(programs[d]) else None
            if op is not None:
                parts = [(kind, m, virtual_stage(schedule, S, d, c)) for kind, m, c in op.parts()]
                if all(n in done for kind, m, v in parts for n in _needs(kind, m, v, last)):
                    pos[d] += 1
                    finished += [(k, m, v) for kind, m, v in parts for k in (("B", "W") if kind == "BW" else (kind,))]
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


def op_cost(op: Op | None, split: bool) -> int:
    """An op's work in units of one chunk's forward: a backward is two (B and W), one where it is split."""
    unit = {"F": 1, "B": 1 if split else 2, "W": 1, "BW": 2}
    return 0 if op is None else sum(unit[kind] for kind, _, _ in op.parts())


def lockstep_bubble(schedule: str, table: list[list[Op | None]]) -> float:
    """The idle share of a table run in lockstep, as the executor runs it.

    Every tick ends with an exchange between the devices, so a tick lasts as long as its slowest op: 1 - work / (devices
    x the sum of each tick's longest op). Unlike bubble_fraction it counts an overlapped FB as the three units it
    computes and 1F1B's backward as two: a device running F beside one running B idles half the tick.
    """
    split = schedule in SPLIT_BACKWARD or schedule == "dualpipev"
    costs = [[op_cost(op, split) for op in row] for row in table]
    return 1.0 - sum(map(sum, costs)) / (len(table[0]) * sum(max(row) for row in costs))


def max_in_flight(table: list[list[Op | None]], device: int) -> int:
    """The most stage inputs one device holds: microbatch-chunks whose forward ran but backward has not.

    With a split backward (ZB-H1), a chunk is held until its W has run.
    """
    split = any(kind == "W" for row in table for op in row if op is not None for kind, _, _ in op.parts())
    live, peak = set(), 0
    for row in table:
        for kind, m, c in row[device].parts() if row[device] is not None else []:
            if kind == "F":
                live.add((m, c))
            elif kind == ("W" if split else "B") or kind == "BW":
                live.discard((m, c))
        peak = max(peak, len(live))
    return peak


def render(table: list[list[Op | None]]) -> str:
    width = max(len(str(op)) for row in table for op in row if op) + 1
    lines = ["tick  " + " ".join(f"{'stage ' + str(d):>{max(width, 7)}}" for d in range(len(table[0])))]
    for t, row in enumerate(table):
        lines.append(f"{t:>4}  " + " ".join(f"{str(op) if op else '.':>{max(width, 7)}}" for op in row))
    return "\n".join(lines)


def configured_bubble(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> float | None:
    """The idle fraction of a run's pipeline (parallel.pipeline_* on `stages` stages); None without one.

    DualPipeV's is its lockstep bubble (its overlapped ticks are three units of work: a unit-tick count would
    flatter it); the others' the unit-tick table's, which for ZB-H1 and ZB-V (every op one unit) is their lockstep
    one too.
    """
    if stages == 1:
        return None
    schedule = concrete(schedule)
    table = simulate(schedule, stages, resolve_microbatches(stages, microbatches), virtual)
    return lockstep_bubble(schedule, table) if schedule == "dualpipev" else bubble_fraction(table)
