"""jaxpar and torchpar compute the same training run.

Same reference config, initial weights and batches -> the same per-step loss, gradient norm and lr, and the same final
parameters.

Default selection: float32 on jaxpar dp=2,tp=4 and every torchpar backend; accum and remat on torchpar's
one process; llama on torchpar's one process and pipeline; float16 on torchpar's one process; bfloat16 on
both one-device sides against their own float32 run. `--parity-full`: every
config on every side. The last two tests show that the checker can fail, and what it then says.
"""

import dataclasses

import numpy as np
import pytest

from parity_tests.compare import FLOAT32, assert_parity, compare
from parity_tests.fuzz_run import Trajectory
from parity_tests.runner import REFERENCE


def _run(runner, config, side, overrides=()):
    reason = runner.unavailable(side)
    if reason:
        pytest.skip(reason)
    return runner.run(config, side, overrides)


def test_parity(case, runner):
    ref = _run(runner, case.config, case.ref_side, case.ref_overrides)
    got = _run(runner, case.config, case.side)
    assert ref.loss[-1] < ref.loss[0] - 0.5, "the reference run should learn something"
    assert_parity(got, ref, case.tol)
    if case.ref_overrides:  # bfloat16 must not be float32 under another name
        assert got.loss != ref.loss


def test_checker_reports_a_different_layernorm_epsilon(runner):
    """torchpar with model.layernorm_eps=1e-3 (jaxpar keeps 1e-5).

    The suite fails, shows the loss table and names a parameter.
    """
    ref = _run(runner, "float32", REFERENCE)
    got = _run(runner, "float32", "torch:none", ["model.layernorm_eps=1e-3"])
    c = compare(got, ref, FLOAT32)
    assert not c.ok
    text = c.message()
    assert "loss: " in text and f"step  {REFERENCE:>14}  {'torch:none':>14}" in text, text
    assert c.first_param and f"first divergent parameter: {c.first_param}" in text, text
    print(text)


def test_checker_names_a_nudged_parameter(runner):
    """One final weight of the torchpar run nudged by 1e-3.

    The step series still pass, the parameter check fails and names exactly that tensor.
    """
    ref = _run(runner, "float32", REFERENCE)
    got = _run(runner, "float32", "torch:none")
    params = dict(got.params)
    params["blocks.mlp.fc.kernel"] = params["blocks.mlp.fc.kernel"].copy()
    params["blocks.mlp.fc.kernel"][1, 3, 5] += 1e-3
    c = compare(dataclasses.replace(got, params=params), ref, FLOAT32)
    assert not c.ok and len(c.failures) == 1, c.message()
    assert c.first_param == "blocks.mlp.fc.kernel", c.message()
    assert "index (1, 3, 5)" in c.message()
    assert np.isclose(c.deviations["param_abs"], 1e-3, rtol=0.1)


def test_checker_reads_both_stacks_in_model_order():
    """model.moe_first_dense's dense stack runs first.

    A nudge there is named before one in the experts' stack, and each stack's attention key bias is held apart (its
    bound from the summed lr), not by the tensor bound.
    """
    rng = np.random.default_rng(0)
    ref = {
        f"{stack}blocks.{n}": rng.normal(size=(2, 3, 4)).astype(np.float32)
        for stack in ("", "dense_")
        for n in ("attn.qkv.bias", "mlp.fc.kernel")
    }
    got = {n: v.copy() for n, v in ref.items()}
    got["blocks.mlp.fc.kernel"][0, 0, 0] += 1e-3
    got["dense_blocks.mlp.fc.kernel"][1, 2, 3] += 1e-3
    got["dense_blocks.attn.qkv.bias"][:, 1] += 1e-3  # the key slice: within 0.01 x sum(lr) = 1e-2
    series = {"loss": [1.0], "grad_norm": [1.0], "lr": [1.0]}
    c = compare(
        Trajectory("torch:none", "moe", params=got, **series), Trajectory("jax", "moe", params=ref, **series), FLOAT32
    )
    assert c.first_param == "dense_blocks.mlp.fc.kernel" and "index (1, 2, 3)" in c.message(), c.message()
    assert c.deviations["key_bias_abs"] == pytest.approx(1e-3, rel=1e-3), c.deviations
    assert "dense_blocks.attn.qkv.bias" not in c.message(), c.message()
