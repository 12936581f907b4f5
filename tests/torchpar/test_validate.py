"""torchpar.checks.validate, the one entry for what torchpar refuses before a process group exists: the backend's
settings and run.dir with the resume, each in one line; a config the backend runs passes."""
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


@pytest.mark.parametrize("backend, overrides, refused", [
    ("ddp", ["parallel.zero_stage=1"], "needs --backend deepspeed or fsdp"),  # the backend's settings
    ("none", ["parallel.grad_compression=bf16"], "not used by torchpar --backend none"),  # the contract, last of them
    ("none", ["run.dir=FILE"], "is a file, not a directory"),  # run.dir and the resume (core/resume.py)
])
def test_each_part_refuses_in_one_line(tmp_path, backend, overrides, refused):
    from torchpar.checks import validate

    (tmp_path / "file").write_text("")
    cfg = tiny_config(f"run.dir={tmp_path / 'run'}", *(o.replace("FILE", str(tmp_path / "file")) for o in overrides))
    with pytest.raises(UserError, match=refused) as e:
        validate(cfg, args(backend))
    assert "\n" not in str(e.value)
