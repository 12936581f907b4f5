"""torchpar's checkpoint saves (DCP, DeepSpeed) never return without saving or raising.

A step on disk that this run did not write or restore is refused and left as it was; the run's own step is saved once.
"""

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


class DeepSpeedStub:
    """DeepSpeed's engine as the save and restore ask it: its checkpoint calls recorded, a restore giving step 5."""

    def __init__(self):
        self.saved, self.optimizer = [], torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
        self.lr_scheduler = None

    def save_checkpoint(self, folder, tag, client_state):
        self.saved.append(int(tag))
        os.makedirs(os.path.join(folder, tag), exist_ok=True)
        with open(os.path.join(folder, "latest"), "w") as f:
            f.write(tag)

    def load_checkpoint(self, folder):
        return os.path.join(folder, "5"), {"step": 5, "data_step": 5}


def deepspeed_engine(ckpt_dir) -> DeepSpeedEngine:
    engine = object.__new__(DeepSpeedEngine)  # the save's bookkeeping around DeepSpeed's own calls
    engine.engine, engine.dir, engine.own, engine.env, engine.universal = (
        DeepSpeedStub(),
        str(ckpt_dir),
        set(),
        CPU,
        None,
    )
    engine.cfg = type("Cfg", (), {"checkpoint": type("C", (), {"keep": 3})})
    return engine


def test_deepspeed_refuses_a_complete_step_it_did_not_write(tmp_path):
    os.makedirs(tmp_path / "5")
    (tmp_path / "latest").write_text("5")
    engine = deepspeed_engine(tmp_path)
    with pytest.raises(UserError, match=r"/5 exists and was not written by this run"):
        engine.save(5, {"step": 5})
    assert engine.engine.saved == []


def test_deepspeed_writes_again_a_save_left_unfinished_and_its_restored_step_is_its_own(tmp_path):
    os.makedirs(tmp_path / "5")  # a first save killed before DeepSpeed wrote `latest`
    engine = deepspeed_engine(tmp_path)
    engine.save(5, {"step": 5})
    engine.save(5, {"step": 5})  # the final save right after a periodic one
    assert engine.engine.saved == [5]
    resumed = deepspeed_engine(tmp_path)
    assert resumed.load()["step"] == 5
    resumed.save(5, {"step": 5})  # stopped at once after resuming: its own step
    assert resumed.engine.saved == []
