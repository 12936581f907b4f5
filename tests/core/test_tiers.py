"""The test tiers (conftest.py): a test's tier comes from its measured duration in tests/durations.json."""

import glob
import os
import subprocess
import sys

import pytest

from conftest import SLOW_S, SLOW_SHARES, measured_durations

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


@pytest.mark.every_commit  # the tiers' own checks, however long they measure
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


# CI's time (.ci/run) from the measured durations, as a clean clone of 7c888af on a 2-core machine ran: 36.6 minutes
# (then 14 shares), of which 2.9 the setup and first run, 14.2 the slow share (12.1 measured) and 19.5 the default tier
# (11.5 measured: a module's fixtures are measured with its first test, often a slow-tier one). The budget leaves 4 of
# CI's 40 minutes to a slower machine.
CI_BUDGET_S, SETUP_S, DEFAULT_PER_MEASURED, SHARE_PER_MEASURED = 36 * 60, 175, 1.7, 1.2


@pytest.mark.every_commit
def test_ci_runs_the_default_tier_and_one_slow_share_within_its_budget():
    """The setup, the default tier and the largest of the slow tier's SLOW_SHARES shares take CI_BUDGET_S at most.

    A change that breaks it makes tests faster, or raises SLOW_SHARES (each commit then runs less of the slow tier).
    """
    from pytest_split.algorithms import LeastDurationAlgorithm

    durations = measured_durations()
    files = [f for d in ("tests", "parity_tests") for f in glob.glob(f"{ROOT}/{d}/**/test_*.py", recursive=True)]
    marking = [os.path.relpath(f, ROOT) for f in files if "mark.every_commit" in open(f).read()]
    every_commit = {k for k in collected(*marking) if durations.get(k, 0.0) > SLOW_S}
    assert every_commit, "the every_commit tests (the commit's fuzz cases, the spine, ...) stay in the default tier"
    slow = sorted(k for k, v in durations.items() if v > SLOW_S and k not in every_commit)
    default_s = sum(v for k, v in durations.items() if v <= SLOW_S or k in every_commit) * DEFAULT_PER_MEASURED
    shares = LeastDurationAlgorithm()(SLOW_SHARES, [Item(k) for k in slow], durations)
    share_s = max(group.duration for group in shares) * SHARE_PER_MEASURED
    assert "SLOW_SHARES" in open(os.path.join(ROOT, ".ci", "run")).read(), ".ci/run splits the slow tier by it"
    assert SETUP_S + default_s + share_s <= CI_BUDGET_S, (
        f"CI would take {SETUP_S / 60:.1f} minutes (setup) + {default_s / 60:.1f} (default tier) + "
        f"{share_s / 60:.1f} (the largest of {SLOW_SHARES} slow shares), over {CI_BUDGET_S / 60:.0f}"
    )


class Item:
    """What pytest-split's algorithms read of a test item: its node id."""

    def __init__(self, nodeid: str):
        self.nodeid = nodeid
