"""torchpar --backend deepspeed checkpoints: resume after SIGKILL, and on another number of ranks (ZeRO-1/2 through
DeepSpeed's universal checkpoint; ZeRO-3 refused in one line)."""
import os

import pytest

from tests.helpers import metrics
from tests.torchpar.runs import assert_same_run, run


def test_deepspeed_resume_after_sigkill(base, reference):
    """ZeRO-3 with DeepSpeed's own gradient accumulation (2 microbatches), killed after step 6."""
    run_dir = base["tmp"] / "ds-killed"
    args = ["--backend", "deepspeed", *base["args"], "parallel.zero_stage=3", "train.microbatches=2",
            "checkpoint.every=4", f"run.dir={run_dir}"]
    run(args, nproc=2, expect_rc="nonzero", TORCHPAR_FAULT_KILL_AFTER_STEP="6")
    assert max(metrics(run_dir)) == 6
    out = run(args, nproc=2)
    assert "resumed from" in out.stderr
    assert_same_run(metrics(run_dir), reference)


@pytest.mark.parametrize("stage,nproc", [(2, 0), pytest.param(1, 4, marks=pytest.mark.slow)])
def test_deepspeed_resumes_on_another_number_of_ranks(stage, nproc, base, reference):
    """A ZeRO-1/2 checkpoint of 2 ranks resumes on 1 (or 4) through DeepSpeed's universal checkpoint: the same run
    as one process, and the converted copy gone once loaded."""
    run_dir = base["tmp"] / f"ds-reshard-{stage}"
    args = ["--backend", "deepspeed", *base["args"], f"parallel.zero_stage={stage}", "checkpoint.every=4",
            f"run.dir={run_dir}"]
    run(args, nproc=2, expect_rc="nonzero", TORCHPAR_FAULT_KILL_AFTER_STEP="6")
    out = run(args, nproc=nproc)
    assert "written by 2 ranks; converting it to DeepSpeed's universal format" in out.stderr
    assert "resumed from" in out.stderr and "MPU" not in out.stdout + out.stderr  # DeepSpeed's warning kept quiet
    assert_same_run(metrics(run_dir), reference)
    assert not (run_dir / "checkpoints" / "universal").exists()


def test_deepspeed_zero3_on_another_number_of_ranks_is_refused(base):
    run_dir = base["tmp"] / "ds-reshard-3"
    args = ["--backend", "deepspeed", *base["args"], "parallel.zero_stage=3", f"run.dir={run_dir}"]
    run([*args, "train.steps=2"], nproc=2)
    saved = sorted(os.listdir(run_dir / "checkpoints"))
    out = run([*args, "train.steps=4"], expect_rc="nonzero")
    lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "ZeRO-3 checkpoint of step 2 was written by 2 ranks and resumes on 2 only" in lines[0]
    assert sorted(os.listdir(run_dir / "checkpoints")) == saved  # nothing converted, nothing removed
