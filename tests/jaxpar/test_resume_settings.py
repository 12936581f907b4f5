"""jaxpar's optimizer state across a resume with other optim.* settings (jaxpar/optim.py): it holds no
hyperparameter, and has one structure whether or not it clips, so optim.grad_clip may go to or from 0 on resume;
a checkpoint written while grad_clip=0 left the clipping slot out still resumes; the notes of what changed come
from process 0 alone. (Every setting acting on resume, jaxpar against each torchpar backend:
tests/torchpar/test_resume_changes.py.)"""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.checkpoint import Checkpointer
from jaxpar.core.resume import check_resume
from jaxpar.layout import Layout
from jaxpar.mesh import make_mesh, process_id
from jaxpar.state import abstract_state, init_state, restore_latest
from tests.helpers import tiny_config


def layout_with(clip: str) -> Layout:
    return Layout(tiny_config(f"optim.grad_clip={clip}"), make_mesh({"dp": 1}, jax.devices()[:1]))


@pytest.mark.parametrize("written", ["today", "unclipped-before"])
def test_clipping_may_be_turned_on_or_off_on_resume(written, tmp_path):
    """A state saved without clipping (today's structure, or AdamW's state alone as grad_clip=0 once saved it)
    restores as saved, into a layout without clipping and into one with."""
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


@pytest.mark.parametrize("launcher", [{"JAXPAR_COORDINATOR": "localhost:1", "JAXPAR_NUM_PROCESSES": "2"},
                                      {"SLURM_NTASKS": "2"}])
def test_the_first_process_alone_says_what_changed(launcher, tmp_path, monkeypatch, capsys):
    """Every process checks a resume (jaxpar.train, before the processes join); process 0 alone, as the
    launcher's variables name it, prints what changed."""
    (tmp_path / "checkpoints" / "4").mkdir(parents=True)
    (tmp_path / "config.json").write_text(json.dumps(tiny_config(f"run.dir={tmp_path}").to_dict()))
    for key, value in launcher.items():
        monkeypatch.setenv(key, value)
    for process, says in (("0", True), ("1", False)):
        monkeypatch.setenv("JAXPAR_PROCESS_ID" if "JAXPAR_COORDINATOR" in launcher else "SLURM_PROCID", process)
        check_resume(tiny_config(f"run.dir={tmp_path}", "train.steps=20"), is_main=process_id() == 0)
        assert ("resuming with train.steps changed: 10 -> 20" in capsys.readouterr().out) == says
