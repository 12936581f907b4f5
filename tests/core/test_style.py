"""The house style has tools behind it, and a drift fails here, so in CI.

`ruff format` and `ruff check` (configured in pyproject.toml) hold on the whole tree, and no line of code is over
120 characters.
"""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
LIMIT = 120


def ruff(*args: str) -> subprocess.CompletedProcess:
    try:
        import ruff  # noqa: F401  installed by the test extra (pyproject.toml)
    except ImportError:
        pytest.fail("ruff is not installed: pip install -e '.[test]' (setup.sh does)")
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True)


def long_lines(texts: dict[str, str], limit: int = LIMIT) -> list[tuple[str, int]]:
    """(file, line number) of every line longer than `limit` characters."""
    return [
        (name, i)
        for name, text in sorted(texts.items())
        for i, line in enumerate(text.splitlines(), 1)
        if len(line) > limit
    ]


def test_the_tree_is_formatted():
    proc = ruff("format", "--check", ".")
    assert proc.returncode == 0, f"run `ruff format .`:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}"


def test_the_linter_passes():
    proc = ruff("check", ".")
    assert proc.returncode == 0, f"run `ruff check .`:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}"


def test_no_line_of_code_is_over_120_characters():
    files = [p for d in ("jaxpar", "torchpar", "tests", "parity_tests", "benchmarks") for p in (ROOT / d).rglob("*.py")]
    texts = {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in [*files, ROOT / "conftest.py"]}
    assert not (bad := long_lines(texts)), f"lines over {LIMIT} characters (file, line): {bad[:20]}"


def test_the_line_check_can_fail():
    assert long_lines({"a.py": "x = 1\n" + "y" * 121 + "\n" + "z" * 120}) == [("a.py", 2)]
