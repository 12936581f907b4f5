"""Options of the parity suite.

--parity-full (the whole matrix), --device cpu|gpu (or PARITY_DEVICE), --parity-steps K (or PARITY_STEPS; default 50).
One Runner per session caches every run.
"""

import os

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("parity", "jaxpar <-> torchpar parity suite (parity_tests/)")
    group.addoption("--parity-full", action="store_true", help="run every config x every layout/backend")
    group.addoption(
        "--device",
        choices=("cpu", "gpu"),
        default=None,
        help="where the parity runs train (default: $PARITY_DEVICE or cpu)",
    )
    group.addoption("--parity-steps", type=int, default=None, help="steps per run (default: $PARITY_STEPS or 50)")


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        from parity_tests.matrix import cases

        selected = cases(full=metafunc.config.getoption("--parity-full"))
        metafunc.parametrize("case", selected, ids=[c.id for c in selected])


@pytest.fixture(scope="session")
def runner(request, tmp_path_factory):
    from parity_tests.runner import Runner

    device = request.config.getoption("--device") or os.environ.get("PARITY_DEVICE", "cpu")
    steps = request.config.getoption("--parity-steps") or int(os.environ.get("PARITY_STEPS", "50"))
    return Runner(tmp_path_factory.mktemp("parity"), device=device, steps=steps)
