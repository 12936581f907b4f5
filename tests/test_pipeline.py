"""GPipe over pp reproduces the single-device float32 run; bad pipeline layouts are one-line errors."""
import jax
import numpy as np
import pytest

from jaxpar.errors import UserError
from jaxpar.harness import run_steps
from tests.test_layouts import assert_params_close
from tests.tiny import tiny_config

# 4 layers so that pp=4 has a layer per stage. At the tiny config's lr=1e-2 a 4-layer model lets Adam
# amplify float32 rounding to ~3e-5 in parameters on *any* sharded layout (dp=2,tp=2 too, no pipeline);
# at 3e-3 every layout stays within the 1e-5 bound.
DEEP = ("model.n_layer=4", "optim.lr=3e-3", "optim.min_lr=3e-4")


@pytest.fixture(scope="module")
def reference(dataset):
    return run_steps(tiny_config(*DEEP), "dp=1", dataset, devices=jax.devices()[:1])


@pytest.mark.parametrize("mesh,n", [("pp=2", 2), ("pp=4", 4), ("pp=2,dp=2,tp=2", 8)])
def test_gpipe_matches_single_device(mesh, n, dataset, reference):
    got = run_steps(tiny_config(*DEEP, "parallel.pipeline_schedule=gpipe"), mesh, dataset, devices=jax.devices()[:n])
    np.testing.assert_allclose(got["loss"], reference["loss"], rtol=1e-5)
    assert_params_close(got["params"], reference["params"])


@pytest.mark.parametrize("overrides,message", [
    (("parallel.pipeline_schedule=1f1b",), "not executed yet"),
    (("model.n_layer=3",), "not divisible by stages x virtual stages"),
    (("parallel.pipeline_microbatches=3",), "not divisible by parallel.pipeline_microbatches=3"),
])
def test_bad_pipeline_layouts(overrides, message, dataset):
    with pytest.raises(UserError, match=message):
        run_steps(tiny_config(*DEEP, *overrides), "pp=2", dataset, steps=1, devices=jax.devices()[:2])
