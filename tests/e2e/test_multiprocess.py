"""Two local CPU processes (2 simulated devices each) form one dp=2,tp=2 mesh via jax.distributed.

Launched as SLURM's srun would (jax reads SLURM_*) they reproduce one process; signalled, one or both, they stop
together after one step with one checkpoint; when one is killed the other leaves with one line.
"""

import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.helpers import ROOT, TINY, free_port, metrics, run_cli

MESH = ["--mesh", "dp=2,tp=2", "train.steps=20", "train.eval_every=10", "checkpoint.every=0"]


def slurm_job_id() -> int:
    """A job id whose port (jax's SLURM rule: 61440 + id % 4096) is free on this machine now."""
    for job in np.random.default_rng().integers(1, 1 << 20, 50):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 61440 + int(job) % 4096))
                return int(job)
            except OSError:
                continue
    raise RuntimeError("no free port in jax's SLURM range")


def start_two(run_dir, dataset, args, env_of=lambda i: {}, slurm=False):
    """`python -m jaxpar.train` as processes 0 and 1 of one job on loopback.

    JAXPAR_* variables, or the variables `srun --ntasks=2` sets (then jax finds the coordinator itself).
    """
    if slurm:
        job = slurm_job_id()
        launch = lambda i: {
            "SLURM_JOB_ID": str(job),
            "SLURM_STEP_NODELIST": "localhost",
            "SLURM_NTASKS": "2",
            "SLURM_PROCID": str(i),
            "SLURM_LOCALID": str(i),
            "SLURM_STEP_NUM_NODES": "1",
        }
    else:
        port = free_port()
        launch = lambda i: {
            "JAXPAR_COORDINATOR": f"127.0.0.1:{port}",
            "JAXPAR_NUM_PROCESSES": "2",
            "JAXPAR_PROCESS_ID": str(i),
        }
    cmd = [sys.executable, "-m", "jaxpar.train", *TINY, f"data.dataset={dataset}", f"run.dir={run_dir}", *args]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JAXPAR_"))}
    return [
        subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**base, "JAX_PLATFORMS": "cpu", **launch(i), **env_of(i)},
        )
        for i in range(2)
    ]


def finish(procs, timeout=120):
    """(return codes, stdout + stderr of each) once both exit; both are killed on a timeout."""
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [p.returncode for p in procs], [o + e for o, e in outs]


def losses(run_dir, steps) -> list[float]:
    got = metrics(run_dir)
    return [got[s]["loss"] for s in steps]


@pytest.fixture(scope="module")
def two_runs(dataset, tmp_path_factory):
    """The same 20 steps on one process and on two processes started the way srun starts them."""
    tmp = tmp_path_factory.mktemp("multiprocess")
    single = run_cli(tmp / "one", dataset, *MESH)
    assert single.returncode == 0, single.stderr
    rcs, outs = finish(start_two(tmp / "two", dataset, MESH, slurm=True))
    assert rcs == [0, 0], outs
    return tmp, outs


def test_srun_launch_reproduces_one_process(two_runs):
    tmp, outs = two_runs
    assert "4 cpu devices" in outs[0] and "step 20/20" in outs[0]
    assert "step 20/20" not in outs[1]  # progress from process 0 only
    one, two = metrics(tmp / "one"), metrics(tmp / "two")
    np.testing.assert_allclose(
        [two[s]["loss"] for s in range(1, 21)], [one[s]["loss"] for s in range(1, 21)], rtol=1e-5
    )
    np.testing.assert_allclose(two[20]["eval_loss"], one[20]["eval_loss"], rtol=1e-5)
    assert os.listdir(tmp / "two" / "checkpoints") == ["20"]


def _stop_and_resume(run_dir, dataset, signal_them, env_of=lambda i: {}):
    """Start two processes, let `signal_them(procs)` stop them.

    Both exit 0 with one checkpoint, and resuming continues the uninterrupted two-process run exactly.
    """
    procs = start_two(run_dir, dataset, MESH, env_of)
    signal_them(procs)
    t0 = time.monotonic()
    rcs, outs = finish(procs, timeout=60)
    assert rcs == [0, 0] and time.monotonic() - t0 < 60, outs
    assert "stopped by signal" in outs[0] + outs[1], outs
    saved = os.listdir(run_dir / "checkpoints")
    assert len(saved) == 1 and 0 < int(saved[0]) < 20, saved
    rcs, outs = finish(start_two(run_dir, dataset, MESH))
    assert rcs == [0, 0] and f"resumed from {run_dir}/checkpoints/{saved[0]}" in outs[0], outs
    later = range(int(saved[0]) + 1, 21)
    np.testing.assert_allclose(losses(run_dir, later), losses(run_dir.parent / "two", later), rtol=1e-6)


def test_sigterm_to_one_process_stops_both_after_the_same_step(two_runs, dataset):
    """Process 1 signals itself after step 2 (fault hook); process 0 is never signalled."""
    _stop_and_resume(
        two_runs[0] / "sigterm_one",
        dataset,
        lambda procs: None,
        lambda i: {"JAXPAR_FAULT_SIGTERM_AFTER_STEP": "2"} if i == 1 else {},
    )


def test_sigterm_to_both_at_different_moments(two_runs, dataset):
    """A scheduler's preemption.

    SIGTERM to process 0 as soon as it trains, to process 1 0.35 s later (steps slowed to 0.1 s, so that both
    signals land mid-run).
    """

    def preempt(procs):
        line = procs[0].stdout.readline()
        while line and not line.startswith("step"):
            line = procs[0].stdout.readline()
        procs[0].send_signal(signal.SIGTERM)
        time.sleep(0.35)
        procs[1].send_signal(signal.SIGTERM)

    _stop_and_resume(two_runs[0] / "sigterm_both", dataset, preempt, lambda i: {"JAXPAR_FAULT_SLOW_STEP_S": "0.1"})


def test_killed_peer_is_named_within_the_timeout(dataset, tmp_path):
    """kill -9 of process 1 after step 3.

    Process 0 leaves with one line naming it and the last checkpoint (step 2), within run.peer_timeout_s; that
    checkpoint restores on one process.
    """
    run_dir = tmp_path / "run"
    args = ["--mesh", "dp=2,tp=2", "train.steps=6", "checkpoint.every=2", "run.peer_timeout_s=10"]
    procs = start_two(run_dir, dataset, args, lambda i: {"JAXPAR_FAULT_KILL_AFTER_STEP": "3"} if i else {})
    try:
        procs[1].wait(timeout=120)
    except subprocess.TimeoutExpired:
        finish(procs, timeout=1)  # kills both
        raise
    t0 = time.monotonic()
    rcs, outs = finish(procs, timeout=60)
    assert rcs[1] == -signal.SIGKILL and rcs[0] == 3 and time.monotonic() - t0 < 10, outs
    errors = [line for line in outs[0].splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "process 1 of 2 did not answer" in errors[0], outs[0]
    assert f"the last checkpoint is step 2 in {run_dir}/checkpoints" in errors[0]
    assert not any(a in outs[0] for a in ("Abort", "core dumped", "Check failure")), outs[0]
    assert "INFO:absl" not in outs[0] + outs[1]  # library logs only with run.debug=true:
    resumed = run_cli(run_dir, dataset, *args, "run.debug=true")
    assert resumed.returncode == 0 and f"resumed from {run_dir}/checkpoints/2" in resumed.stderr, resumed.stderr
    assert "INFO:absl" in resumed.stderr and "CheckpointManager" in resumed.stderr
