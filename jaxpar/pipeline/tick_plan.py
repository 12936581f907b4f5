"""The hand-scheduled pipeline executor's tables (jaxpar/pipeline/executor.py).

For a schedule's clock table (jaxpar/core/pipeline/schedules.py), what each device does at each tick -- the lax.switch
branch, its chunk and microbatch -- and which buffer slot it reads its stage input, cotangent and residuals from, writes
its residuals (and ZB's taps) to, and keeps each arrival in. Slots are allocated per device over the ticks each value
lives. Pure numpy: the planner reads them without tracing.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxpar.core.pipeline.schedules import SPLIT_BACKWARD, chunks, placement, simulate, virtual_stage

HAND_SCHEDULED = ("1f1b", "interleaved", "zb_h1", "zb_v", "dualpipev")  # GPipe trains through gpipe.py (jax.grad)
# with B and W (DualPipeV also BW, B and W in one tick)
SPLIT = (*SPLIT_BACKWARD, "dualpipev")
# branch index of a tick: what one device does
(
    IDLE,
    F_MID,
    F_FIRST,
    F_LAST,
    B_MID,
    B_FIRST,
    B_LAST,
    W_MID,
    W_FIRST,
    W_LAST,
    BW_MID,
    BW_FIRST,
    BW_LAST,
    FB_MID,
    FB_FIRST_LAST,
    FB_LAST_FIRST,
) = range(16)
BRANCHES = FB_LAST_FIRST + 1  # lax.switch branches of a tick
CODES = {
    "F": (F_FIRST, F_MID, F_LAST),
    "B": (B_FIRST, B_MID, B_LAST),
    "W": (W_FIRST, W_MID, W_LAST),
    "BW": (BW_FIRST, BW_MID, BW_LAST),
}
# DualPipeV's overlapped F and BW by (F's place, BW's place), 0 first, 1 middle, 2 last virtual stage: on the V
# a device's chunks are both in the middle, or (device 0) the first and the last
FB_CODES = {(1, 1): FB_MID, (0, 2): FB_FIRST_LAST, (2, 0): FB_LAST_FIRST}
# where a device's arrivals come from: the device before it (d-1, circularly), the one after it (d+1), or its own
# last tick (ZB-V's turn, virtual stage S-1 to S on the last device)
SOURCES = ("left", "right", "self")
# one row per (tick, device): the branch, its chunk and microbatch, the slots it reads its stage input,
# cotangent and residuals from, the residual slot its forward fills, and the slots where this tick's
# arrivals from each source are kept
# (BW, alone or in an FB, reads b_chunk, b_microbatch, b_res_slot, b_cot_slot: its own, beside FB's forward's)
COLUMNS = (
    "code",
    "chunk",
    "microbatch",
    "in_slot",
    "cot_slot",
    "res_slot",
    "res_write",
    "tap_slot",
    "tap_write",
    "b_chunk",
    "b_microbatch",
    "b_res_slot",
    "b_cot_slot",
    *(f"recv_{kind}_{src}" for kind in ("act", "cot") for src in SOURCES),
)
COL = {name: i for i, name in enumerate(COLUMNS)}


@dataclasses.dataclass(frozen=True)
class TickPlan:
    tables: np.ndarray  # [ticks, devices, COLUMNS] int32
    act_slots: int  # received stage-input buffers per device, + 1 spare
    cot_slots: int  # received-cotangent buffers per device, + 1 spare
    res_slots: int  # residual buffers per device (microbatch-chunks between F and the end of their backward), + 1
    tap_slots: int = 1  # ZB: "tap" buffers per device (microbatch-chunks between B and W), + 1


def _allocate(intervals: list[tuple[int, int, object]]) -> tuple[dict, int]:
    """Greedy slots for [start, end] tick intervals (a slot is reusable after its end tick)."""
    free_after, slot_of = [], {}
    for start, end, key in sorted(intervals, key=lambda x: x[0]):
        slot = next((i for i, f in enumerate(free_after) if f < start), None)
        if slot is None:
            slot = len(free_after)
            free_after.append(end)
        free_after[slot] = end
        slot_of[key] = slot
    return slot_of, len(free_after)


def _source(S: int, sender: int, receiver: int) -> str:
    return "self" if sender == receiver else "left" if sender == (receiver - 1) % S else "right"


def _timing(schedule: str, S: int, table: list) -> tuple[dict, set]:
    """The tick of every F, B and W in a schedule's table, and which of them run as one BW.

    Returns ({(kind, microbatch, virtual stage): tick} of every F, B and W, a BW's B and W at its tick; the
    (microbatch, virtual stage) of the BWs).
    """
    when, whole = {}, set()
    for t, row in enumerate(table):
        for d, op in enumerate(row):
            for kind, m, c in op.parts() if op is not None else ():
                v = virtual_stage(schedule, S, d, c)
                for k in ("B", "W") if kind == "BW" else (kind,):
                    when[(k, m, v)] = t
                if kind == "BW":
                    whole.add((m, v))
    return when, whole


def tick_plan(schedule: str, S: int, M: int, V: int) -> TickPlan:
    """The tables of a schedule.

    With a split backward (ZB) B keeps the projections' inputs and output gradients for W (written at the B tick
    into the microbatch's slot of the residual buffers and a slot of the "tap" buffers, which hold microbatch-chunks
    from B to W only), so the cotangent that came in is dropped at B.
    """
    table, last = simulate(schedule, S, M, V), S * chunks(schedule, V) - 1
    split = schedule in SPLIT
    dev = lambda v: placement(schedule, S, v)[0]
    place = lambda v: 0 if v == 0 else 2 if v == last else 1  # first, middle, last virtual stage
    when, whole = _timing(schedule, S, table)
    # what each device must keep until the backward is over: an arrived stage input until its forward has run,
    # an arrived cotangent until its B, and the residuals of each forward (ZB: what B keeps for W) until W
    end = lambda m, v: when.get(("W", m, v), when[("B", m, v)])
    acts, cots, res, taps = ([[] for _ in range(S)] for _ in range(4))
    for m in range(M):
        for v in range(last + 1):
            res[dev(v)].append((when[("F", m, v)], end(m, v), (m, v)))
            if split and (m, v) not in whole:
                taps[dev(v)].append((when[("B", m, v)], end(m, v), (m, v)))
            if v:
                acts[dev(v)].append((when[("F", m, v - 1)] + 1, when[("F", m, v)], (m, v)))
            if v < last:
                cots[dev(v)].append((when[("B", m, v + 1)] + 1, when[("B", m, v)], (m, v)))
    act_slot, cot_slot, res_slot, tap_slot = ([_allocate(x) for x in kept] for kept in (acts, cots, res, taps))
    n_act, n_cot, n_res, n_tap = (
        max((n for _, n in slots), default=0) + 1  # + scratch
        for slots in (act_slot, cot_slot, res_slot, tap_slot)
    )
    out = np.zeros((len(table), S, len(COLUMNS)), np.int32)
    for name, scratch in (
        ("in_slot", n_act),
        ("cot_slot", n_cot),
        ("res_slot", n_res),
        ("res_write", n_res),
        ("tap_slot", n_tap),
        ("tap_write", n_tap),
        ("b_res_slot", n_res),
        ("b_cot_slot", n_cot),
        *((f"recv_{kind}_{src}", n) for kind, n in (("act", n_act), ("cot", n_cot)) for src in SOURCES),
    ):
        out[..., COL[name]] = scratch - 1
    for (kind, m, v), t in when.items():
        (d, chunk), first, final = placement(schedule, S, v), v == 0, v == last
        if (m, v) in whole and kind == "W":
            continue  # done with its B, in the BW's row
        b = "b_" if kind == "B" and (m, v) in whole else ""  # a BW, alone or beside an F, reads the b_ columns
        if b:
            out[t, d, [COL["b_chunk"], COL["b_microbatch"]]] = chunk, m
        else:
            out[t, d, [COL["code"], COL["chunk"], COL["microbatch"]]] = CODES[kind][place(v)], chunk, m
        slot = res_slot[d][0][(m, v)]
        out[t, d, COL["res_write" if kind == "F" else b + "res_slot"]] = slot
        if kind == "B" and split and not b:  # B's taps go into residual and "tap" buffers
            out[t, d, [COL["res_write"], COL["tap_write"]]] = slot, tap_slot[d][0][(m, v)]
        elif kind == "W":
            out[t, d, COL["tap_slot"]] = tap_slot[d][0][(m, v)]
        if kind == "F" and not first:
            out[t, d, COL["in_slot"]] = act_slot[d][0][(m, v)]
            recv = f"recv_act_{_source(S, dev(v - 1), d)}"
            out[when[("F", m, v - 1)] + 1, d, COL[recv]] = act_slot[d][0][(m, v)]
        if kind == "B" and not final:
            out[t, d, COL[b + "cot_slot"]] = cot_slot[d][0][(m, v)]
            recv = f"recv_cot_{_source(S, dev(v + 1), d)}"
            out[when[("B", m, v + 1)] + 1, d, COL[recv]] = cot_slot[d][0][(m, v)]
    for t, row in enumerate(table):  # the code of a BW or an overlapped F and BW
        for d, op in enumerate(row):
            if op is not None and op.kind in ("BW", "FB"):
                at = tuple(place(virtual_stage(schedule, S, d, c)) for _, _, c in op.parts())
                out[t, d, COL["code"]] = CODES["BW"][at[0]] if op.kind == "BW" else FB_CODES[at]
    return TickPlan(out, n_act, n_cot, n_res, n_tap)
