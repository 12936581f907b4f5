"""Two local CPU processes (2 simulated devices each) form one dp=2,tp=2 mesh via jax.distributed, and stop
together, saving one checkpoint, when only one of them is signalled."""
import os
import subprocess
import sys

import numpy as np

from tests.helpers import ROOT, TINY, free_port, metrics, run_cli


def two_processes(run_dir, dataset, args, env_of=lambda i: {}):
    """`python -m jaxpar.train` as processes 0 and 1 of one jax.distributed job on loopback."""
    port = free_port()
    cmd = [sys.executable, "-m", "jaxpar.train", *TINY, f"data.dataset={dataset}", f"run.dir={run_dir}", *args]
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={
        **os.environ, "JAX_PLATFORMS": "cpu", "JAXPAR_COORDINATOR": f"127.0.0.1:{port}",
        "JAXPAR_NUM_PROCESSES": "2", "JAXPAR_PROCESS_ID": str(i), **env_of(i)}) for i in range(2)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [p.returncode for p in procs], outs


def test_two_processes_reproduce_one_process(dataset, tmp_path):
    args = ["--mesh", "dp=2,tp=2", "train.steps=6", "checkpoint.every=3", "train.eval_every=3"]
    single = run_cli(tmp_path / "one", dataset, *args)
    assert single.returncode == 0, single.stderr
    rcs, outs = two_processes(tmp_path / "two", dataset, args)
    assert rcs == [0, 0], outs
    assert "4 cpu devices" in outs[0] and "step 6/6" in outs[0]
    assert "step 6/6" not in outs[1]  # progress from process 0 only
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    np.testing.assert_allclose([two[s]["loss"] for s in range(1, 7)], [one[s]["loss"] for s in range(1, 7)], rtol=1e-5)
    np.testing.assert_allclose(two[6]["eval_loss"], one[6]["eval_loss"], rtol=1e-5)
    assert sorted(os.listdir(tmp_path / "two" / "checkpoints")) == ["3", "6"]
    # SIGTERM to process 1 only, after step 2: both stop after step 2, save that one checkpoint together
    # and exit 0; resuming on both continues the uninterrupted run.
    stopped = tmp_path / "stopped"
    rcs, outs = two_processes(stopped, dataset, [*args[:3], "checkpoint.every=0"],
                              lambda i: {"JAXPAR_FAULT_SIGTERM_AFTER_STEP": "2"} if i == 1 else {})
    assert rcs == [0, 0] and "stopped by signal" in outs[0] + outs[1], outs
    assert os.listdir(stopped / "checkpoints") == ["2"]
    rcs, outs = two_processes(stopped, dataset, args)
    assert rcs == [0, 0], outs
    again = metrics(stopped)
    np.testing.assert_allclose([again[s]["loss"] for s in range(3, 7)], [one[s]["loss"] for s in range(3, 7)], rtol=1e-5)

