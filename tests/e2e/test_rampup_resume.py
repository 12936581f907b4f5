"""train.batch_rampup across a SIGKILL.

The run resumed mid-ramp on another mesh reads on from the samples the killed run had read, at the batch sizes of the
schedule.
"""

import signal

import numpy as np

from tests.helpers import make_dataset, metrics, run_cli

RAMP = ["train.batch_rampup=2,2,24", "train.steps=8", "checkpoint.every=1"]


def test_a_run_killed_mid_ramp_resumes_on_another_mesh(tmp_path):
    dataset = make_dataset(tmp_path / "d.bin")
    full = run_cli(tmp_path / "full", dataset, *RAMP, "--mesh", "dp=2")
    assert full.returncode == 0, full.stderr
    killed = run_cli(tmp_path / "k", dataset, *RAMP, "--mesh", "dp=2", env={"JAXPAR_FAULT_KILL_AFTER_STEP": "5"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = run_cli(tmp_path / "k", dataset, *RAMP, "--mesh", "fsdp=2")
    assert resumed.returncode == 0 and "resumed from" in resumed.stderr, resumed.stderr
    m, r = metrics(tmp_path / "full"), metrics(tmp_path / "k")
    # 2 -> 8 by 2 over 24 samples: one increment per 8 samples read (after 0,2,4,6 | 8,12 | 16,22 | 28)
    assert (
        [m[s]["batch_size"] for s in sorted(m)] == [r[s]["batch_size"] for s in sorted(r)] == [2, 2, 2, 2, 4, 4, 6, 6]
    )
    # the losses exactly: fsdp=2 adds the same two halves of each gradient as dp=2 (on a mesh of another size,
    # e.g. dp=1, float32 sums in another order and they differ in their last digits); the gradient norm is
    # summed over fsdp's shards in another order than over dp's whole copies
    assert [r[s]["loss"] for s in sorted(r)] == [m[s]["loss"] for s in sorted(m)]
    np.testing.assert_allclose(
        [r[s]["grad_norm"] for s in sorted(r)], [m[s]["grad_norm"] for s in sorted(m)], rtol=1e-6
    )
