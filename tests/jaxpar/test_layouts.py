"""The project's spine: every mesh (with its settings) reproduces the one-device float32 training run."""

import math

import jax
import numpy as np
import pytest

from tests.helpers import assert_params_close, run_steps, tiny_config
from jaxpar.core.config.mesh_spec import parse_mesh

MESHES = [
    ("dp=8", ()),
    ("fsdp=8", ()),
    ("dp=2,tp=4", ()),
    ("dp=2,fsdp=2,tp=2", ()),
    ("dp=4", ("parallel.zero_stage=1",)),
    ("dp=2,fsdp=2", ("parallel.zero_stage=2",)),
    ("dp=4,tp=2", ("parallel.zero_stage=3",)),
    ("dp=2,tp=4", ("model.remat=full",)),
    ("fsdp=2", ("model.remat=save_matmuls",)),
]
IDS = [m + "".join(f",{e}" for e in x) for m, x in MESHES]


@pytest.mark.every_commit  # the spine runs on every commit, whatever its tests measure (conftest.py: test tiers)
@pytest.mark.parametrize("mesh,extra", MESHES, ids=IDS)
def test_mesh_matches_single_device(mesh, extra, dataset, reference):
    n = math.prod(parse_mesh(mesh).values())
    got = run_steps(tiny_config(*extra), mesh, dataset, devices=jax.devices()[:n])
    ref_loss, loss = np.array(reference["loss"]), np.array(got["loss"])
    assert ref_loss[-1] < ref_loss[0] - 0.1, "the reference run should learn something"
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(got["grad_norm"], reference["grad_norm"], rtol=1e-4)
    assert_params_close(got["params"], reference["params"])


def test_gradient_accumulation_equals_full_batch(dataset):
    full = run_steps(tiny_config(), "dp=2", dataset, steps=5, devices=jax.devices()[:2])
    accum = run_steps(tiny_config("train.microbatches=4"), "dp=2", dataset, steps=5, devices=jax.devices()[:2])
    np.testing.assert_allclose(accum["loss"], full["loss"], rtol=1e-5)
    assert_params_close(accum["params"], full["params"])


def test_different_seed_changes_the_run(dataset, reference):
    """Guards the comparisons above against comparing a thing with itself."""
    other = run_steps(tiny_config("train.seed=1"), "dp=1", dataset, devices=jax.devices()[:1])
    assert abs(other["loss"][0] - reference["loss"][0]) > 1e-4


def test_bfloat16_compute_stays_close_to_float32(dataset, reference):
    """bf16 matmuls, fp32 params and statistics: same trajectory to bf16 accuracy, but not identical."""
    got = run_steps(tiny_config("model.compute_dtype=bfloat16"), "dp=2,tp=2", dataset, devices=jax.devices()[:4])
    np.testing.assert_allclose(got["loss"], reference["loss"], rtol=2e-2)
    assert got["loss"] != reference["loss"]


def test_zero3_shards_over_dp_wherever_fsdp_shards():
    """ZeRO-3 is fsdp over the dp devices (docs/features.md).

    The sketched factor's input dim included, not "embed" alone.
    """
    from jaxpar.layout import rules_for
    from jaxpar.sharding import RULES

    rules = rules_for(tiny_config("parallel.zero_stage=3", "model.linear=sketched"))
    assert rules["sketch"] == ("fsdp", "dp") and rules["batch"] == RULES["batch"]
    assert all("dp" in rules[name] for name, axes in RULES.items() if "fsdp" in axes)
