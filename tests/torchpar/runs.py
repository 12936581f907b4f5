"""What the torchpar tests share.

Running torchpar.train (plain or under torchrun) with the abort and exit checks, the tiny config on a synthetic dataset
from one initial-weights file (`base`), the one-process run every backend is held to (`reference`), and that comparison;
a run resumed with other settings (`CHANGED`) and the run it must equal (`changed_reference`). Registered for
tests/torchpar by its conftest.py.
"""

import subprocess
import sys

import numpy as np
import pytest

from jaxpar.core.optimizer.lr_schedule import lr_at
from tests.helpers import ABORTS, TINY, make_dataset, metrics, run_in_session, tiny_config, torch_command, torch_env

# A resume that changes settings (DESIGN.md 9): a run of the tiny config stopped after step 4, resumed with every
# key that shapes the schedule or the update changed (the grad norms of the tiny run are about 2: both
# thresholds clip; eps is near the gradients' scale)
CHANGED = [
    "train.steps=12",
    "optim.lr=5e-3",
    "optim.min_lr=2e-3",
    "optim.weight_decay=0.3",
    "optim.beta1=0.8",
    "optim.beta2=0.99",
    "optim.eps=1e-4",
    "optim.grad_clip=0.5",
]
STOP = 4  # the checkpoint the changed run resumes from


def run(args: list[str], nproc: int = 0, expect_rc=0, timeout: int = 120, **env) -> subprocess.CompletedProcess:
    """`python -m torchpar.train ARGS` (nproc=0) or torchrun with nproc processes."""
    result = run_in_session(torch_command(args, nproc), torch_env(**env), timeout, f"run {args}")
    text = result.stdout + result.stderr
    assert not any(a in text for a in ABORTS), text[-5000:]
    if expect_rc == 0:
        assert result.returncode == 0, text[-5000:]
    elif expect_rc == "nonzero":
        assert result.returncode != 0, text[-5000:]
    return result


@pytest.fixture(scope="session")
def base(tmp_path_factory):
    """Tiny config args on a synthetic dataset, starting from one shared initial-weights file."""
    tmp = tmp_path_factory.mktemp("torchpar")
    data = make_dataset(tmp / "tokens.bin")
    args = TINY + [f"data.dataset={data}", "checkpoint.every=0"]  # only the final checkpoint, unless a test says
    init = str(tmp / "init.safetensors")
    run(["--backend", "none", "--write-init", init, *args])
    return {"tmp": tmp, "args": args + [f"model.init_from={init}"], "init": init}


@pytest.fixture(scope="session")
def reference(base):
    run_dir = base["tmp"] / "reference"
    out = run(
        [
            "--backend",
            "none",
            *base["args"],
            f"run.dir={run_dir}",
            "run.tensorboard=true",
            "train.sample_every=5",
            "--write-final",
            str(base["tmp"] / "reference.safetensors"),
        ]
    )
    (base["tmp"] / "reference.out").write_text(out.stdout)
    return metrics(run_dir)


def assert_same_run(got: dict, ref: dict, steps=range(1, 11), grad_norm: float = 1e-4) -> None:
    loss = [got[s]["loss"] for s in steps]
    ref_loss = [ref[s]["loss"] for s in steps]
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(
        [got[s]["grad_norm"] for s in steps], [ref[s]["grad_norm"] for s in steps], rtol=grad_norm
    )
    np.testing.assert_allclose([got[s]["lr"] for s in steps], [ref[s]["lr"] for s in steps], rtol=1e-6)


@pytest.fixture(scope="session")
def changed_reference(base):
    """jaxpar's run (one device) stopped by SIGTERM after step STOP and resumed with CHANGED.

    What a resumed run with those changes must be in every backend. An independent reading: jaxpar keeps no
    hyperparameter in its state (optax's transforms close over the config), torch keeps them in the optimizer's and
    the scheduler's.
    """
    run_dir = base["tmp"] / "changed-jaxpar"
    command = [sys.executable, "-m", "jaxpar.train", *base["args"], f"run.dir={run_dir}"]
    for extra, env in (([], {"JAXPAR_FAULT_SIGTERM_AFTER_STEP": str(STOP)}), (CHANGED, {})):
        out = run_in_session(command + extra, torch_env(JAXPAR_CPU_DEVICES="1", **env), 180, "jaxpar's changed run")
        assert out.returncode == 0, out.stderr[-3000:]
    return metrics(run_dir)


def expected_lr(step: int) -> float:
    """The lr of (1-based) `step` in the changed run.

    The tiny config's schedule up to step STOP, CHANGED's after (lr_at, the shared formula, is the schedule's
    definition).
    """
    cfg = tiny_config(*(CHANGED if step > STOP else []))
    return lr_at(step - 1, cfg.optim, cfg.train.steps)


def assert_changed_run(got: dict, ref: dict) -> None:
    """`got` is the run resumed with CHANGED.

    Equal to `changed_reference` in loss, grad norm and lr, and its lr the schedule's of the settings in force at
    each step.
    """
    steps = range(1, 13)
    assert_same_run(got, ref, steps)
    np.testing.assert_allclose([got[s]["lr"] for s in steps], [expected_lr(s) for s in steps], rtol=1e-6)


def assert_notes_once(out: subprocess.CompletedProcess) -> None:
    """Every changed key said once, however many processes run (by the main one)."""
    keys = [line.split()[2] for line in out.stdout.splitlines() if line.startswith("resuming with")]
    assert len(keys) == len(set(keys)) and {c.split("=")[0] for c in CHANGED} <= set(keys), out.stdout[-3000:]


def jaxpar_run(base, overrides: list[str], name: str) -> dict:
    """jaxpar on one device from `base`'s initial weights with `overrides`: the run a torchpar run is held to."""
    run_dir = base["tmp"] / f"{name}-jaxpar"
    command = [sys.executable, "-m", "jaxpar.train", *base["args"], *overrides, f"run.dir={run_dir}"]
    out = run_in_session(command, torch_env(JAXPAR_CPU_DEVICES="1"), 180, f"jaxpar's {name} run")
    assert out.returncode == 0, out.stderr[-3000:]
    return metrics(run_dir)


def assert_resumes_exactly_after_sigkill(base, backend: str, overrides: list[str], name: str, nproc: int = 2) -> None:
    """Assert a torchpar run of `nproc` processes (two) killed by SIGKILL and resumed logs the whole run's losses.

    `backend` with `overrides`, whole and killed by SIGKILL after step 6 then resumed from its step-4 checkpoint: every
    logged loss equal, bit for bit.
    """
    args = ["--backend", backend, *base["args"], *overrides, "checkpoint.every=4"]
    full, killed = base["tmp"] / f"{name}-{backend}-full", base["tmp"] / f"{name}-{backend}-killed"
    run(args + [f"run.dir={full}"], nproc=nproc)
    run(args + [f"run.dir={killed}"], nproc=nproc, expect_rc="nonzero", TORCHPAR_FAULT_KILL_AFTER_STEP="6")
    out = run(args + [f"run.dir={killed}"], nproc=nproc)
    assert "resumed from" in out.stderr
    m, r = metrics(full), metrics(killed)
    assert sorted(m) == sorted(r) and all(r[s]["loss"] == m[s]["loss"] for s in m)
