"""jaxpar and torchpar compute the same training run: same reference config, initial weights and
batches -> the same per-step loss, gradient norm and lr, and the same final parameters.

Default selection: float32 on jaxpar dp=2,tp=4 and every torchpar backend; accum and remat on torchpar's
one process; llama on torchpar's one process and pipeline; float16 on torchpar's one process; bfloat16 on
both one-device sides against their own float32 run. `--parity-full`: every
config on every side. The last two tests show that the checker can fail, and what it then says.
"""
import dataclasses

import numpy as np
import pytest

from parity_tests.compare import FLOAT32, assert_parity, compare
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
    """torchpar with model.layernorm_eps=1e-3 (jaxpar keeps 1e-5): the suite fails, shows the loss table
    and names a parameter."""
    ref = _run(runner, "float32", REFERENCE)
    got = _run(runner, "float32", "torch:none", ["model.layernorm_eps=1e-3"])
    c = compare(got, ref, FLOAT32)
    assert not c.ok
    text = c.message()
    assert "loss: " in text and f"step  {REFERENCE:>14}  {'torch:none':>14}" in text, text
    assert c.first_param and f"first divergent parameter: {c.first_param}" in text, text
    print(text)


def test_checker_names_a_nudged_parameter(runner):
    """One final weight of the torchpar run nudged by 1e-3: the step series still pass, the parameter
    check fails and names exactly that tensor."""
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
