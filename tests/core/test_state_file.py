"""The shared training-state file (jaxpar/core/state_file.py): what is written reads back; a file that is not one
(a weights file, a missing path) is one line naming it."""
import numpy as np
import pytest

from jaxpar.core.errors import UserError
from jaxpar.core.state_file import read_state, save_state
from jaxpar.core.weights import save_weights


def test_state_reads_back_and_other_files_are_refused(tmp_path):
    w = {"wte": np.arange(6, dtype=np.float32).reshape(2, 3)}
    path = str(tmp_path / "s.safetensors")
    save_state(path, {"param": w, "adam_m": {"wte": w["wte"] / 2}, "adam_v": {"wte": w["wte"] ** 2}},
               {"step": 7, "adam_step": 7, "config": {"train": {"steps": 9}}})
    tensors, meta = read_state(path)
    assert meta["step"] == 7 and meta["config"] == {"train": {"steps": 9}}
    np.testing.assert_array_equal(tensors["adam_v"]["wte"], w["wte"] ** 2)
    save_weights(str(tmp_path / "w.safetensors"), w)
    with pytest.raises(UserError, match="not a training-state file"):
        read_state(str(tmp_path / "w.safetensors"))
    with pytest.raises(UserError, match="not found"):
        read_state(str(tmp_path / "none.safetensors"))
