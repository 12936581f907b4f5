"""jaxpar under torchrun's elastic agent.

The worker reads the agent's variables afresh at each start, a -1 mesh axis follows the processes it is given, and a
restarted run reports its recovery. The whole story on loopback: two agents ("nodes") of two processes each train
`--mesh dp=-1,tp=2`; one agent is killed with its workers, the survivors continue on dp=1; the agent comes back and the
run grows to dp=2 again -- every step equal to an uninterrupted run.
"""

import json
import os
import time

import pytest

from jaxpar.core.run import recovery
from jaxpar.tools.bench_recovery import Node, environment, failure_schedule
from jaxpar.mesh import cpu_devices_for_elastic_axis, distributed_env
from tests.helpers import TINY, free_port, metrics, run_cli

AGENT = {
    "TORCHELASTIC_RUN_ID": "job",
    "RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "node0",
    "MASTER_PORT": "29500",
    "JAX_PLATFORMS": "cpu",
}


def test_a_torchrun_worker_joins_jax_distributed_from_the_agents_variables(monkeypatch):
    for key in [k for k in os.environ if k.startswith(("JAXPAR_", "JAX_", "SLURM_", "TORCHELASTIC_"))]:
        monkeypatch.delenv(key)
    for key, value in AGENT.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # the agent's store elsewhere: MASTER_PORT is free
    assert distributed_env() == ({"coordinator_address": "node0:29500", "num_processes": 4, "process_id": 3}, 4)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # MASTER_PORT is the agent's store: the next one
    assert distributed_env()[0]["coordinator_address"] == "node0:29501"
    monkeypatch.setenv("WORLD_SIZE", "1")  # a group of one: no jax.distributed
    assert distributed_env() == (None, 1)


@pytest.mark.parametrize(
    "mesh, processes, devices",
    [
        ({"dp": -1, "tp": 2}, 4, 4),
        ({"dp": -1, "tp": 2}, 2, 2),
        ({"dp": -1, "tp": 2}, 3, 3),  # 3: refused by the mesh
        ({"dp": -1, "tp": 4}, 2, 4),
        ({"dp": -1}, 1, 8),
        ({"dp": -1, "tp": 16}, 1, 16),
    ],
)
def test_an_elastic_axis_simulates_one_device_per_process_beyond_the_fixed_axes(mesh, processes, devices):
    assert cpu_devices_for_elastic_axis(mesh, processes) == devices


class Main:
    is_main, process_count = True, 2


def test_recovery_reports_the_steps_replayed_and_only_after_a_loss(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    first = recovery.Recovery(str(tmp_path), Main(), 0, 20, every_s=0)
    for step in range(7):  # started step 7, then lost
        first.before_step(step)
        first.after_step(step + 1)
    time.sleep(0.05)
    again = recovery.Recovery(str(tmp_path), Main(), 4, 20, every_s=0)  # resumed from the checkpoint of step 4
    again.before_step(4)
    (record,) = [json.loads(line) for line in open(tmp_path / recovery.RECOVERIES)]
    assert record["replayed_steps"] == 3 and record["resumed_from"] == 4 and record["recovered_s"] >= 0.05
    assert "recovered in" in capsys.readouterr().out
    for step in range(4, 9):  # a clean stop after step 9 (its checkpoint), then a resume there: nothing to report
        again.before_step(step)
        again.after_step(step + 1)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")  # under torchrun, but no restart and the same processes
    recovery.Recovery(str(tmp_path), Main(), 9, 20, every_s=0).before_step(9)
    assert sum(1 for _ in open(tmp_path / recovery.RECOVERIES)) == 1
    Main.process_count = 4  # the same resume on another number of processes: a re-formed group
    try:
        recovery.Recovery(str(tmp_path), Main(), 10, 20, every_s=0).before_step(10)
    finally:
        Main.process_count = 2
    assert json.loads(open(tmp_path / recovery.RECOVERIES).readlines()[-1])["processes"] == [2, 4]
    lagging = recovery.Recovery(str(tmp_path / "stop"), Main(), 0, 20, every_s=1e9)  # notes once, at its first step
    (tmp_path / "stop").mkdir()
    for step in range(6):
        lagging.before_step(step)
        lagging.after_step(step + 1)
    lagging.close()  # an agreed stop after step 6, saved there; resumed on other processes: nothing replayed
    Main.process_count = 4
    try:
        recovery.Recovery(str(tmp_path / "stop"), Main(), 6, 20, every_s=0).before_step(6)
    finally:
        Main.process_count = 2
    assert json.loads(open(tmp_path / "stop" / recovery.RECOVERIES).read())["replayed_steps"] == 0
    done = recovery.Recovery(str(tmp_path / "done"), Main(), 0, 1, every_s=0)  # a finished run continued: no loss
    (tmp_path / "done").mkdir()
    done.before_step(0)
    done.after_step(1)
    done.close()
    recovery.Recovery(str(tmp_path / "done"), Main(), 1, 30, every_s=0).before_step(1)
    assert not (tmp_path / "done" / recovery.RECOVERIES).exists()


# no loss spike: see bench_recovery
KEYS = ["train.steps=24", "checkpoint.every=4", "train.eval_every=0", "optim.lr=3e-3"]


def node(port: int, dataset, run_dir, log: str, host: bool, mesh: str = "dp=-1,tp=2", keys=KEYS, workers=2) -> Node:
    """One "node": torchrun with two workers, joining the c10d rendezvous on `port` (hosted by the first)."""
    args = [*TINY, *keys, "--mesh", mesh, f"data.dataset={dataset}", f"run.dir={run_dir}"]
    return Node("jaxpar.train", args, environment("JAXPAR", 0.5), port, "elastic", host, log, workers, join_s=120)


def wait_for_step(run_dir, step: int, deadline: float, *alive) -> None:
    while not (run_dir / "metrics.jsonl").exists() or max(metrics(run_dir), default=0) < step:
        assert time.monotonic() < deadline and all(p.poll() is None for p in alive), "the run stopped early"
        time.sleep(0.3)


def test_a_lost_node_shrinks_the_run_and_its_return_grows_it_back_exactly(dataset, tmp_path):
    reference = run_cli(tmp_path / "reference", dataset, "--mesh", "dp=2,tp=2", *KEYS)
    assert reference.returncode == 0, reference.stderr
    run_dir, port = tmp_path / "elastic", free_port()
    out = lose_a_node_and_bring_it_back(
        tmp_path, lambda host: node(port, dataset, run_dir, str(tmp_path / "nodes.log"), host)
    )
    changes = [(r["processes"], r["replayed_steps"]) for r in map(json.loads, open(run_dir / recovery.RECOVERIES))]
    # the kill, then the return (an agreed stop: nothing replayed); a record before them: the second agent joined late
    assert [p for p, _ in changes[-2:]] == [[4, 2], [2, 4]] and changes[-1][1] == 0, (changes, out[-3000:])
    assert "mesh tp=2 on 2 cpu devices" in out and out.count("mesh dp=2,tp=2 on 4 cpu devices") >= 2
    assert_every_step_follows(run_dir, tmp_path / "reference")


def lose_a_node_and_bring_it_back(tmp_path, start) -> str:
    """Two nodes, `start(host)`: the second killed after step 6, started again after step 14; both finish.

    Returns the nodes' log.
    """
    run_dir, deadline = tmp_path / "elastic", time.monotonic() + 480
    first, second = start(True), start(False)
    try:
        wait_for_step(run_dir, 6, deadline, first.proc, second.proc)
        second.kill()
        wait_for_step(run_dir, 14, deadline, first.proc)  # the first node alone now
        second = start(False)
        assert first.proc.wait(timeout=deadline - time.monotonic()) == 0
        assert second.proc.wait(timeout=60) == 0
    finally:
        for n in (first, second):
            if n.proc.poll() is None:
                n.kill()
    return (tmp_path / "nodes.log").read_text()


def assert_every_step_follows(run_dir, reference_dir) -> None:
    """Every step of the elastic run, the replayed ones too, within 1e-5 of the uninterrupted run's loss."""
    want = metrics(reference_dir)
    done = [json.loads(line) for line in open(run_dir / "metrics.jsonl") if '"loss"' in line]
    assert sorted({r["step"] for r in done}) == sorted(want) and len(done) > len(want)  # replayed steps too
    for record in done:
        assert abs(record["loss"] - want[record["step"]]["loss"]) <= 1e-5 * abs(want[record["step"]]["loss"])


def test_the_benchmarks_failures_fall_one_per_window_each_past_a_checkpoint():
    for seed in range(20):
        steps = failure_schedule(5, 72, 4, seed)
        assert steps == failure_schedule(5, 72, 4, seed) and len(steps) == 5
        assert all(k * 12 + 4 < at <= (k + 1) * 12 - 2 for k, at in enumerate(steps)), steps


def test_a_run_dir_that_cannot_take_the_note_costs_the_report_not_the_run(tmp_path, capsys):
    hook = recovery.Recovery(str(tmp_path / "missing"), Main(), 0, 3)
    for step in range(3):
        hook.before_step(step)
        hook.after_step(step + 1)
    hook.close()
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "cannot note progress" in warnings[0], warnings


def test_a_lost_diloco_group_restarts_the_run_from_its_checkpoint_and_every_step_follows(dataset, tmp_path):
    """DiLoCo's groups as two nodes of one process each (docs/diloco.md: a lost group is an elastic restart).

    One node is killed; the other goes on alone from the last checkpoint, both groups on its two simulated devices;
    the node comes back. Every step equals an uninterrupted run's, the replayed ones too.
    """
    keys = [*KEYS, "parallel.diloco_inner_steps=4"]
    reference = run_cli(tmp_path / "reference", dataset, "--mesh", "diloco=2", *keys)
    assert reference.returncode == 0, reference.stderr
    run_dir, port = tmp_path / "elastic", free_port()
    log = str(tmp_path / "nodes.log")
    out = lose_a_node_and_bring_it_back(
        tmp_path, lambda host: node(port, dataset, run_dir, log, host, "diloco=2", keys, workers=1)
    )
    changes = [r["processes"] for r in map(json.loads, open(run_dir / recovery.RECOVERIES))]
    assert changes[-2:] == [[2, 1], [1, 2]], (changes, out[-3000:])
    assert "DiLoCo: 2 groups of 1 device," in out
    assert_every_step_follows(run_dir, tmp_path / "reference")
