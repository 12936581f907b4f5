"""jaxpar.checks.validate, the one entry for what jaxpar refuses before it traces.

Each of its parts refuses in one line (run.dir and the resume, the contract, the layout), and a config that fits its
mesh passes.
"""

import pytest

from jaxpar.checks import validate
from jaxpar.core.errors import UserError
from jaxpar.core.config.mesh_spec import AXES
from tests.helpers import tiny_config


def mesh(**sizes) -> dict[str, int]:
    return {a: sizes.get(a, 1) for a in AXES}


def test_a_config_that_fits_its_mesh_passes(tmp_path):
    validate(tiny_config(f"run.dir={tmp_path / 'run'}"), mesh(dp=2, tp=2))


@pytest.mark.parametrize(
    "overrides, sizes, refused",
    [
        (["run.dir=FILE"], mesh(), "is a file, not a directory"),  # run.dir first (core/run/resume.py)
        (["parallel.grad_compression=bf16"], mesh(), "applies with dp or fsdp > 1"),  # the config contract
        ([], mesh(tp=3), "model.n_head=4 is not divisible by tp=3"),  # the layout
        (["train.batch_rampup=2,2,16"], mesh(dp=4), "not divisible by the data axes"),  # the layout at a ramp's batch
    ],
)
def test_each_part_refuses_in_one_line(tmp_path, overrides, sizes, refused):
    (tmp_path / "file").write_text("")
    cfg = tiny_config(f"run.dir={tmp_path / 'run'}", *(o.replace("FILE", str(tmp_path / "file")) for o in overrides))
    with pytest.raises(UserError, match=refused) as e:
        validate(cfg, sizes)
    assert "\n" not in str(e.value)
