"""torchpar's checkpoint saves (DCP, DeepSpeed) never return without saving or raising: a step on disk that this
run did not write or restore is refused and left as it was; the run's own step is saved once."""
import os

import pytest
import torch

from jaxpar.core.errors import UserError
from torchpar.backends.deepspeed import DeepSpeedEngine
from torchpar.checkpoint import DCPCheckpointer
from torchpar.dist import Env

CPU = Env(0, 1, 0, torch.device("cpu"))


def checkpointer(run_dir) -> DCPCheckpointer:
    model = torch.nn.Linear(2, 2)
    return DCPCheckpointer(str(run_dir), 3, model, torch.optim.SGD(model.parameters(), lr=0.1), CPU)


def test_dcp_refuses_a_planted_step_and_keeps_it(tmp_path):
    os.makedirs(tmp_path / "checkpoints" / "5")
    (tmp_path / "checkpoints" / "5" / "meta.json").write_text('{"step": 5}')
    with pytest.raises(UserError, match=r"checkpoints/5 exists and was not written by this run"):
        checkpointer(tmp_path).save(5, {"step": 5})
    assert os.listdir(tmp_path / "checkpoints" / "5") == ["meta.json"]


def test_dcp_saves_its_own_step_once_and_a_resumed_one_is_its_own(tmp_path):
    ckpt = checkpointer(tmp_path)
    ckpt.save(5, {"step": 5})
    ckpt.save(5, {"step": 5})  # the final save right after a periodic one
    resumed = checkpointer(tmp_path)
    assert resumed.restore() == {"step": 5}
    resumed.save(5, {"step": 5})
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["5"]


def test_deepspeed_refuses_a_planted_step(tmp_path):
    engine = object.__new__(DeepSpeedEngine)  # the save's check runs before DeepSpeed's engine is asked anything
    engine.dir, engine.own, engine.env = str(tmp_path), set(), CPU
    os.makedirs(tmp_path / "5")
    with pytest.raises(UserError, match=r"/5 exists and was not written by this run"):
        engine.save(5, {"step": 5})
