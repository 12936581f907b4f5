"""Shared by tests/ and parity_tests/.

One persistent XLA compilation cache per test session, so that the many trainer processes compiling the same tiny
programs compile each once (a fresh directory: every session still compiles everything at least once).
"""

import atexit
import os
import shutil
import tempfile

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="jaxpar-test-xla-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ.update(
        JAX_COMPILATION_CACHE_DIR=_cache,
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )

# Tests choose their own simulated devices: a device count in the caller's XLA_FLAGS is the user's (jaxpar refuses a
# mesh that needs another, jaxpar/mesh.py), so it would refuse the tests' meshes; dropped for the session
os.environ["XLA_FLAGS"] = " ".join(
    flag
    for flag in os.environ.get("XLA_FLAGS", "").split()
    if not flag.startswith("--xla_force_host_platform_device_count")
)
if not os.environ["XLA_FLAGS"]:
    del os.environ["XLA_FLAGS"]

# jaxpar's CLIs would re-execute themselves to set this (jaxpar/core/run/malloc.py); set here, every trainer process a
# test starts skips that and runs with it from the start
os.environ.setdefault("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")

# Test tiers (README.md "Run the tests"): a test is in the slow tier when its measured duration -- tests/durations.json,
# pytest-split's file, written by `--store-durations` on a 2-core machine -- is over SLOW_S. The default run
# (`python -m pytest`) leaves the slow tier out; `-m slow` runs it alone; CI (.ci/run) runs the default tier and the
# share of the slow tier its commit picks (pytest-split's --splits/--group). A test not measured yet is in the
# default tier; one marked every_commit stays there however long it takes.
import json  # noqa: E402

import pytest  # noqa: E402

DURATIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests", "durations.json")
SLOW_S = 3.0
# CI runs one of this many shares of the slow tier (pytest-split's least_duration groups, balanced by the durations);
# tests/core/test_tiers.py holds the default tier and the largest share to CI's budget
SLOW_SHARES = 18


def measured_durations() -> dict:
    with open(DURATIONS) as f:
        return json.load(f)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    durations = measured_durations()
    for item in items:
        if durations.get(item.nodeid, 0.0) > SLOW_S and item.get_closest_marker("every_commit") is None:
            item.add_marker(pytest.mark.slow)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Print the count line that a single -q ends with, which -qq leaves out.

    pyproject's addopts hold -q, so a -q of one's own (`python -m pytest --co -q`) makes -qq, where pytest prints
    no total (N tests collected, N passed, ...).
    """
    if terminalreporter.verbosity < -1:
        parts, color = terminalreporter.build_summary_stats_line()
        terminalreporter.write_line(", ".join(text for text, _ in parts), **{color: True})
