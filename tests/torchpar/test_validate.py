"""torchpar.checks.validate, the one entry for what torchpar refuses before a process group exists.

The backend's settings and run.dir with the resume, each in one line; a config the backend runs passes.
"""

import argparse

import pytest

from jaxpar.core.errors import UserError
from tests.helpers import tiny_config

pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def one_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_NTASKS", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)


def args(backend: str) -> argparse.Namespace:
    return argparse.Namespace(backend=backend, cpu_offload=False, deepspeed_config="")


def test_a_config_the_backend_runs_passes(tmp_path):
    from torchpar.checks import validate

    validate(tiny_config(f"run.dir={tmp_path / 'run'}"), args("none"))


@pytest.mark.parametrize(
    "backend, overrides, refused",
    [
        ("ddp", ["parallel.zero_stage=1"], "needs --backend deepspeed or fsdp"),  # the backend's settings
        (
            "none",
            ["parallel.grad_compression=bf16"],
            "not used by torchpar --backend none",
        ),  # the contract, last of them
        ("none", ["run.dir=FILE"], "is a file, not a directory"),  # run.dir and the resume (core/run/resume.py)
    ],
)
def test_each_part_refuses_in_one_line(tmp_path, backend, overrides, refused):
    from torchpar.checks import validate

    (tmp_path / "file").write_text("")
    cfg = tiny_config(f"run.dir={tmp_path / 'run'}", *(o.replace("FILE", str(tmp_path / "file")) for o in overrides))
    with pytest.raises(UserError, match=refused) as e:
        validate(cfg, args(backend))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
def test_a_multi_process_backend_without_a_launcher_says_it_runs_one_process(backend, tmp_path, capsys, monkeypatch):
    """`python -m torchpar.train --backend ddp` is one process: one line on stderr says so and how to start more.

    Under a launcher (its RANK, WORLD_SIZE, LOCAL_RANK) nothing is said.
    """
    from torchpar.checks import validate

    validate(tiny_config(f"run.dir={tmp_path / 'run'}"), args(backend))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--backend {backend} without a launcher runs as one process" in err, err
    assert "torchrun --nproc_per_node=N -m torchpar.train" in err
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.setenv(var, "1" if var == "WORLD_SIZE" else "0")
    validate(tiny_config(f"run.dir={tmp_path / 'run'}"), args(backend))
    assert capsys.readouterr().err == ""


def test_the_pipeline_without_a_launcher_is_refused(tmp_path, monkeypatch):
    """A pipeline's stages are its processes: one plain process is refused in one line (under a launcher two run)."""
    from torchpar.checks import validate

    cfg = tiny_config(f"run.dir={tmp_path / 'run'}")
    with pytest.raises(UserError, match="--backend pipeline without a launcher is one process") as e:
        validate(cfg, args("pipeline"))
    assert "\n" not in str(e.value) and "--backend none" in str(e.value)
    monkeypatch.setenv("WORLD_SIZE", "2")
    validate(cfg, args("pipeline"))
