"""Simulated CPU devices for the in-process tests: set before any jax backend starts."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def dataset(tmp_path_factory):
    """A small learnable token file shared by every test (tests/helpers.py)."""
    from tests.helpers import make_dataset

    return make_dataset(tmp_path_factory.mktemp("data") / "tokens.bin")


@pytest.fixture(scope="session")
def reference(dataset):
    """The one-device float32 run of the tiny config: what every layout must reproduce."""
    from tests.helpers import run_steps, tiny_config

    return run_steps(tiny_config(), "dp=1", dataset, devices=jax.devices()[:1])
