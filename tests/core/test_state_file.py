"""The shared training-state file (jaxpar/core/weights/state_file.py): what is written reads back.

A file that is not one (a weights file, a missing path) is one line naming it.
"""

import os

import numpy as np
import pytest

from jaxpar.core.errors import UserError
from jaxpar.core.weights.state_file import read_state, save_state
from jaxpar.core.weights.names import save_weights


def test_state_reads_back_and_other_files_are_refused(tmp_path):
    w = {"wte": np.arange(6, dtype=np.float32).reshape(2, 3)}
    path = str(tmp_path / "s.safetensors")
    save_state(
        path,
        {"param": w, "adam_m": {"wte": w["wte"] / 2}, "adam_v": {"wte": w["wte"] ** 2}},
        {"step": 7, "adam_step": 7, "config": {"train": {"steps": 9}}},
    )
    tensors, meta = read_state(path)
    assert meta["step"] == 7 and meta["config"] == {"train": {"steps": 9}}
    np.testing.assert_array_equal(tensors["adam_v"]["wte"], w["wte"] ** 2)
    save_weights(str(tmp_path / "w.safetensors"), w)
    with pytest.raises(UserError, match="not a training-state file"):
        read_state(str(tmp_path / "w.safetensors"))
    with pytest.raises(UserError, match="not found"):
        read_state(str(tmp_path / "none.safetensors"))


def test_weights_files_are_readable_as_the_umask_allows(tmp_path):
    """safetensors writes its files for their owner alone; a weights file is for the run's readers too."""
    import stat

    old = os.umask(0o022)
    try:
        save_weights(str(tmp_path / "w.safetensors"), {"a": np.ones(2, np.float32)})
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "w.safetensors").st_mode) == 0o644
    assert os.listdir(tmp_path) == ["w.safetensors"]  # no temporary file left
