"""A run resumed with other settings acts on them (DESIGN.md 9).

Stopped after step 4 and resumed with every key that shapes the learning-rate schedule or the update changed
(runs.CHANGED: train.steps, optim.lr, min_lr, weight decay, betas, eps, grad_clip), each DCP backend is jaxpar's run
given the same change, and its lr the schedule of the settings in force at each step. A checkpoint's copy of a setting
(torch's param_groups, a scheduler's state, a loss scaler's rules) never wins over the config; the notes saying what
changed are printed once. DeepSpeed's resumes with the same change: tests/torchpar/test_deepspeed.py.
"""

import shutil

import pytest

from tests.helpers import metrics
from tests.torchpar.runs import CHANGED, STOP, assert_changed_run, assert_notes_once, run


@pytest.fixture(scope="module")
def stopped(base):
    """A one-process run of the tiny config stopped by SIGTERM after step STOP.

    Its DCP checkpoint loads into every DCP backend on any number of processes.
    """
    run_dir = base["tmp"] / "changed-stopped"
    run(["--backend", "none", *base["args"], f"run.dir={run_dir}"], TORCHPAR_FAULT_SIGTERM_AFTER_STEP=str(STOP))
    assert max(metrics(run_dir)) == STOP
    return run_dir


@pytest.mark.parametrize("backend,nproc", [("none", 0), ("ddp", 2), ("fsdp", 2), ("pipeline", 2)])
def test_a_resume_acts_on_changed_settings(backend, nproc, base, stopped, changed_reference):
    run_dir = base["tmp"] / f"changed-{backend}"
    shutil.copytree(stopped, run_dir)
    out = run(["--backend", backend, *base["args"], *CHANGED, f"run.dir={run_dir}"], nproc=nproc)
    assert "resumed from" in out.stderr
    assert_notes_once(out)
    assert_changed_run(metrics(run_dir), changed_reference)


def test_float16_scaler_takes_its_rules_from_the_config(base):
    """The loss scaler's state (its scale, the clean steps counted) resumes from meta.json.

    Its rules are the config's. optim.loss_scale_growth_interval 1000 -> 1 on resume: the scale doubles after every
    clean step from then on (GradScaler's rule; the record is the scale the step used), where the saved interval
    would hold it.
    """
    run_dir = base["tmp"] / "changed-fp16-rules"
    args = [
        "--backend",
        "none",
        *base["args"],
        "model.compute_dtype=float16",
        "optim.loss_scale_init=1024",
        f"run.dir={run_dir}",
    ]
    run(args + ["train.steps=2", "optim.loss_scale_growth_interval=1000"])
    run(args + ["train.steps=5", "optim.loss_scale_growth_interval=1"])
    m = metrics(run_dir)
    assert [m[s]["skipped_steps"] for s in range(1, 6)] == [0] * 5
    assert [m[s]["loss_scale"] for s in range(1, 6)] == [1024, 1024, 1024, 2048, 4096]
