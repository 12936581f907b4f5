"""The test tiers (conftest.py): a test's tier comes from its measured duration in tests/durations.json."""

import glob
import os
import subprocess
import sys

from conftest import SLOW_S, measured_durations

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_test_file_is_measured_and_every_measurement_names_a_file():
    """A test file missing from the durations would put all its tests in the default tier, however slow.

    Measure it with `python -m pytest FILE -m "" --store-durations`.
    """
    measured = {nodeid.split("::")[0] for nodeid in measured_durations()}
    files = {
        os.path.relpath(f, ROOT)
        for d in ("tests", "parity_tests")
        for f in glob.glob(os.path.join(ROOT, d, "**", "test_*.py"), recursive=True)
        if "\ndef test_" in open(f).read()
    }
    assert sorted(files - measured) == [], "test files without measured durations"
    assert sorted(measured - files) == [], "durations of test files that no longer exist"


def collected(*args) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return {line for line in out.stdout.splitlines() if "::" in line}


def test_the_slow_tier_is_the_tests_measured_slow_but_the_commits_fuzz_cases():
    """`-m slow` collects the measured-slow tests, while the commit's fuzz cases stay in the default tier.

    tests/e2e/test_fuzz.py holds fast tests, slow ones and every_commit ones (the commit's fuzz cases, slow but in the
    default tier): `-m slow` collects exactly the measured-slow others, the default run the rest.
    """
    path = "tests/e2e/test_fuzz.py"
    every_commit = {f"{path}::test_two_cases_of_this_commit", f"{path}::test_two_transitions_of_this_commit"}
    durations = {k: v for k, v in measured_durations().items() if k.startswith(path + "::")}
    slow = {k for k, v in durations.items() if v > SLOW_S} - every_commit
    assert slow and every_commit <= set(durations) and min(durations[k] for k in every_commit) > SLOW_S
    assert collected(path, "-m", "slow") == slow
    default = collected(path)
    assert every_commit <= default and not default & slow and len(default) > len(every_commit)
