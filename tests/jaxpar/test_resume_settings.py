"""jaxpar's optimizer state across a resume with other optim.* settings (jaxpar/optim.py).

It holds no hyperparameter, and has one structure whether or not it clips, so optim.grad_clip may go to or from 0 on
resume; a checkpoint written while grad_clip=0 left the clipping slot out still resumes; the notes of what changed come
from process 0 alone. (Every setting acting on resume, jaxpar against each torchpar backend:
tests/torchpar/test_resume_changes.py.)
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.checkpoint import Checkpointer
from jaxpar.core.errors import UserError
from jaxpar.core.run.resume import check_resume
from jaxpar.layout import Layout
from jaxpar.mesh import make_mesh, process_id
from jaxpar.state import abstract_state, init_state, restore_latest
from tests.helpers import tiny_config


def layout_with(clip: str) -> Layout:
    return Layout(tiny_config(f"optim.grad_clip={clip}"), make_mesh({"dp": 1}, jax.devices()[:1]))


@pytest.mark.parametrize("written", ["today", "unclipped-before"])
def test_clipping_may_be_turned_on_or_off_on_resume(written, tmp_path):
    """Gradient clipping may be turned on or off on resume.

    A state saved without clipping (the current structure, or AdamW's state alone, as grad_clip=0 once saved it)
    restores as saved, into a layout without clipping and into one with.
    """
    state = jax.tree.map(lambda x: x + jnp.ones_like(x), init_state(layout_with("0")))  # moments, counts non-zero
    saved = {**state, "opt_state": state["opt_state"][1]} if written == "unclipped-before" else state
    ckpt = Checkpointer(str(tmp_path), keep=1)
    ckpt.save(3, saved, {"step": 3, "data_step": 3})
    for clip in ("0", "1.0"):
        layout = layout_with(clip)
        got, meta = restore_latest(ckpt, layout)
        assert meta["data_step"] == 3
        assert jax.tree.structure(got) == jax.tree.structure(abstract_state(layout))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(state), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ckpt.close()


@pytest.mark.parametrize(
    "launcher", [{"JAXPAR_COORDINATOR": "localhost:1", "JAXPAR_NUM_PROCESSES": "2"}, {"SLURM_NTASKS": "2"}]
)
def test_the_first_process_alone_says_what_changed(launcher, tmp_path, monkeypatch, capsys):
    """Every process checks a resume (jaxpar.train, before the processes join).

    Process 0 alone, as the launcher's variables name it, prints what changed.
    """
    (tmp_path / "checkpoints" / "4").mkdir(parents=True)
    (tmp_path / "config.json").write_text(json.dumps(tiny_config(f"run.dir={tmp_path}").to_dict()))
    for key, value in launcher.items():
        monkeypatch.setenv(key, value)
    for process, says in (("0", True), ("1", False)):
        monkeypatch.setenv("JAXPAR_PROCESS_ID" if "JAXPAR_COORDINATOR" in launcher else "SLURM_PROCID", process)
        check_resume(tiny_config(f"run.dir={tmp_path}", "train.steps=20"), is_main=process_id() == 0)
        assert ("resuming with train.steps changed: 10 -> 20" in capsys.readouterr().out) == says


# the tiny config's schedule (10 steps, 3 of warmup, cosine from 1e-2 to 1e-3) at 0-based step 7, by hand:
# 1e-3 + 0.5 * 9e-3 * (1 + cos(pi * 4/7)) = 4.5e-3; with 20 steps, cos(pi * 4/17): 8.8e-3; from 2e-2 to 2e-3: 9.0e-3
@pytest.mark.parametrize(
    "changes, said",
    [
        (["train.steps=20"], "the learning rate of step 8 moves from 4.5e-03 to 8.8e-03 (train.steps changed)"),
        (
            ["optim.lr=2e-2", "optim.min_lr=2e-3"],
            "the learning rate of step 8 moves from 4.5e-03 to 9.0e-03 (optim.lr, optim.min_lr changed)",
        ),
        (["optim.decay_steps=10", "train.steps=20"], "the learning rate of step 8 stays 4.5e-03 (train.steps changed)"),
    ],
)
def test_a_resume_that_changes_the_schedule_says_where_the_learning_rate_goes(changes, said):
    """A schedule key changed on resume moves the learning rate of the steps still to train.

    The line gives it at the first of them under the old settings and the new (lr_at, the schedule's definition,
    checked alongside); an unchanged rate is said to stay (the cosine ends at optim.decay_steps, not train.steps).
    """
    from jaxpar.core.optimizer.lr_schedule import lr_at
    from jaxpar.core.run.resume import schedule_change_line

    old = tiny_config(*[c for c in changes if c.startswith("optim.decay_steps")])  # decay_steps: in both runs
    new = tiny_config(*changes)
    line = schedule_change_line(old, new, 7)
    assert line == f"resuming after step 7: {said}", line
    before, after = lr_at(7, old.optim, old.train.steps), lr_at(7, new.optim, new.train.steps)
    assert f"{before:.1e}" in line and f"{after:.1e}" in line


def test_a_new_run_or_an_unchanged_schedule_says_nothing_of_it():
    from jaxpar.core.run.resume import schedule_change_line

    assert schedule_change_line(tiny_config(), tiny_config("train.steps=20"), 0) is None  # nothing resumed
    assert schedule_change_line(tiny_config(), tiny_config("optim.weight_decay=0.3"), 7) is None  # not the schedule


def test_the_schedule_line_reads_the_old_settings_from_the_run_dir(tmp_path):
    """The schedule-change line reads the old settings from the run dir.

    schedule_change: the run's config.json holds the settings it was trained with (read before the resumed run writes
    its own).
    """
    from jaxpar.core.run.resume import schedule_change, schedule_change_line

    old = tiny_config(f"run.dir={tmp_path}")
    (tmp_path / "config.json").write_text(json.dumps({**old.to_dict(), "framework": "jaxpar"}))
    new = tiny_config(f"run.dir={tmp_path}", "train.steps=20")
    assert schedule_change(new, 7) == schedule_change_line(old, new, 7) and "moves from" in schedule_change(new, 7)
    assert schedule_change(tiny_config(f"run.dir={tmp_path / 'new'}", "train.steps=20"), 7) is None  # no run there


def test_a_resume_refuses_new_initial_weights_it_would_not_read(tmp_path):
    """model.init_from names the weights a run starts from.

    On a run with a checkpoint a new value would not act (the README's torchpar command with init_from, run again
    after a first torchpar run); dropping it is fine.
    """
    (tmp_path / "checkpoints" / "4").mkdir(parents=True)
    (tmp_path / "config.json").write_text(json.dumps(tiny_config(f"run.dir={tmp_path}").to_dict()))
    with pytest.raises(UserError, match=r"model.init_from=w.safetensors would not act on it"):
        check_resume(tiny_config(f"run.dir={tmp_path}", "model.init_from=w.safetensors"))
    (tmp_path / "config.json").write_text(
        json.dumps(tiny_config(f"run.dir={tmp_path}", "model.init_from=w.safetensors").to_dict())
    )
    check_resume(tiny_config(f"run.dir={tmp_path}", "model.init_from=w.safetensors"))  # unchanged
    check_resume(tiny_config(f"run.dir={tmp_path}"))  # dropped: the legs of a run after its first


def test_a_key_newer_than_the_runs_config_is_compared_with_its_default(tmp_path, capsys):
    """A run whose config.json was written before a key existed had the key's default.

    Resuming it with another value of a model key is refused in one line; with another value of a free key, it resumes
    and says what changed; with the defaults, nothing changed (a retyped key's old value read as today's: optim.fused's
    false is "auto").
    """
    (tmp_path / "checkpoints" / "2").mkdir(parents=True)
    saved = tiny_config(f"run.dir={tmp_path}").to_dict()
    before = {
        **saved,
        "model": {k: v for k, v in saved["model"].items() if k != "qk_norm"},
        "train": {k: v for k, v in saved["train"].items() if k != "straggler_threshold"},
        "optim": {**saved["optim"], "fused": False},
    }
    (tmp_path / "config.json").write_text(json.dumps(before))
    check_resume(tiny_config(f"run.dir={tmp_path}"))
    assert "resuming with" not in capsys.readouterr().out
    with pytest.raises(UserError, match=r"model.qk_norm: False -> True") as e:
        check_resume(tiny_config(f"run.dir={tmp_path}", "model.qk_norm=true"))
    assert "\n" not in str(e.value)
    check_resume(tiny_config(f"run.dir={tmp_path}", "train.straggler_threshold=0.5"))
    assert capsys.readouterr().out == "resuming with train.straggler_threshold changed: 0.2 -> 0.5\n"
