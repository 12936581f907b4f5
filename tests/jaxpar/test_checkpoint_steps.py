"""A checkpoint save never returns without saving or raising (jaxpar/checkpoint.py).

A step on disk that this run did not write or restore is refused and left as it was; the run's own step is saved once.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.checkpoint import Checkpointer
from jaxpar.core.errors import UserError


def saved_value(run_dir) -> np.ndarray:
    ckpt = Checkpointer(str(run_dir), keep=3)
    state = ckpt.restore_latest({"x": jax.ShapeDtypeStruct((2,), jnp.float32)})[0]
    ckpt.close()
    return np.asarray(state["x"])


def test_a_step_another_run_wrote_is_refused_and_kept(tmp_path):
    first = Checkpointer(str(tmp_path), keep=3)
    first.save(5, {"x": jnp.ones(2)}, {"step": 5})
    first.close()
    second = Checkpointer(str(tmp_path), keep=3, trainer=True)
    with pytest.raises(UserError, match=r"checkpoints/5 exists and was not written by this run"):
        second.save(5, {"x": jnp.full(2, 7.0)}, {"step": 5})
    second.close()
    np.testing.assert_array_equal(saved_value(tmp_path), np.ones(2))


def test_the_runs_own_steps_saved_or_restored_are_saved_once(tmp_path):
    ckpt = Checkpointer(str(tmp_path), keep=3, trainer=True)
    ckpt.save(5, {"x": jnp.ones(2)}, {"step": 5})
    ckpt.save(5, {"x": jnp.full(2, 7.0)}, {"step": 5})  # the final save right after a periodic one
    ckpt.close()
    resumed = Checkpointer(str(tmp_path), keep=3, trainer=True)
    resumed.restore_latest({"x": jax.ShapeDtypeStruct((2,), jnp.float32)})
    resumed.save(5, {"x": jnp.ones(2)}, {"step": 5})  # stopped at once after resuming: its own step
    resumed.close()
    np.testing.assert_array_equal(saved_value(tmp_path), np.ones(2))
