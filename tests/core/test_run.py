"""The run sequence of both trainers (jaxpar/core/run/loop.py), with a recording trainer.

Its order, and that all processes stop together when the main one cannot move an old run aside.
"""

import json
import os

import pytest

from jaxpar.core.errors import UserError
from jaxpar.core.run.loop import run_training
from tests.helpers import tiny_config


class Agreement:
    """A Recorder's process group: `any_of` is written down; `others_failed` plays the other processes' answer."""

    def __init__(self, calls, others_failed):
        self.calls, self.others_failed = calls, others_failed

    def any_of(self, flag):
        self.calls.append("any_of")
        return flag or self.others_failed


class Recorder:
    """A trainer adapter that writes down what the run sequence asks of it (its process group's `any_of` too)."""

    def __init__(self, is_main=True, others_failed=False, step=0):
        self.is_main, self.step, self.calls = is_main, step, []
        self.processes = Agreement(self.calls, others_failed)

    def __getattr__(self, name):
        def call(*args):
            self.calls.append(name)
            return {"restore_or_init": self.step, "run_config": {}, "start": ""}.get(name)

        return call


def old_run(tmp_path):
    run_dir = tmp_path / "run"
    os.makedirs(run_dir / "checkpoints")
    (run_dir / "config.json").write_text("{}")
    return tiny_config(f"run.dir={run_dir}", "checkpoint.resume=false", "train.steps=3")


def test_the_sequence_restores_records_the_config_and_closes(tmp_path):
    cfg = tiny_config(f"run.dir={tmp_path / 'run'}", "train.steps=3")
    t = Recorder(step=3)  # complete already: nothing to train
    assert run_training(cfg, t, {}, write_final=str(tmp_path / "w.safetensors")) == 0
    assert t.calls == ["any_of", "restore_or_init", "run_config", "write_weights", "close"]
    assert json.load(open(tmp_path / "run" / "config.json"))["train"]["steps"] == 3


def test_a_complete_run_keeps_its_config_and_says_only_that_it_is_complete(tmp_path, capsys):
    """Run again with fewer steps than it has (the README's first command after a longer run).

    Nothing trains, so nothing of the run is rewritten and no start line says it resumes.
    """
    run = tmp_path / "run"
    run.mkdir()
    trained = json.dumps({**tiny_config(f"run.dir={run}", "train.steps=30").to_dict(), "resolved_mesh": "fsdp=2"})
    (run / "config.json").write_text(trained)
    assert run_training(tiny_config(f"run.dir={run}", "train.steps=15"), Recorder(step=30), {}) == 0
    assert (run / "config.json").read_text() == trained
    out, err = capsys.readouterr()
    assert "is complete: its checkpoint is at step 30" in err and "resuming" not in out + err


def test_a_failed_move_aside_stops_every_process(tmp_path, monkeypatch):
    cfg = old_run(tmp_path)

    def no_space(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "rename", no_space)
    main = Recorder(is_main=True)
    with pytest.raises(UserError, match="cannot move the run .* aside: No space left on device"):
        run_training(cfg, main, {})
    other = Recorder(is_main=False, others_failed=True)  # the main process said it failed
    with pytest.raises(UserError, match="the main process could not move the old run aside"):
        run_training(cfg, other, {})
    for t in (main, other):  # nobody restored, wrote or trained into run.dir; the old run is where it was
        assert t.calls == ["any_of"], t.calls
    assert os.path.exists(tmp_path / "run" / "config.json") and not os.path.exists(tmp_path / "run.prev-1")
