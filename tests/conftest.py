"""Simulated CPU devices for the in-process tests: set before any jax backend starts."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from jaxpar.mesh import size_cpu_pool  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
size_cpu_pool(8)  # as the trainer does for its simulated devices
jax.config.update("jax_default_matmul_precision", "highest")

import signal  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _signal_handlers():
    """A trainer run in-process sets SIGTERM/SIGINT handlers (stop_requests, then ignore_stop_requests).

    Put the test process's back, so later tests and the processes they start do not inherit them (an ignored SIGTERM
    is inherited across exec).
    """
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


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
