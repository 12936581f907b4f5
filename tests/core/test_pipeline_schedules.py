"""Pipeline clock tables: textbook orderings, dependencies, bubbles and in-flight activations."""

import pytest

from jaxpar.tools import pipeline_table as pipeline
from jaxpar.core.errors import UserError
from jaxpar.core.pipeline.schedules import (
    Op,
    bubble_fraction,
    check_schedule,
    max_in_flight,
    placement,
    simulate,
    virtual_stage,
)

S, M = 4, 8
CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)]


def ticks(table):
    """(kind, microbatch, virtual stage) -> tick."""
    out = {}
    for t, row in enumerate(table):
        for device, op in enumerate(row):
            if op is not None:
                key = (op.kind, op.microbatch, op.chunk * len(row) + device)
                assert key not in out, f"{key} scheduled twice"
                out[key] = t
    return out


@pytest.mark.parametrize("schedule,V", CASES)
def test_dependencies_and_completeness(schedule, V):
    at = ticks(simulate(schedule, S, M, V))
    last = S * V - 1
    assert len(at) == 2 * M * S * V  # every forward and backward exactly once
    for m in range(M):
        for v in range(S * V):
            assert at[("F", m, v)] < at[("B", m, v)]
            if v:
                assert at[("F", m, v - 1)] < at[("F", m, v)]
            if v < last:
                assert at[("B", m, v + 1)] < at[("B", m, v)]


@pytest.mark.parametrize("schedule,V", CASES)
def test_bubble_is_the_textbook_fraction(schedule, V):
    assert bubble_fraction(simulate(schedule, S, M, V)) == pytest.approx((S - 1) / (V * M + S - 1))


def test_zb_h1_splits_the_backward_and_fills_the_bubble_with_w():
    """Every F, B and W once.

    W after its own B; bubble (S-1)/(3M+S-1) (Qi et al. 2024: about a third of 1F1B's); at most S microbatches held
    by any stage (1F1B's peak); F and B in 1F1B's order.
    """
    for S_, M_ in ((2, 4), (4, 8), (4, 16), (8, 16)):
        table = simulate("zb_h1", S_, M_)
        at = ticks(table)
        assert len(at) == 3 * M_ * S_
        for m in range(M_):
            for v in range(S_):
                assert at[("F", m, v)] < at[("B", m, v)] < at[("W", m, v)]
                if v:
                    assert at[("F", m, v - 1)] < at[("F", m, v)] and at[("B", m, v)] < at[("B", m, v - 1)]
        assert bubble_fraction(table) == pytest.approx((S_ - 1) / (3 * M_ + S_ - 1))
        assert all(max_in_flight(table, d) <= S_ for d in range(S_))
        f1b1 = simulate("1f1b", S_, M_)
        for d in range(S_):
            assert [o for o in order(table, d) if o[0] != "W"] == order(f1b1, d)
    with pytest.raises(UserError, match="virtual stages"):
        check_schedule("zb_h1", 4, 8, 2)


def test_zb_v_runs_two_chunks_in_a_v_at_1f1b_memory(capsys):
    """Device d holds virtual stages d and 2S-1-d (the first and the last on device 0).

    Every F, B and W once, in dependency order; at most 2S chunk-microbatches (half a stage each: 1F1B's S stages'
    worth) between F and W on any device; the bubble never below the least a unit-time table allows, (S-1)/(6M+S-1)
    -- the last device starts after S-1 chunk forwards -- and equal to it at S = 2, 3, 4, 8 (at 5-7 mostly above:
    the greedy rule's); at S=4 half ZB-H1's idle time (S-1 half-stage ticks against S-1 stage ticks).
    """
    for S_, M_ in [(2, 2)] + [(s, m * s) for s in range(2, 9) for m in (2, 3, 4)]:
        assert [placement("zb_v", S_, v) for v in range(2 * S_)] == (
            [(d, 0) for d in range(S_)] + [(d, 1) for d in reversed(range(S_))]
        )
        table = simulate("zb_v", S_, M_)
        at = {}
        for t, row in enumerate(table):
            for d, op in enumerate(row):
                if op is not None:
                    key = (op.kind, op.microbatch, virtual_stage("zb_v", S_, d, op.chunk))
                    assert key not in at and placement("zb_v", S_, key[2]) == (d, op.chunk)
                    at[key] = t
        assert len(at) == 3 * M_ * 2 * S_
        for m in range(M_):
            for v in range(2 * S_):
                assert at[("F", m, v)] < at[("B", m, v)] < at[("W", m, v)]
                if v:
                    assert at[("F", m, v - 1)] < at[("F", m, v)] and at[("B", m, v)] < at[("B", m, v - 1)]
        least = (S_ - 1) / (6 * M_ + S_ - 1)
        assert (
            bubble_fraction(table) == pytest.approx(least)
            if S_ in (2, 3, 4, 8)
            else (bubble_fraction(table) >= least - 1e-12)
        )
        assert all(max_in_flight(table, d) <= 2 * S_ for d in range(S_))
    zb_h1, zb_v = simulate("zb_h1", 4, 8), simulate("zb_v", 4, 8)
    idle = lambda table, unit: sum(op is None for row in table for op in row) * unit / 4  # per device
    assert idle(zb_v, 0.5) == idle(zb_h1, 1.0) / 2 and bubble_fraction(zb_v) < 0.53 * bubble_fraction(zb_h1)
    for schedule, units in (("zb_v", "1.5"), ("zb_h1", "3")):  # the table tool prints that idle time
        assert pipeline.main(["--stages", "4", "--microbatches", "8", "--schedule", schedule]) == 0
        assert f"idle {units} units of a stage's F, B or W per device" in capsys.readouterr().out
    with pytest.raises(UserError, match="zb_v places two chunks per stage itself"):
        check_schedule("zb_v", 4, 8, 2)
    with pytest.raises(UserError, match="stages x 2 chunks"):
        check_schedule("zb_v", 4, 8, 1, n_layer=4)


def order(table, device):
    return [str(row[device]) for row in table if row[device] is not None]


def test_gpipe_textbook_order():
    table = simulate("gpipe", S, M)
    for d in range(S):
        assert order(table, d) == [f"F{m}" for m in range(M)] + [f"B{m}" for m in range(M)]
    assert max_in_flight(table, 0) == M  # activations of every microbatch are alive at once


def test_1f1b_textbook_order():
    table = simulate("1f1b", S, M)
    # PipeDream-Flush: stage s warms up with S-s forwards, alternates B/F, then drains.
    for d in range(S):
        warm = S - d
        expected = [f"F{m}" for m in range(warm)]
        for m in range(M - warm):
            expected += [f"B{m}", f"F{m + warm}"]
        expected += [f"B{m}" for m in range(M - warm, M)]
        assert order(table, d) == expected
        assert max_in_flight(table, d) == S - d  # bounded by the stage count, not by M


def test_errors_are_user_errors(capsys):
    with pytest.raises(UserError, match="microbatches >= stages"):
        check_schedule("1f1b", 4, 2, 1)
    with pytest.raises(UserError, match="not divisible by stages x virtual stages"):
        check_schedule("interleaved", 2, 4, 2, n_layer=6)
    assert pipeline.main(["--stages", "4", "--microbatches", "2", "--schedule", "1f1b"]) == 2
    assert "microbatches >= stages" in capsys.readouterr().err


def dualpipev_ticks(table, S_):
    """(kind, microbatch, virtual stage) -> tick of a DualPipeV table, BW as a B and a W at one tick.

    Fails on an op run twice, missing, on the wrong device, or before what it needs (F before its B before its W; a
    forward after the previous virtual stage's, a backward after the next one's).
    """
    at = {}
    for t, row in enumerate(table):
        for d, op in enumerate(row):
            for kind, m, c in op.parts() if op is not None else []:
                v = virtual_stage("dualpipev", S_, d, c)
                for k in ("B", "W") if kind == "BW" else (kind,):
                    assert (k, m, v) not in at, f"{k}{m} of virtual stage {v} twice"
                    at[(k, m, v)] = t
    M_ = len({m for _, m, _ in at})
    assert sorted(at) == sorted((k, m, v) for k in "FBW" for m in range(M_) for v in range(2 * S_))
    for m in range(M_):
        for v in range(2 * S_):
            assert at[("F", m, v)] < at[("B", m, v)] <= at[("W", m, v)]
            assert v == 0 or at[("F", m, v - 1)] < at[("F", m, v)]
            assert v == 2 * S_ - 1 or at[("B", m, v + 1)] < at[("B", m, v)]
    return at


def test_dualpipev_program_is_valid_and_torchs():
    """The DualPipeV program is valid and is torch's ScheduleDualPipeV op for op.

    Every chunk-microbatch's F, B and W once on its V-placed device, in dependency order across the devices (the check
    fails on a table with an op dropped, repeated or moved before its input); each device's program is
    torch.distributed.pipelining's ScheduleDualPipeV's op for op (its FULL_BACKWARD our BW, BACKWARD_INPUT our B).
    """
    import types

    from torch.distributed.pipelining.schedules import ScheduleDualPipeV

    from jaxpar.core.pipeline.schedules import PROGRAMS

    names = {"FORWARD": "F", "FULL_BACKWARD": "BW", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}

    def theirs(a, rank):
        if a.sub_actions:  # torch's OVERLAP_F_B: its forward, then its full backward
            return "+".join(theirs(sub, rank) for sub in a.sub_actions)
        return str(Op(names[a.computation_type.name], a.microbatch_index, int(a.stage_index != rank)))

    for S_, M_ in ((2, 4), (2, 5), (3, 6), (4, 8), (4, 11), (8, 16)):
        dualpipev_ticks(simulate("dualpipev", S_, M_), S_)
        torch_order = types.SimpleNamespace(pp_group_size=S_, _n_microbatches=M_)
        for d in range(S_):
            assert [str(op) for op in PROGRAMS["dualpipev"](d, S_, M_)] == [
                theirs(a, d) for a in ScheduleDualPipeV._calculate_single_rank_operations(torch_order, d)
            ]
    table = simulate("dualpipev", 2, 4)
    dropped = [row[:] for row in table]
    dropped[-1][0] = None
    repeated = [row[:] for row in table] + [table[0]]
    t = next(t for t, row in enumerate(table) if row[1] is not None)  # device 1's first F, moved a tick early
    early = [row[:] for row in table]
    early[t - 1][1], early[t][1] = early[t][1], early[t - 1][1]
    for broken in (dropped, repeated, early):
        with pytest.raises(AssertionError):
            dualpipev_ticks(broken, 2)


def test_dualpipev_in_lockstep_against_zb_v(capsys):
    """DualPipeV's unit-tick bubble would count an overlapped F+BW tick as one unit.

    In lockstep (a tick lasts its slowest op: the executor's) it idles more than ZB-V, whose ops are all one unit,
    and less than 1F1B, whose F beside a two-unit backward idles half a tick. It holds one chunk-microbatch more
    than ZB-V (2S+1) on the last device. The table tool prints both bubbles.
    """
    from jaxpar.core.pipeline.schedules import lockstep_bubble

    for S_, M_ in ((2, 4), (4, 8), (4, 16), (8, 16)):
        dpv, zb_v = simulate("dualpipev", S_, M_), simulate("zb_v", S_, M_)
        assert lockstep_bubble("zb_v", zb_v) == pytest.approx(bubble_fraction(zb_v))
        assert (
            lockstep_bubble("zb_v", zb_v)
            < lockstep_bubble("dualpipev", dpv)
            < lockstep_bubble("1f1b", simulate("1f1b", S_, M_))
        )
        assert lockstep_bubble("dualpipev", dpv) > bubble_fraction(dpv)
        assert [max_in_flight(dpv, d) for d in range(S_)] == [2 * S_] * (S_ - 1) + [2 * S_ + 1]
    assert lockstep_bubble("1f1b", simulate("1f1b", 4, 8)) == pytest.approx(0.4)
    assert pipeline.main(["--stages", "4", "--microbatches", "8", "--schedule", "dualpipev"]) == 0
    out = capsys.readouterr().out
    assert "F5+BW1.1" in out and "lockstep 0.200" in out
    with pytest.raises(UserError, match="dualpipev needs microbatches >= 2 x stages"):
        check_schedule("dualpipev", 4, 7, 1)
    with pytest.raises(UserError, match=r"stages x 2 chunks \(dualpipev\)"):
        check_schedule("dualpipev", 4, 8, 1, n_layer=4)
