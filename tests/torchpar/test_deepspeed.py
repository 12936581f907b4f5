"""torchpar --backend deepspeed checkpoints: resume after SIGKILL, and on another number of ranks (through
DeepSpeed's universal checkpoint)."""
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


@pytest.mark.parametrize("stage,nproc", [(2, 0), (3, 0), pytest.param(2, 4, marks=pytest.mark.slow),
                                         pytest.param(3, 4, marks=pytest.mark.slow)])
def test_deepspeed_resumes_on_another_number_of_ranks(stage, nproc, base, reference):
    """A ZeRO checkpoint of 2 ranks resumes on 1 (or 4) through DeepSpeed's universal checkpoint: the same run as
    one process (ZeRO-3: with the loader's two slips repaired, deepspeed_universal.repair_zero3_load), and the
    converted copy gone once loaded."""
    run_dir = base["tmp"] / f"ds-reshard-{stage}-{nproc}"
    args = ["--backend", "deepspeed", *base["args"], f"parallel.zero_stage={stage}", "checkpoint.every=4",
            f"run.dir={run_dir}"]
    run(args, nproc=2, expect_rc="nonzero", TORCHPAR_FAULT_KILL_AFTER_STEP="6")
    out = run(args, nproc=nproc)
    assert "written by 2 ranks; converting it to DeepSpeed's universal format" in out.stderr
    assert "resumed from" in out.stderr and "MPU" not in out.stdout + out.stderr  # DeepSpeed's warning kept quiet
    assert_same_run(metrics(run_dir), reference)
    assert not (run_dir / "checkpoints" / "universal").exists()
