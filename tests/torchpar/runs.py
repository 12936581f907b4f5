"""What the torchpar tests share: running torchpar.train (plain or under torchrun) with the abort and exit checks,
the tiny config on a synthetic dataset from one initial-weights file (`base`), the one-process run every backend
is held to (`reference`), and that comparison. Registered for tests/torchpar by its conftest.py."""
import subprocess

import numpy as np
import pytest

from tests.helpers import ABORTS, TINY, make_dataset, metrics, run_in_session, torch_command, torch_env


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
    out = run(["--backend", "none", *base["args"], f"run.dir={run_dir}", "run.tensorboard=true", "train.sample_every=5",
               "--write-final", str(base["tmp"] / "reference.safetensors")])
    (base["tmp"] / "reference.out").write_text(out.stdout)
    return metrics(run_dir)


def assert_same_run(got: dict, ref: dict, steps=range(1, 11)) -> None:
    loss = [got[s]["loss"] for s in steps]
    ref_loss = [ref[s]["loss"] for s in steps]
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose([got[s]["grad_norm"] for s in steps], [ref[s]["grad_norm"] for s in steps], rtol=1e-4)
    np.testing.assert_allclose([got[s]["lr"] for s in steps], [ref[s]["lr"] for s in steps], rtol=1e-6)
