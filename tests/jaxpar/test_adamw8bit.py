"""optim.name=adamw8bit in jaxpar (jaxpar/optim.py, jaxpar/core/optimizer/adamw8bit.py).

Sharded layouts equal one device over 10 steps (the loss within 1e-5; the weights within the band of
parity_tests/compare.py's EIGHT_BIT), a run stops and resumes exactly, and the state is about a quarter of AdamW's -- in
the planner and in the arrays a run holds. (The codes against torchao's, and jaxpar against torchpar:
tests/torchpar/test_adamw8bit.py.)
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.core.optimizer import adamw8bit
from jaxpar.core.config.schema import load_config
from jaxpar.tools.plan import plan
from jaxpar.step import build_step
from parity_tests.compare import EIGHT_BIT as BAND
from tests.helpers import assert_params_close, assert_resumes_exactly, run_steps, tiny_config

EIGHT_BIT = ("optim.name=adamw8bit",)


@pytest.fixture(scope="module")
def eight_bit_reference(dataset):
    return run_steps(tiny_config(*EIGHT_BIT), "dp=1", dataset, devices=jax.devices()[:1])


@pytest.mark.parametrize(
    "mesh,extra",
    [
        ("dp=2,fsdp=2,tp=2", ("parallel.zero_stage=1",)),
        ("pp=2,sp=2", ()),
        ("fsdp=2,ep=2", ("model.moe_experts=4", "model.moe_d_ff=64")),
    ],
)
def test_layout_matches_one_device(mesh, extra, dataset, eight_bit_reference, reference):
    n = int(np.prod([int(p.split("=")[1]) for p in mesh.split(",")]))
    moe = any("moe" in e for e in extra)
    ref = (
        eight_bit_reference
        if not moe
        else run_steps(tiny_config(*EIGHT_BIT, *extra), "dp=1", dataset, devices=jax.devices()[:1])
    )
    got = run_steps(tiny_config(*EIGHT_BIT, *extra), mesh, dataset, devices=jax.devices()[:n])
    assert ref["loss"][-1] < ref["loss"][0] - 0.1, "the reference run should learn something"
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5)
    np.testing.assert_allclose(got["grad_norm"], ref["grad_norm"], rtol=1e-4)
    # weights one code away in a moment step differently: parity_tests/compare.py's EIGHT_BIT band
    assert_params_close(got["params"], ref["params"], rel=BAND.params, most=BAND.param_abs)
    if not moe:  # the setting is acted on: AdamW's float32 moments (tests/conftest.py's run) go elsewhere
        assert np.abs(np.array(reference["loss"][2:]) - ref["loss"][2:]).max() > 1e-5


def test_resume_after_sigkill_is_exact(tmp_path, dataset):
    assert_resumes_exactly(tmp_path, dataset, [*EIGHT_BIT, "checkpoint.every=3"], kill_after=4)


def test_the_state_is_a_quarter_of_adamws_planned_and_held():
    """configs/gpt2-tiny.yaml (every matrix and the embeddings hold codes; norms and biases float32 moments).

    1 byte per moment value and a float32 scale per 64 against AdamW's 4 bytes -- 0.27x, under the issue's 0.3x --
    in the planner's figure on fsdp=2 and in the bytes of the state a run initialises on one device.
    """
    base = load_config("configs/gpt2-tiny.yaml")
    eight = load_config("configs/gpt2-tiny.yaml", list(EIGHT_BIT))
    planned = [plan(c, {"fsdp": 2}, jax.devices()[:2])["opt_state_bytes"] for c in (base, eight)]
    held = [
        sum(x.nbytes for x in jax.tree.leaves(build_step(c, {"dp": 1}, jax.devices()[:1])[1]["opt_state"]))
        for c in (base, eight)
    ]
    for adamw, ours in (planned, held):
        assert 0.25 < ours / adamw <= 0.3, (ours, adamw)
    codes = [
        x
        for x in jax.tree.leaves(build_step(eight, {"dp": 1}, jax.devices()[:1])[1]["opt_state"])
        if x.dtype == jnp.uint8
    ]
    assert sum(x.size for x in codes) > 0.95 * held[0] / 8  # nearly every moment value is a code
    assert all(x.size % adamw8bit.BLOCK == 0 for x in codes)
