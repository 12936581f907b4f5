"""Which process is slow, and where the time goes (jaxpar/core/run/stragglers.py).

One process made slow on purpose (<PREFIX>_FAULT_SLOW_RANK) is named within two records -- jaxpar's process 1 of two,
torchpar's rank 0 of a ddp pair, so a detector naming a fixed process fails one of them -- and a one-device run spends
no time in collectives.
"""

import json
import subprocess

import pytest

from jaxpar.core.config.schema import load_config
from jaxpar.core.run.stragglers import CommShare, Stragglers, in_flight_s, paces, sample_step, slowest
from tests.e2e.test_multiprocess import finish, start_two
from tests.helpers import ROOT, TINY, metrics, run_cli, tensorboard_scalars, torch_command, torch_env

SLOW_S = "1.0"  # long against a tiny model's step, so load on the machine cannot hide it
STEPS = ["train.steps=6", "train.log_every=2", "train.eval_every=0", "checkpoint.every=0"]


def named(out: str) -> list[tuple[int, int]]:
    """(step, process) of each straggler line."""
    words = [line.split() for line in out.splitlines() if line.startswith("straggler at step")]
    return [(int(w[3].rstrip(":")), int(w[5])) for w in words]


def test_pace_is_step_time_less_the_waiting_beyond_the_least():
    # process 1 slept 0.5 s per step; process 0 waited for it inside the step: same wall time, different paces
    assert paces([0.6, 0.6], [0.55, 0.05]) == pytest.approx([0.1, 0.6])
    assert slowest([0.6, 0.6], [0.55, 0.05]) == (1, pytest.approx(0.6 / 0.35))
    assert slowest([0.6, 0.6, 0.6], [0.05, 0.55, 0.55]) == (0, pytest.approx(6.0))
    assert in_flight_s(
        [("d0", "dp", 0.0, 2.0), ("d0", "dp", 1.0, 3.0), ("d1", "dp", 0.0, 1.0), ("d0", "tp", 5.0, 6.0)]
    ) == {"dp": 2.0, "tp": 0.5}  # overlaps once; averaged over devices
    assert sample_step(0, 2, 0, 10) == 2 and sample_step(0, 1, 0, 10) == 1 and sample_step(0, 2, 3, 10) == 4
    assert sample_step(8, 2, 0, 10) is None  # no step after the first record that is not a record step


class Pair:
    """The process group, seen from process 0 of two.

    Process 0's row is what the hook measured; process 1 waited nothing at 0.5 s per step.
    """

    def sync_wait_s(self):
        return 0.0

    def gather(self, values):
        return [values, [0.5, 0.0, 0.0, float("nan")]]


class NoUtilization:
    """Probes that cannot tell the device's utilisation (as jax's)."""

    def device_utilization(self):
        return None


class Gathered:
    """A trainer of two processes whose process group is `Pair`."""

    process_count, rank, processes, probes = 2, 0, Pair(), NoUtilization()


class Progress:
    """0.4 s spent in the step and reading its metrics since the meter started (step 0), all of it waiting."""

    current, blocked, blocked_mark, synced = None, 0.4, 0.0, 0.0

    class meter:
        step = 0

    def record(self, step):
        self.current = self.current or {"step": step, "step_time_s": 0.5, "data_wait_share": 0.0}
        return self.current


class Lines:
    def __init__(self):
        self.lines = []

    def note(self, line):
        self.lines.append(line)


@pytest.mark.parametrize("threshold,named_lines", [(0.2, 1), (0.7, 0)])
def test_the_threshold_decides_who_is_named(threshold, named_lines):
    """Process 0 waited 0.4 s in one step: paces 0.1 and 0.5 s, the slow one 1.67x the median.

    At the next record (0.2 s a step over two) 1.25x: named above a 20% threshold (on the second record in a row:
    one alone may be noise), not above 70%.
    """
    cfg = load_config(None, TINY + [f"train.straggler_threshold={threshold}"])
    progress, log = Progress(), Lines()
    hook = Stragglers(cfg, Gathered(), log, progress)
    hook.after_step(1)
    assert progress.current["slowest_rank"] == 1 and progress.current["straggler_ratio"] == pytest.approx(0.5 / 0.3)
    assert log.lines == []
    progress.current = None
    hook.after_step(2)
    assert len(log.lines) == named_lines and all("process 1 " in line for line in log.lines)


def test_a_one_device_run_spends_nothing_in_collectives(dataset, tmp_path):
    r = run_cli(tmp_path, dataset, "--mesh", "dp=1", *STEPS)
    assert r.returncode == 0, r.stderr
    records = list(metrics(tmp_path).values())
    assert [rec["comm_share"] for rec in records if "comm_share" in rec] == [0.0]
    assert not any(
        k.startswith("comm_share_") or k in ("slowest_rank", "straggler_ratio") for rec in records for k in rec
    )  # one process: nothing gathered


def check_named(records: dict, out: str, slow: int, axes: set) -> None:
    """The slow process is named in a line by the second record (steps 2, 4), and every record says it is the slowest.

    One record has the sampled step's share per axis.
    """
    lines = named(out)
    assert lines and lines[0][0] <= 4 and {p for _, p in lines} == {slow}, out[-3000:]
    assert [rec["slowest_rank"] for rec in records.values()] == [slow] * len(records), records
    assert all(rec["straggler_ratio"] > 1 for rec in records.values()), records
    shared = [rec for rec in records.values() if "comm_share" in rec]
    assert len(shared) == 1 and {k[len("comm_share_") :] for k in shared[0] if k.startswith("comm_share_")} == axes
    assert all(0 < v <= 1 for k, v in shared[0].items() if k.startswith("comm_share_")), shared  # shares of a step


def test_jaxpar_names_the_slow_process(dataset, tmp_path):
    slow = {"JAXPAR_FAULT_SLOW_STEP_S": SLOW_S, "JAXPAR_FAULT_SLOW_RANK": "1"}
    rcs, outs = finish(
        start_two(tmp_path, dataset, ["--mesh", "dp=2,tp=2", *STEPS], env_of=lambda i: slow), timeout=300
    )
    assert rcs == [0, 0], outs
    check_named(metrics(tmp_path), outs[0], 1, {"dp", "tp", "dp_tp"})  # dp_tp: over all four devices


def test_torchpar_ddp_names_the_slow_rank(dataset, tmp_path):
    args = ["--backend", "ddp", *TINY, f"data.dataset={dataset}", f"run.dir={tmp_path}", *STEPS, "run.tensorboard=true"]
    env = torch_env(TORCHPAR_FAULT_SLOW_STEP_S=SLOW_S, TORCHPAR_FAULT_SLOW_RANK="0")
    r = subprocess.run(torch_command(args, 2), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    records = metrics(tmp_path)
    check_named(records, r.stdout, 0, {"dp"})
    board = tensorboard_scalars(tmp_path)  # the same scalars in TensorBoard
    assert board["slowest_rank"] == {s: 0 for s in records} and set(board["comm_share_dp"]) == {
        s for s, rec in records.items() if "comm_share_dp" in rec
    }


def test_report_plots_a_runs_slow_process_and_comm_share(tmp_path):
    from jaxpar.tools.report import main

    records = [
        {"step": 2, "straggler_ratio": 1.8, "slowest_rank": 1},
        {"step": 4, "straggler_ratio": 1.9, "slowest_rank": 1, "comm_share": 0.3, "comm_share_dp": 0.3},
    ]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["--run", str(tmp_path / "run"), "--out", str(tmp_path / "plots")]) == 0
    assert {p.name for p in (tmp_path / "plots").iterdir()} == {"stragglers.png", "comm_share.png"}


class BrokenProfiler:
    """A trainer's `profiling` whose comm_start raises, as jax.profiler does when a trace is already running."""

    def comm_axes(self):
        return ["dp"]

    def comm_start(self):
        raise RuntimeError("Profile has already been started")


def test_a_failing_profiler_costs_the_share_not_the_run(capsys):
    cfg = load_config(None, TINY + ["train.steps=8", "train.log_every=2"])
    hook = CommShare(cfg, BrokenProfiler(), Progress(), 0, None)
    for step in range(8):
        hook.before_step(step)
        hook.after_step(step + 1)
    hook.close()
    assert [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")] == [
        "warning: no comm_share this run: the profiler failed (RuntimeError: Profile has already been started)"
    ]


def test_torchs_profiler_stays_off_the_console(capfd):
    import torch

    from torchpar.comm import CommTrace

    trace = CommTrace(torch.device("cpu"))
    torch.ones(3).sum()
    assert trace.stop({"dp": 2}) == {}
    assert "profiler_start" not in capfd.readouterr().err
