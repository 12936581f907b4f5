"""Two local CPU processes (2 simulated devices each) form one dp=2,tp=2 mesh via jax.distributed."""
import os
import subprocess
import sys

import numpy as np

from tests.helpers import ROOT, TINY, free_port, metrics, run_cli


def test_two_processes_reproduce_one_process(dataset, tmp_path):
    args = ["--mesh", "dp=2,tp=2", "train.steps=6", "checkpoint.every=3", "train.eval_every=3"]
    single = run_cli(tmp_path / "one", dataset, *args)
    assert single.returncode == 0, single.stderr

    port = free_port()
    cmd = [sys.executable, "-m", "jaxpar.train", *TINY, f"data.dataset={dataset}", f"run.dir={tmp_path / 'two'}", *args]
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={
        **os.environ, "JAX_PLATFORMS": "cpu", "JAXPAR_COORDINATOR": f"127.0.0.1:{port}",
        "JAXPAR_NUM_PROCESSES": "2", "JAXPAR_PROCESS_ID": str(i)}) for i in range(2)]
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "4 cpu devices" in outs[0] and "step 6/6" in outs[0]
    assert "step 6/6" not in outs[1]  # progress from process 0 only
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    np.testing.assert_allclose([two[s]["loss"] for s in range(1, 7)], [one[s]["loss"] for s in range(1, 7)], rtol=1e-5)
    np.testing.assert_allclose(two[6]["eval_loss"], one[6]["eval_loss"], rtol=1e-5)
    assert sorted(os.listdir(tmp_path / "two" / "checkpoints")) == ["3", "6"]
