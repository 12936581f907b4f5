"""Run `python -m jaxpar.train` as a subprocess, as a user would, and read what it wrote."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.tiny import TINY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(run_dir, dataset, *args, env=None, timeout=300, module="jaxpar.train"):
    cmd = [sys.executable, "-m", module, *TINY, f"data.dataset={dataset}", f"run.dir={run_dir}", *args]
    full_env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


def metrics(run_dir) -> dict[int, dict]:
    """step -> record; a step logged twice (a resumed run repeats steps) keeps its last record."""
    out = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            out[rec["step"]] = rec
    return out
