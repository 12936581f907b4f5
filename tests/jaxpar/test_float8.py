"""model.float8 in jaxpar (jaxpar/ops.py).

Each projection multiplies float8 copies of its input and weight (e4m3, tensorwise current scaling) and, backward, an
e5m2 copy of its output gradient. On a CPU XLA upcasts the float8 operands (emulated): the numbers are float8's, the
speed is not.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.core.errors import UserError
from jaxpar.ops import FLOAT8, project, to_float8
from jaxpar.step import build_step
from tests.helpers import run_steps, tiny_config

FLOAT8_ON = ("model.float8=true",)


def test_a_projection_is_float8s_product_forward_and_backward():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, 8, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 3, 16)) * 0.1, jnp.float32)
    dy = jnp.asarray(rng.standard_normal((4, 8, 3, 16)), jnp.float32)

    def grads(on: bool):
        token = FLOAT8.set(on)
        try:
            y, pull = jax.vjp(lambda a, b: project(a, b), x, w)
            return (y, *pull(dy))
        finally:
            FLOAT8.reset(token)

    exact, ours = grads(False), grads(True)
    # the same products of the float8 copies, computed here in float32 from to_float8's values and scales
    (x8, sx), (w8, sw), (dy8, sdy) = (
        to_float8(x, jnp.float8_e4m3fn),
        to_float8(w, jnp.float8_e4m3fn),
        to_float8(dy, jnp.float8_e5m2),
    )
    up = lambda t: t.astype(jnp.float32)
    expected = (
        jnp.tensordot(up(x8), up(w8), 1) * sx * sw,
        jnp.tensordot(up(dy8), up(w8), ((2, 3), (1, 2))) * sdy * sw,
        jnp.tensordot(up(x8), up(dy8), ((0, 1), (0, 1))) * sx * sdy,
    )
    for got, want, full in zip(ours, expected, exact):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))
        err = float(jnp.linalg.norm(got - full) / jnp.linalg.norm(full))
        assert 1e-3 < err < 0.1, err  # float8's rounding, not float32's: 3 (e4m3) and 2 (e5m2) mantissa bits
    assert float(jnp.abs(x8.astype(jnp.float32)).max()) == 448.0  # the largest e4m3 value: the scale is the amax's


def test_one_device_layouts_and_the_setting_acts(dataset, reference):
    """dp=2,tp=2 against one device.

    The scales are whole tensors' (the same on every layout), but an activation whose last bits differ can round to
    the neighbouring float8 value, so float8 layouts agree within float8's band, not float32's: measured 6.4e-5 in
    loss over 10 steps, against 1.2e-3 between float8 and float32.
    """
    ref = run_steps(tiny_config(*FLOAT8_ON), "dp=1", dataset, devices=jax.devices()[:1])
    got = run_steps(tiny_config(*FLOAT8_ON), "dp=2,tp=2", dataset, devices=jax.devices()[:4])
    assert ref["loss"][-1] < ref["loss"][0] - 0.1
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=5e-4)
    assert np.abs(np.array(reference["loss"]) / np.array(ref["loss"]) - 1).max() > 5e-4  # float32's run: elsewhere


def test_the_split_backward_schedules_refuse_it():
    with pytest.raises(UserError, match="does not run model.float8"):
        build_step(
            tiny_config(*FLOAT8_ON, "model.n_layer=4", "parallel.pipeline_schedule=zb_h1"), {"pp": 2}, jax.devices()[:2]
        )
