"""Bad input: one line naming the problem, exit code 2, nothing already saved lost."""
import importlib.util
import os
import shutil

import pytest

from tests.helpers import metrics, run_cli


def assert_one_line_error(r, *phrases):
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2, r.stderr
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    for phrase in phrases:
        assert phrase in errors[0], errors[0]


CASES = {
    "mesh_vs_devices": (["--mesh", "dp=3"], {"JAXPAR_CPU_DEVICES": "8"}, ["3 devices", "8 are available"]),
    "heads_vs_tp": (["--mesh", "tp=8"], {}, ["n_head=4", "tp=8"]),
    "batch_vs_data_axes": (["--mesh", "dp=3"], {}, ["global_batch_size=8", "dp*fsdp=3"]),
    "unknown_key": (["model.n_layers=3"], {}, ["model.n_layers"]),
    "bad_value": (["optim.lr=-1"], {}, ["optim.lr", "out of range"]),
    "bad_mesh_axis": (["--mesh", "xp=2"], {}, ["xp=2"]),
    "layers_vs_pp": (["--mesh", "pp=4", "model.n_layer=2"], {}, ["n_layer=2", "stages x virtual stages = 4"]),
    "non_finite_value": (["optim.lr=nan"], {}, ["optim.lr", "not a finite number"]),
    "infinite_value": (["optim.weight_decay=inf"], {}, ["optim.weight_decay", "not a finite number"]),
    "removed_dropout": (["model.dropout=0.5"], {}, ["model.dropout was removed"]),
    "impossible_mesh": (["--mesh", "dp=100000"], {}, ["dp=100000", "100000 devices"]),  # at once, not a hang
    "compile_off": (["train.compile=off"], {}, ["train.compile=off", "always compiled by XLA"]),
    "tracker_not_installed": (["run.wandb=offline"], {}, ["run.wandb=offline needs the wandb package"]),
    "1f1b_microbatches_below_stages": (["--mesh", "pp=2", "parallel.pipeline_schedule=1f1b", "parallel.pipeline_microbatches=1"],
                                       {}, ["1f1b needs microbatches >= stages"]),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line(case, dataset, tmp_path):
    if case == "tracker_not_installed" and importlib.util.find_spec("wandb"):
        pytest.skip("wandb is installed here")
    args, env, phrases = CASES[case]
    assert_one_line_error(run_cli(tmp_path, dataset, *args, env=env), *phrases)


def test_missing_data_file(tmp_path):
    assert_one_line_error(run_cli(tmp_path, tmp_path / "nope.bin"), "nope.bin")


def _corrupt(step_dir):
    for root, _, files in os.walk(step_dir):
        for name in files:
            with open(os.path.join(root, name), "wb") as f:
                f.write(b"garbage")


def test_corrupt_checkpoint(dataset, tmp_path):
    ok = run_cli(tmp_path, dataset, "--mesh", "dp=2", "train.steps=4", "checkpoint.every=2")
    assert ok.returncode == 0, ok.stderr
    ckpts = tmp_path / "checkpoints"
    assert sorted(os.listdir(ckpts)) == ["2", "4"]
    saved = {}
    for step in ("2", "4"):
        _corrupt(ckpts / step)
        saved[step] = sorted(os.listdir(ckpts / step))
    # No loadable checkpoint: stop with one line, touch nothing.
    r = run_cli(tmp_path, dataset, "--mesh", "dp=2", "train.steps=6", "checkpoint.every=2")
    assert_one_line_error(r, "no checkpoint", "could be loaded")
    assert {s: sorted(os.listdir(ckpts / s)) for s in ("2", "4")} == saved


def test_unreadable_latest_falls_back_to_previous(dataset, tmp_path):
    ok = run_cli(tmp_path, dataset, "--mesh", "dp=2", "train.steps=4", "checkpoint.every=2")
    assert ok.returncode == 0, ok.stderr
    ckpts = tmp_path / "checkpoints"
    _corrupt(ckpts / "4")
    r = run_cli(tmp_path, dataset, "--mesh", "dp=2", "train.steps=6", "checkpoint.every=2")
    assert r.returncode == 0, r.stderr
    assert "failed to load" in r.stderr and "resumed from" in r.stderr
    assert "4.unreadable" in os.listdir(ckpts)  # set aside, not deleted
    assert max(metrics(tmp_path)) == 6
    shutil.rmtree(ckpts)


def test_resume_refuses_another_model_shape_and_allows_other_changes(dataset, tmp_path):
    """The run's config.json decides what a resume may change: a model shape never (one line, nothing
    touched), the step count and the learning rate yes (printed)."""
    assert run_cli(tmp_path, dataset, "train.steps=2").returncode == 0
    before = {p: os.path.getmtime(p) for p in map(str, [tmp_path / "config.json", *tmp_path.glob("checkpoints/**/*")])}
    r = run_cli(tmp_path, dataset, "train.steps=4", "model.d_model=64", timeout=60)
    assert_one_line_error(r, "model.d_model: 32 -> 64")
    assert {p: os.path.getmtime(p) for p in before} == before
    assert sorted(os.listdir(tmp_path)) == ["checkpoints", "config.json", "metrics.jsonl"]
    r = run_cli(tmp_path, dataset, "train.steps=4", "optim.lr=0.005")
    assert r.returncode == 0, r.stderr
    assert "resuming with train.steps changed: 2 -> 4" in r.stdout and "optim.lr changed: 0.01 -> 0.005" in r.stdout
    assert max(metrics(tmp_path)) == 4


def test_non_finite_step_stops_before_it_is_saved(dataset, tmp_path):
    """A NaN at step 5 (fault hook): exit non-zero with one line naming the step; the checkpoints
    are those of the finite steps only, and metrics.jsonl holds no non-finite record."""
    r = run_cli(tmp_path, dataset, "--mesh", "dp=2", "checkpoint.every=2", env={"JAXPAR_FAULT_NAN_AT_STEP": "5"})
    assert_one_line_error(r, "step 5: loss nan", "last checkpoint this run wrote is step 4")
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "4"]
    assert max(metrics(tmp_path)) == 4

