"""torchpar --backend deepspeed checkpoints.

Resume after SIGKILL, and on another number of ranks (through DeepSpeed's universal checkpoint), each with the settings
changed on resume (runs.CHANGED: the schedule's keys, weight decay, betas, eps, clipping), so the run must be jaxpar's
given the same change (`changed_reference`): what DeepSpeed restores of a setting (its scheduler's state, the
optimizer's param_groups, the clipping threshold, the loss scaler's rules) never wins over the config.
"""

import subprocess
import sys

import pytest

from tests.helpers import ROOT, deepspeed_cpu_has_float16, metrics, torch_env
from tests.torchpar.runs import CHANGED, STOP, assert_changed_run, assert_notes_once, assert_same_run, run


@pytest.mark.parametrize("stage", [3, 1, 2])
def test_deepspeed_resume_after_sigkill(stage, base, changed_reference):
    """DeepSpeed resumes exactly after SIGKILL with other settings.

    ZeRO-3 with DeepSpeed's own gradient accumulation (2 microbatches), killed after step 6 and resumed from its step-4
    checkpoint with other settings.
    """
    run_dir = base["tmp"] / f"ds-killed-{stage}"
    args = [
        "--backend",
        "deepspeed",
        *base["args"],
        f"parallel.zero_stage={stage}",
        "train.microbatches=2",
        f"checkpoint.every={STOP}",
        f"run.dir={run_dir}",
    ]
    run(args, nproc=2, expect_rc="nonzero", TORCHPAR_FAULT_KILL_AFTER_STEP="6")
    assert max(metrics(run_dir)) == 6
    out = run(args + CHANGED, nproc=2)
    assert "resumed from" in out.stderr
    assert_notes_once(out)
    assert_changed_run(metrics(run_dir), changed_reference)


@pytest.mark.parametrize("stage,nproc", [(2, 0), (3, 0), (1, 0), (2, 4), (3, 4)])
def test_deepspeed_resumes_on_another_number_of_ranks(stage, nproc, base, changed_reference):
    """A ZeRO checkpoint of 2 ranks resumes on 1 (or 4) through DeepSpeed's universal checkpoint, with other settings.

    jaxpar's run given the same change (ZeRO-3: with the loader's slip repaired,
    deepspeed_universal.repair_zero3_load), and the converted copy gone once loaded.
    """
    run_dir = base["tmp"] / f"ds-reshard-{stage}-{nproc}"
    args = [
        "--backend",
        "deepspeed",
        *base["args"],
        f"parallel.zero_stage={stage}",
        f"checkpoint.every={STOP}",
        f"run.dir={run_dir}",
    ]
    run(args, nproc=2, expect_rc="nonzero", TORCHPAR_FAULT_KILL_AFTER_STEP="6")
    out = run(args + CHANGED, nproc=nproc)
    assert "written by 2 ranks; converting it to DeepSpeed's universal format" in out.stderr
    assert "resumed from" in out.stderr and "MPU" not in out.stdout + out.stderr  # DeepSpeed's warning kept quiet
    assert_changed_run(metrics(run_dir), changed_reference)
    assert not (run_dir / "checkpoints" / "universal").exists()


@pytest.mark.parametrize("saved,resumed,nproc", [(0, 1, 4), (1, 3, 2), (3, 2, 4)])
def test_a_checkpoint_resumes_only_at_a_stage_of_its_layout(saved, resumed, nproc, base, reference, tmp_path):
    """DeepSpeed loads a checkpoint only at a stage of its layout (0; 1 or 2; 3).

    At another, a missing file or an assertion inside DeepSpeed (the transition fuzzer's seeds 2141981325 and
    1110493062). One line, nothing trained or saved. Stage 0 resumes at stage 0 on 4 ranks; the conversion the line
    names moves the run (ZeRO-1 -> 3, on 4 ranks), which goes on as the one-process run.
    """
    run_dir = base["tmp"] / f"ds-layout-{saved}-{resumed}"
    args = ["--backend", "deepspeed", *base["args"], f"checkpoint.every={STOP}", f"run.dir={run_dir}"]
    run([*args, f"parallel.zero_stage={saved}"], nproc=2, expect_rc="nonzero", TORCHPAR_FAULT_KILL_AFTER_STEP=str(STOP))
    out = run([*args, f"parallel.zero_stage={resumed}"], nproc=nproc, expect_rc="nonzero")
    errors = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("error:")]
    assert errors and all(
        f"written at ZeRO stage {saved}, and DeepSpeed loads it only at" in e and f"--zero-stage {resumed} NEW_DIR" in e
        for e in errors
    ), out.stderr[-3000:]
    assert sorted(metrics(run_dir)) == list(range(1, STOP + 1))
    if saved == 0:  # stage 0's whole optimizer: at its own stage on any number of ranks
        assert "resumed from" in run([*args, "parallel.zero_stage=0"], nproc=4).stderr
    if resumed == 3:
        moved = tmp_path / "moved"
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "jaxpar.tools.convert",
                "--from",
                "torchpar",
                str(run_dir),
                "--to",
                "deepspeed",
                "--zero-stage",
                "3",
                str(moved),
            ],
            cwd=ROOT,
            env=torch_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr[-2000:]
        run(["--backend", "deepspeed", "--config", str(moved / "config.json")], nproc=4)
        assert_same_run(metrics(moved), reference, steps=range(STOP + 1, 11))


def test_the_layout_check_reads_the_engines_stage_not_only_the_key(tmp_path):
    """A user's DeepSpeed JSON may set zero_optimization.stage over parallel.zero_stage (docs/torchpar.md).

    A ZeRO-3 checkpoint resumes under a JSON of stage 3 with the key left at 0, and is refused under one of stage 1;
    a damaged model-states file is one line.
    """
    import types

    import torch

    from jaxpar.core.errors import UserError
    from tests.helpers import tiny_config
    from torchpar.backends.deepspeed_universal import universal_source

    step = tmp_path / "checkpoints" / "4"
    step.mkdir(parents=True)
    (step.parent / "latest").write_text("4")
    torch.save(
        {"ds_config": {"zero_optimization": {"stage": 3}}, "dp_world_size": 2},
        step / "zero_pp_rank_0_mp_rank_00_model_states.pt",
    )
    cfg, env = tiny_config(f"run.dir={tmp_path}"), types.SimpleNamespace(world=2, is_main=True)
    assert cfg.parallel.zero_stage == 0 and universal_source(cfg, env, 3) is None
    with pytest.raises(UserError, match="written at ZeRO stage 3, and DeepSpeed loads it only at stage 3, not 1"):
        universal_source(cfg, env, 1)
    (step / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="model_states.pt could not be read"):
        universal_source(cfg, env, 3)


def test_deepspeed_loss_scaler_takes_its_rules_from_the_config(base):
    """float16: DeepSpeed unpickles the saved loss scaler whole.

    Its scale and counters resume, its rules are the config's. optim.loss_scale_growth_interval 1000 -> 1 on resume:
    the scale doubles after every clean step from then on (DynamicLossScaler's rule; the record is the scale after
    the step), where the saved window held it.
    """
    if not deepspeed_cpu_has_float16():  # the refusal is tests/jaxpar/test_float16.py's, which runs here then
        pytest.skip("this CPU has no oneDNN float16 kernels: DeepSpeed's CPU accelerator refuses float16")
    run_dir = base["tmp"] / "ds-fp16-rules"
    args = [
        "--backend",
        "deepspeed",
        *base["args"],
        "parallel.zero_stage=2",
        "model.compute_dtype=float16",
        "optim.loss_scale_init=1024",
        f"run.dir={run_dir}",
    ]
    run(args + ["train.steps=2", "optim.loss_scale_growth_interval=1000"])
    run(args + ["train.steps=5", "optim.loss_scale_growth_interval=1"])
    m = metrics(run_dir)
    assert [m[s]["skipped_steps"] for s in range(1, 6)] == [0] * 5
    assert [m[s]["loss_scale"] for s in range(1, 6)] == [1024, 1024, 2048, 4096, 8192]
