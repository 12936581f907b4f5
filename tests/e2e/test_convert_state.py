"""A run goes on in the other framework.

The whole training state (parameters, Adam's moments and count, the step) through the shared training-state file
(jaxpar/core/weights/state_file.py). jaxpar dp=2,tp=4 trains steps 1-10, torchpar fsdp on 2 processes 11-20; torchpar
ddp on 2 processes 1-10, jaxpar fsdp=4 11-20; jaxpar dp=2 1-10, DeepSpeed ZeRO-2 on 2 processes 11-20 (and DeepSpeed
ZeRO-3 1-10, jaxpar 11-20): each as its uninterrupted run. With optim.name=muon (Muon's momentum and count too): jaxpar
dp=2,tp=2 1-10, torchpar fsdp on 2 processes and jaxpar fsdp=4 11-20; torchpar ddp on 2 processes 1-10, jaxpar
fsdp=2,tp=2 11-20.
"""

import json
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxpar.core.optimizer import muon
from jaxpar.core.errors import UserError
from jaxpar.core.weights.state_file import read_state, refuse_other_optimizer, save_state
from jaxpar.tools import convert as jaxpar_convert

from tests.helpers import (
    ROOT,
    TINY,
    make_dataset,
    metrics,
    run_cli,
    run_in_session,
    tiny_config,
    torch_command,
    torch_env,
)

# the parity configs' optimizer (lr 3e-3, eps 1e-6): at the tiny config's lr 1e-2 and eps 1e-8 Adam amplifies float32
# rounding between the frameworks to 3e-5 in the parameters after 20 steps (docs/fuzz.md explains the eps)
ARGS = [
    "train.steps=20",
    "checkpoint.every=0",
    "train.eval_every=0",
    "optim.lr=3e-3",
    "optim.min_lr=3e-4",
    "optim.eps=1e-6",
]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("convert-state") / "tokens.bin")


def convert(module: str, *args: str) -> None:
    r = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, env=torch_env(), capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0 and "converted the training state of step 10" in r.stdout, r.stderr[-2000:]


def torchpar(args: list[str], nproc: int, **env) -> None:
    r = run_in_session(torch_command(args, nproc), torch_env(**env), 300, f"torchpar {args}")
    assert r.returncode == 0, r.stderr[-3000:]


def jaxpar_resumes(run_dir, mesh: str) -> None:
    """`jaxpar.train --config RUN/config.json --mesh M`: the moved run goes on from its checkpoint."""
    r = subprocess.run(
        [sys.executable, "-m", "jaxpar.train", "--config", str(run_dir / "config.json"), "--mesh", mesh],
        cwd=ROOT,
        env=torch_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0 and "resumed from" in r.stderr, r.stderr[-2000:]


def assert_continues(got: dict, ref: dict) -> float:
    """Steps 11-20 of the moved run as the uninterrupted run's (1e-5 relative); -> the largest difference."""
    assert sorted(got) == list(range(11, 21)), sorted(got)
    np.testing.assert_allclose([got[s]["loss"] for s in got], [ref[s]["loss"] for s in got], rtol=1e-5)
    return max(abs(got[s]["loss"] / ref[s]["loss"] - 1) for s in got)


def assert_same_weights(a_path, b_path) -> None:
    """Two weights files within the parity suite's float32 bound (1e-5 relative norm)."""
    a, b = load_file(a_path), load_file(b_path)
    diff = np.sqrt(sum(np.sum((a[k] - b[k]) ** 2) for k in a)) / np.sqrt(sum(np.sum(v**2) for v in a.values()))
    assert diff < 1e-5, diff


def test_jaxpar_to_torchpar(data, tmp_path):
    """...

    and the final parameters within the parity suite's float32 bound (1e-5 relative norm); the moved run's config is
    the source's, so resuming it with another model or dataset is one line, nothing touched.
    """
    full, half, moved = tmp_path / "full", tmp_path / "half", tmp_path / "moved"
    assert run_cli(full, data, "--mesh", "dp=2,tp=4", *ARGS, "--write-final", str(tmp_path / "a.st")).returncode == 0
    r = run_cli(half, data, "--mesh", "dp=2,tp=4", *ARGS, env={"JAXPAR_FAULT_SIGTERM_AFTER_STEP": "10"})
    assert r.returncode == 0, r.stderr[-2000:]
    convert("jaxpar.tools.convert", "--from", "jaxpar", str(half), "--to", "torchpar", str(moved))  # one command
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("tmp")] == []  # its state file is gone
    saved = sorted(p.name for p in (moved / "checkpoints").iterdir())
    other = ["--backend", "none", "--config", str(moved / "config.json"), "model.n_layer=3", "data.dataset=other.bin"]
    refused = run_in_session(torch_command(other, 0), torch_env(), 120, "torchpar with another model and data")
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert refused.returncode == 2 and len(errors) == 1, refused.stderr
    assert "was started with another model.n_layer/data.dataset" in errors[0], errors
    assert sorted(p.name for p in (moved / "checkpoints").iterdir()) == saved
    torchpar(
        ["--backend", "fsdp", "--config", str(moved / "config.json"), "--write-final", str(tmp_path / "b.st")], nproc=2
    )
    assert_continues(metrics(moved), metrics(full))
    assert_same_weights(tmp_path / "a.st", tmp_path / "b.st")


def test_torchpar_to_jaxpar(data, tmp_path):
    full, half, moved = tmp_path / "full", tmp_path / "half", tmp_path / "moved"
    args = [*TINY, f"data.dataset={data}", *ARGS]
    torchpar(["--backend", "none", *args, f"run.dir={full}"], nproc=0)
    torchpar(["--backend", "ddp", *args, f"run.dir={half}"], nproc=2, TORCHPAR_FAULT_SIGTERM_AFTER_STEP="10")
    convert("jaxpar.tools.convert", "--from", "torchpar", str(half), "--to", "jaxpar", str(moved))
    jaxpar_resumes(moved, "fsdp=4")
    assert_continues(metrics(moved), metrics(full))


def test_the_experts_balance_bias_moves_with_its_run(data, tmp_path):
    """torchpar with model.moe_bias_update 1-10 -> jaxpar 11-20, as the uninterrupted torchpar run.

    The balance bias has no gradient: torch keeps no optimizer state for it, jaxpar zero moments, and the state file
    holds jaxpar's.
    """
    full, half, moved = tmp_path / "full", tmp_path / "half", tmp_path / "moved"
    args = [*TINY, f"data.dataset={data}", *ARGS, "model.moe_experts=4", "model.moe_bias_update=0.01"]
    torchpar(["--backend", "none", *args, f"run.dir={full}"], nproc=0)
    torchpar(["--backend", "none", *args, f"run.dir={half}"], nproc=0, TORCHPAR_FAULT_SIGTERM_AFTER_STEP="10")
    convert("jaxpar.tools.convert", "--from", "torchpar", str(half), "--to", "jaxpar", str(moved))
    jaxpar_resumes(moved, "dp=1")
    assert_continues(metrics(moved), metrics(full))


def test_a_float16_run_keeps_its_loss_scale_and_skipped_count(data, tmp_path):
    """jaxpar float16 (the scale grows every 3 clean steps, and backs off on overflows) -> torchpar.

    The scale, its growth count and the skipped updates go on where they were. The scale starts at 2^18, where the
    first steps overflow, and grows into overflows again after the move (the chunked loss keeps its table gradient
    in float32, so overflows come later than with whole logits).
    """
    f16 = [*ARGS, "model.compute_dtype=float16", "optim.loss_scale_init=262144", "optim.loss_scale_growth_interval=3"]
    full, half, moved = tmp_path / "full", tmp_path / "half", tmp_path / "moved"
    assert run_cli(full, data, "--mesh", "dp=1", *f16).returncode == 0
    r = run_cli(half, data, "--mesh", "dp=1", *f16, env={"JAXPAR_FAULT_SIGTERM_AFTER_STEP": "10"})
    assert r.returncode == 0, r.stderr[-2000:]
    convert("jaxpar.tools.convert", "--from", "jaxpar", str(half), "--to", "state", str(tmp_path / "s.safetensors"))
    convert(
        "torchpar.tools.convert", "--from", "state", str(tmp_path / "s.safetensors"), "--to", "torchpar", str(moved)
    )
    torchpar(["--backend", "none", "--config", str(moved / "config.json")], nproc=0)
    got, ref = metrics(moved), metrics(full)
    assert [(got[s]["loss_scale"], got[s]["skipped_steps"]) for s in range(11, 21)] == [
        (ref[s]["loss_scale"], ref[s]["skipped_steps"]) for s in range(11, 21)
    ]
    assert 0 < ref[10]["skipped_steps"] < ref[20]["skipped_steps"]  # overflows before and after the move
    np.testing.assert_allclose([got[s]["loss"] for s in got], [ref[s]["loss"] for s in got], rtol=1e-3)


def test_deepspeed_to_jaxpar(data, tmp_path):
    """A DeepSpeed ZeRO-3 run converted to jaxpar goes on as its uninterrupted run.

    A DeepSpeed ZeRO-3 run of 2 ranks, read on one process (through the universal checkpoint) with DeepSpeed's
    whole-parameter accessors, goes on in jaxpar as its uninterrupted run.
    """
    full, half, moved = tmp_path / "full", tmp_path / "half", tmp_path / "moved"
    args = ["--backend", "deepspeed", *TINY, f"data.dataset={data}", *ARGS, "parallel.zero_stage=3"]
    torchpar([*args, f"run.dir={full}"], nproc=2)
    torchpar([*args, f"run.dir={half}"], nproc=2, TORCHPAR_FAULT_SIGTERM_AFTER_STEP="10")
    convert("torchpar.tools.convert", "--from", "torchpar", str(half), "--to", "state", str(tmp_path / "s.safetensors"))
    assert not (half / "checkpoints" / "universal").exists()
    convert("jaxpar.tools.convert", "--from", "state", str(tmp_path / "s.safetensors"), "--to", "jaxpar", str(moved))
    jaxpar_resumes(moved, "dp=2")
    assert_continues(metrics(moved), metrics(full))


@pytest.fixture(scope="module")
def jaxpar_halfway(data, tmp_path_factory):
    """jaxpar dp=2: the uninterrupted run of 20 steps, and steps 1-10 exported to a training-state file."""
    tmp = tmp_path_factory.mktemp("jaxpar-halfway")
    assert run_cli(tmp / "full", data, "--mesh", "dp=2", *ARGS).returncode == 0
    r = run_cli(tmp / "half", data, "--mesh", "dp=2", *ARGS, env={"JAXPAR_FAULT_SIGTERM_AFTER_STEP": "10"})
    assert r.returncode == 0, r.stderr[-2000:]
    convert("jaxpar.tools.convert", "--from", "jaxpar", str(tmp / "half"), "--to", "state", str(tmp / "s.safetensors"))
    return tmp / "full", tmp / "s.safetensors"


def test_jaxpar_to_deepspeed_on_two_ranks(jaxpar_halfway, tmp_path):
    """A jaxpar state written as a one-rank DeepSpeed ZeRO-2 checkpoint goes on on 2 ranks.

    The state written as a DeepSpeed ZeRO-2 checkpoint of one rank (Adam's state made by a step at lr 0, then set),
    continued on 2 ranks through the universal checkpoint: the schedule and Adam's count go on too.
    """
    full, state = jaxpar_halfway
    convert(
        "torchpar.tools.convert",
        "--from",
        "state",
        str(state),
        "--to",
        "deepspeed",
        str(tmp_path / "moved"),
        "--zero-stage",
        "2",
    )
    torchpar(["--backend", "deepspeed", "--config", str(tmp_path / "moved" / "config.json")], nproc=2)
    assert_continues(metrics(tmp_path / "moved"), metrics(full))


@pytest.mark.parametrize(
    "stage,dtype", [(0, "float32"), (3, "float32"), (2, "bfloat16"), (1, "float32"), (2, "float32")]
)
def test_deepspeed_import_then_export_is_the_state(jaxpar_halfway, tmp_path, stage, dtype):
    """state -> DeepSpeed run -> state gives the same tensors and counts, bit for bit.

    ZeRO-0's moments live in torch's AdamW (where DeepSpeed's setters do nothing), ZeRO-3's in DeepSpeed's
    partitions; a bfloat16 run's float32 master is the state's weights, not their bfloat16 cast (DeepSpeed casts the
    model first).
    """
    (a, meta_a), state = read_state(str(jaxpar_halfway[1])), tmp_path / "a"
    meta_a["config"]["model"]["compute_dtype"] = dtype
    save_state(str(state), a, meta_a)
    convert(
        "torchpar.tools.convert",
        "--from",
        "state",
        str(state),
        "--to",
        "deepspeed",
        str(tmp_path / "ds"),
        "--zero-stage",
        str(stage),
    )
    convert("torchpar.tools.convert", "--from", "torchpar", str(tmp_path / "ds"), "--to", "state", str(tmp_path / "b"))
    b, meta_b = read_state(str(tmp_path / "b"))
    assert (meta_b["step"], meta_b["adam_step"]) == (meta_a["step"], meta_a["adam_step"]) == (10, 10)
    for kind in a:
        for name in a[kind]:
            np.testing.assert_array_equal(b[kind][name], a[kind][name], err_msg=f"{kind}/{name}")


MUON = [*ARGS, "optim.name=muon"]


@pytest.fixture(scope="module")
def muon_halfway(data, tmp_path_factory):
    """jaxpar dp=2,tp=2 with Muon.

    The uninterrupted run of 20 steps (its final weights too), and steps 1-10 exported to a training-state file.
    """
    tmp = tmp_path_factory.mktemp("muon-halfway")
    r = run_cli(tmp / "full", data, "--mesh", "dp=2,tp=2", *MUON, "--write-final", str(tmp / "full.st"))
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_cli(tmp / "half", data, "--mesh", "dp=2,tp=2", *MUON, env={"JAXPAR_FAULT_SIGTERM_AFTER_STEP": "10"})
    assert r.returncode == 0, r.stderr[-2000:]
    convert("jaxpar.tools.convert", "--from", "jaxpar", str(tmp / "half"), "--to", "state", str(tmp / "s.safetensors"))
    return tmp, tmp / "s.safetensors"


def test_muon_jaxpar_to_torchpar_and_another_jaxpar_mesh(muon_halfway, tmp_path):
    """A jaxpar Muon state goes on in torchpar and on another jaxpar mesh.

    The file holds Muon's momentum of each matrix (per-layer names, stacked as the parameter), AdamW's moments of the
    rest and both counts; torchpar fsdp and jaxpar fsdp=4 go on from it as the uninterrupted run.
    """
    origin, state = muon_halfway
    tensors, meta = read_state(str(state))
    assert (meta["optimizer"], meta["step"], meta["adam_step"], meta["muon_step"]) == ("muon", 10, 10, 10)
    matrices = {n for n in tensors["param"] if muon.per_layer_axes(n)}
    assert matrices and set(tensors["muon_m"]) == matrices and not matrices & set(tensors["adam_m"])
    assert all(tensors["muon_m"][n].shape == tensors["param"][n].shape for n in matrices)
    to_torch, to_jaxpar = tmp_path / "torchpar", tmp_path / "jaxpar"
    convert("jaxpar.tools.convert", "--from", "state", str(state), "--to", "torchpar", str(to_torch))
    torchpar(
        ["--backend", "fsdp", "--config", str(to_torch / "config.json"), "--write-final", str(tmp_path / "b.st")],
        nproc=2,
    )
    worst = assert_continues(metrics(to_torch), metrics(origin / "full"))
    assert_same_weights(origin / "full.st", tmp_path / "b.st")
    convert("jaxpar.tools.convert", "--from", "state", str(state), "--to", "jaxpar", str(to_jaxpar))
    jaxpar_resumes(to_jaxpar, "fsdp=4")
    worst = max(worst, assert_continues(metrics(to_jaxpar), metrics(origin / "full")))
    print(f"muon jaxpar -> torchpar fsdp, jaxpar fsdp=4: worst loss difference {worst:.2e}")


def test_muon_torchpar_to_jaxpar(data, tmp_path):
    """...

    and torchpar's Muon state through the file and back to torchpar is the file, bit for bit (the momentum of each
    per-layer matrix in its stacked place).
    """
    full, half, moved = tmp_path / "full", tmp_path / "half", tmp_path / "moved"
    args = [*TINY, f"data.dataset={data}", *MUON]
    torchpar(["--backend", "none", *args, f"run.dir={full}"], nproc=0)
    torchpar(["--backend", "ddp", *args, f"run.dir={half}"], nproc=2, TORCHPAR_FAULT_SIGTERM_AFTER_STEP="10")
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    convert("torchpar.tools.convert", "--from", "torchpar", str(half), "--to", "state", str(a))
    convert("jaxpar.tools.convert", "--from", "state", str(a), "--to", "jaxpar", str(moved))
    jaxpar_resumes(moved, "fsdp=2,tp=2")
    worst = assert_continues(metrics(moved), metrics(full))
    print(f"muon torchpar ddp -> jaxpar fsdp=2,tp=2: worst loss difference {worst:.2e}")
    convert("torchpar.tools.convert", "--from", "state", str(a), "--to", "torchpar", str(tmp_path / "again"))
    convert("torchpar.tools.convert", "--from", "torchpar", str(tmp_path / "again"), "--to", "state", str(b))
    (ta, meta_a), (tb, meta_b) = read_state(str(a)), read_state(str(b))
    assert meta_a["optimizer"] == meta_b["optimizer"] == "muon" and meta_a["muon_step"] == meta_b["muon_step"] == 10
    assert {k: sorted(v) for k, v in ta.items()} == {k: sorted(v) for k, v in tb.items()}
    for kind in ta:
        for name in ta[kind]:
            np.testing.assert_array_equal(tb[kind][name], ta[kind][name], err_msg=f"{kind}/{name}")


def refused(argv: list[str], capsys) -> str:
    """jaxpar.tools.convert ARGV refused: its one line."""
    assert jaxpar_convert.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_an_optimizer_the_state_is_not_of_is_refused(muon_halfway, tmp_path, capsys):
    """A state of another optimizer than the run's is refused in one line, with nothing written.

    A Muon state into a run of optim.name=adamw (its config edited), an AdamW state into one of muon, a Muon state into
    DeepSpeed (its own AdamW), and an optimizer the file does not hold: each one line, nothing written.
    """
    tensors, meta = read_state(str(muon_halfway[1]))
    as_adamw = tmp_path / "adamw.safetensors"
    save_state(
        str(as_adamw),
        tensors,
        {**meta, "config": {**meta["config"], "optim": {**meta["config"]["optim"], "name": "adamw"}}},
    )
    for target in ("jaxpar", "torchpar"):
        line = refused(["--from", "state", str(as_adamw), "--to", target, str(tmp_path / target)], capsys)
        assert "holds the state of optim.name=muon, but its config trains optim.name=adamw" in line, line
    zeros = {n: np.zeros_like(a) for n, a in tensors["muon_m"].items()}
    adamw = {
        "param": tensors["param"],
        "adam_m": {**tensors["adam_m"], **tensors["muon_m"]},
        "adam_v": {**tensors["adam_v"], **zeros},
    }
    save_state(str(tmp_path / "m.safetensors"), adamw, {**meta, "optimizer": "adamw"})
    line = refused(["--from", "state", str(tmp_path / "m.safetensors"), "--to", "jaxpar", str(tmp_path / "j")], capsys)
    assert "holds the state of optim.name=adamw, but its config trains optim.name=muon" in line, line
    line = refused(["--from", "state", str(muon_halfway[1]), "--to", "deepspeed", str(tmp_path / "ds")], capsys)
    assert "optim.name=muon, and DeepSpeed builds its own AdamW" in line, line
    unheld = {k: json.dumps(v) for k, v in {**meta, "optimizer": "adamw8bit"}.items()}  # save_state writes no such
    save_file(
        {f"{kind}/{n}": a for kind, named in adamw.items() for n, a in named.items()},
        str(tmp_path / "q.safetensors"),
        unheld,
    )
    line = refused(["--from", "state", str(tmp_path / "q.safetensors"), "--to", "jaxpar", str(tmp_path / "q")], capsys)
    assert "optim.name=adamw8bit: its moments are quantized in blocks of each framework's own layout" in line, line
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]
    cfg = tiny_config()
    cfg.optim.name = "adamw8bit"  # a run of it
    with pytest.raises(UserError, match="runs/q trains with optim.name=adamw8bit: its moments are quantized"):
        refuse_other_optimizer(cfg, "runs/q")
