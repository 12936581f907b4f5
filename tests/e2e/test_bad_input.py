"""Bad input: one line naming the problem, exit code 2, nothing already saved lost."""

import errno
import importlib.util
import os
import re
import resource
import shutil
import signal
import subprocess
import sys

import pytest

from tests.helpers import ROOT, TINY, metrics, run_cli


def assert_one_line_error(r, *phrases):
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2, r.stderr
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    for phrase in phrases:
        assert phrase in errors[0], errors[0]


CASES = {
    "mesh_vs_devices": (["--mesh", "dp=3"], {"JAXPAR_CPU_DEVICES": "8"}, ["3 devices", "8 are available"]),
    "mesh_vs_xla_flags": (
        ["--mesh", "dp=4,tp=4"],
        {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
        ["the mesh dp=4,tp=4 needs 16 devices", "--xla_force_host_platform_device_count=8"],
    ),
    "heads_vs_tp": (["--mesh", "tp=8"], {}, ["n_head=4", "tp=8"]),
    "batch_vs_data_axes": (["--mesh", "dp=3"], {}, ["global_batch_size=8", "dp*fsdp*ep=3"]),
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
    "top_k_above_experts": (["model.moe_experts=4", "model.moe_top_k=5"], {}, ["moe_top_k=5", "moe_experts=4"]),
    "experts_vs_ep": (["--mesh", "ep=4,dp=2", "model.moe_experts=6"], {}, ["moe_experts=6", "ep=4"]),
    "ep_without_experts": (["--mesh", "ep=2"], {}, ["ep=2", "has none"]),
    "1f1b_microbatches_below_stages": (
        ["--mesh", "pp=2", "parallel.pipeline_schedule=1f1b", "parallel.pipeline_microbatches=1"],
        {},
        ["1f1b needs microbatches >= stages"],
    ),
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
    """The run's config.json decides what a resume may change.

    A model shape never (one line, nothing touched), the step count and the learning rate yes (printed).
    """
    assert run_cli(tmp_path, dataset, "train.steps=2").returncode == 0
    before = {p: os.path.getmtime(p) for p in map(str, [tmp_path / "config.json", *tmp_path.glob("checkpoints/**/*")])}
    r = run_cli(tmp_path, dataset, "train.steps=4", "model.d_model=64", timeout=60)
    assert_one_line_error(r, "model.d_model: 32 -> 64")
    assert {p: os.path.getmtime(p) for p in before} == before
    assert sorted(os.listdir(tmp_path)) == [
        "checkpoints",
        "config.json",
        "lock",
        "metrics.jsonl",
        "progress.json",
    ]  # the first run's files, nothing new
    r = run_cli(tmp_path, dataset, "train.steps=4", "optim.lr=0.005")
    assert r.returncode == 0, r.stderr
    assert "resuming with train.steps changed: 2 -> 4" in r.stdout and "optim.lr changed: 0.01 -> 0.005" in r.stdout
    assert max(metrics(tmp_path)) == 4


@pytest.mark.parametrize("mesh", [("dp=2",), ("diloco=2", "parallel.diloco_inner_steps=3")], ids=["dp", "diloco"])
def test_non_finite_step_stops_before_it_is_saved(mesh, dataset, tmp_path):
    """A NaN at step 5 (fault hook): exit non-zero with one line naming the step.

    The checkpoints are those of the finite steps only, and metrics.jsonl holds no non-finite record. DiLoCo's groups
    (meeting after steps 3 and 6) train on their own parameters: those are made NaN too, so step 5 is the one named.
    """
    r = run_cli(
        tmp_path, dataset, "--mesh", mesh[0], *mesh[1:], "checkpoint.every=2", env={"JAXPAR_FAULT_NAN_AT_STEP": "5"}
    )
    assert_one_line_error(r, "step 5: loss nan", "last checkpoint this run wrote is step 4")
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "4"]
    assert max(metrics(tmp_path)) == 4


def test_os_errors_are_one_line_and_bugs_keep_their_traceback(capsys):
    """OS errors are one line naming the path; any other exception is a bug and keeps its traceback.

    @cli: an OSError (no space, no permission, a file where a folder must be) is one line naming the path and what the
    system said; any other exception is a bug and propagates.
    """
    from jaxpar.core.errors import cli

    def fails(e):
        raise e

    assert cli(fails)(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/data/run/x")) == 2
    assert capsys.readouterr().err == "error: /data/run/x: No space left on device\n"
    assert cli(fails)(PermissionError(errno.EACCES, os.strerror(errno.EACCES), "/etc/y")) == 2
    assert capsys.readouterr().err == "error: /etc/y: Permission denied\n"
    with pytest.raises(KeyError):
        cli(fails)(KeyError("a bug"))


@pytest.mark.parametrize("module", ["jaxpar.train", "torchpar.train"])
@pytest.mark.parametrize("below", [False, True])
def test_run_dir_naming_a_file(module, below, dataset, tmp_path):
    """run.dir is a file, or lies under one: one line naming it, and the file is left as it was."""
    (tmp_path / "notes").write_text("keep me")
    run_dir = tmp_path / "notes" / "run" if below else tmp_path / "notes"
    r = run_cli(run_dir, dataset, module=module, env={"OMP_NUM_THREADS": "1"}, timeout=120)
    assert_one_line_error(r, f"{tmp_path / 'notes'} is a file, not a directory", "run.dir")
    assert (tmp_path / "notes").read_text() == "keep me"


def test_prepare_refuses_a_jsonl_that_is_not_utf8(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    cmd = [sys.executable, "-m", "jaxpar.data", "prepare", "--out", str(tmp_path / "out.bin"), str(corpus)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert_one_line_error(r, f"{corpus}:2: not UTF-8 (byte 0xe9 at column 14)")
    assert sorted(os.listdir(tmp_path)) == ["corpus.jsonl"]  # no dataset, no temporary file


TOOL_CASES = {  # each before any measurement or run, so also fast
    "sequence_memory": (["jaxpar.tools.sequence_memory", "--devices", "0"], ["--devices"]),
    "pipeline_memory": (["jaxpar.tools.pipeline_memory", "--microbatches", "4,x"], ["--microbatches '4,x'"]),
    "jaxpar_bench_collectives": (
        ["jaxpar.tools.bench_collectives", "--max-mib", "0.004", "--json", "{file}/out.json"],
        ["--json={file}/out.json: {file} is a file"],
    ),
    "torchpar_bench_collectives": (
        ["torchpar.tools.bench_collectives", "--max-mib", "0.004", "--json", "{dir}"],
        ["--json={dir} is a directory"],
    ),
    "parity_report": (["parity_tests.report", "--steps", "1", "--out", "{file}"], ["--out={file}: {file} is a file"]),
}


@pytest.mark.parametrize("case", TOOL_CASES)
def test_tool_bad_input_is_one_line(case, tmp_path):
    (tmp_path / "f").write_text("keep me")
    paths = {"file": tmp_path / "f", "dir": tmp_path}
    args, phrases = ([a.format(**paths) for a in items] for items in TOOL_CASES[case])
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert_one_line_error(r, *phrases)
    assert os.listdir(tmp_path) == ["f"] and (tmp_path / "f").read_text() == "keep me"


def _mount_small_disk(disk) -> str | None:
    """A real filesystem of 1.5 MB (tmpfs) at `disk`.

    Room for some of the four checkpoints of an 8-step run of the tiny model (0.4 MB each from jaxpar, 1.1 MB from
    torchpar), never all. Mounting needs root in a sandbox that allows it: why not, if it cannot be had.
    """
    disk.mkdir()
    try:
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1500k", "tmpfs", str(disk)], capture_output=True, text=True
        )
    except OSError as e:
        return str(e)
    return (r.stderr.strip() or f"mount exited {r.returncode}") if r.returncode else None


@pytest.fixture
def small_disk(tmp_path):
    why_not = _mount_small_disk(tmp_path / "disk")
    if why_not:
        pytest.skip(f"cannot mount a small tmpfs here ({why_not}); test_failed_write_during_save stands in")
    try:
        yield tmp_path / "disk"
    finally:
        subprocess.run(["umount", "-l", str(tmp_path / "disk")], check=False)


STEPS = ["train.steps=8", "checkpoint.every=2"]
ONE_DEVICE = {
    "jaxpar.train": STEPS + ["--mesh", "dp=1"],
    "torchpar.train": STEPS,  # torchpar: one process
    "deepspeed": STEPS + ["--backend", "deepspeed", "parallel.zero_stage=1"],
}
MODULE = {"deepspeed": "torchpar.train"}
LEFTOVER = {"jaxpar.train": "99.orbax-checkpoint-tmp", "torchpar.train": "99.partial", "deepspeed": "99"}
QUIET_ENV = {"OMP_NUM_THREADS": "1", "JAXPAR_CPU_DEVICES": "1"}


def assert_resumes_exactly(run, dataset, module, before: dict, last: int):
    """Assert the same command resumes from checkpoint `last` and repeats the failed run's later steps exactly.

    The same command resumes from checkpoint `last` and repeats exactly the steps the failed run computed after it (that
    run had trained on from its state in memory: an uninterrupted trajectory).
    """
    r = run_cli(run, dataset, *ONE_DEVICE[module], module=MODULE.get(module, module), env=QUIET_ENV)
    assert r.returncode == 0, r.stderr
    said = [line for line in r.stderr.splitlines() if "without a launcher runs as one process" not in line]
    assert f"resumed from {run}/checkpoints/{last}" in r.stderr and len(said) == 1, r.stderr  # torchpar's note aside
    after, repeated = metrics(run), [s for s in before if s > last]
    assert repeated and max(after) == 8
    for step in repeated:
        assert (after[step]["loss"], after[step]["grad_norm"]) == (before[step]["loss"], before[step]["grad_norm"])


def failed_save(r, run, reason: str) -> int:
    """Check the one-line report of a failed save and return the last complete checkpoint's step.

    One line naming the failed step and the last complete checkpoint (returned), the partial save removed and the
    complete ones kept.
    """
    assert_one_line_error(r, f"could not be written: {reason}; its partial files were removed")
    failed, last = map(
        int,
        re.search(
            r"checkpoint of step (\d+) .*last complete checkpoint is step (\d+) in "
            + re.escape(str(run / "checkpoints")),
            r.stderr,
        ).groups(),
    )
    assert last == failed - 2
    steps = [d for d in os.listdir(run / "checkpoints") if d[:1].isdigit()]  # (deepspeed: also "latest", scripts)
    assert sorted(steps) == sorted(str(s) for s in range(2, last + 1, 2))
    return last


@pytest.mark.parametrize("module", ["jaxpar.train", "torchpar.train", "deepspeed"])
def test_disk_full_during_save(module, dataset, small_disk):
    """The disk fills during a save; once space is freed, the same command resumes exactly."""
    run = small_disk / "run"
    r = run_cli(run, dataset, *ONE_DEVICE[module], module=MODULE.get(module, module), env=QUIET_ENV)
    last, before = failed_save(r, run, "No space left on device"), metrics(run)
    subprocess.run(["mount", "-o", "remount,size=16m", str(small_disk)], check=True)  # space freed
    # and a partial save as a process killed while saving leaves it: the next start removes it, saying nothing
    leftover = run / "checkpoints" / LEFTOVER[module]
    leftover.mkdir()
    (leftover / "shard").write_bytes(b"partial")
    assert_resumes_exactly(run, dataset, module, before, last)
    assert not leftover.exists()


def test_failed_write_during_save(dataset, tmp_path):
    """Where no small disk can be mounted.

    The same failing write from a limit on the size of a file (RLIMIT_FSIZE, below a checkpoint's data file, above
    the logs), set after step 2's checkpoint is complete.
    """
    if not _mount_small_disk(tmp_path / "disk"):
        subprocess.run(["umount", "-l", str(tmp_path / "disk")], check=False)
        pytest.skip("test_disk_full_during_save fills a real disk here")
    run = tmp_path / "run"
    r = run_cli(run, dataset, *ONE_DEVICE["jaxpar.train"], env={**QUIET_ENV, "JAXPAR_FAULT_KILL_AFTER_STEP": "2"})
    assert r.returncode == -signal.SIGKILL and os.listdir(run / "checkpoints") == ["2"], r.stderr
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxpar.train",
            *TINY,
            f"data.dataset={dataset}",
            f"run.dir={run}",
            *ONE_DEVICE["jaxpar.train"],
        ],
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu", **QUIET_ENV},
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limit,
    )
    last, before = failed_save(r, run, "File too large"), metrics(run)
    assert last == 2
    assert_resumes_exactly(run, dataset, "jaxpar.train", before, last)
