"""A run's start does what it needs, once.

Importing the trainer loads no tool and no optional library, and before the first step the checks of each (config, mesh)
and the automatic pipeline schedule's probe each run once.
"""

import collections
import json
import os
import re
import subprocess
import sys

from tests.helpers import ROOT

OPTIONAL = {
    "torch",
    "transformers",
    "matplotlib",
    "tensorboard",
    "tensorboardX",
    "wandb",
    "deepspeed",
    "tokenizers",
    "pyarrow",
}

# In a fresh process: count the checks and the probe while `python -m jaxpar.train` resolves parallel.
# pipeline_schedule=auto on pp=2, validates, builds its trainer and writes the initial weights (--write-init stops
# there, before the first step). Each counted function is replaced by a counting wrapper around it.
COUNT = r"""
import collections, json, sys
from jaxpar import checks, train
from jaxpar.pipeline import auto

counts = collections.Counter()

def counted(module, name, key):
    real = getattr(module, name)
    def wrapper(*args, **kwargs):
        counts[key(*args, **kwargs)] += 1
        return real(*args, **kwargs)
    setattr(module, name, wrapper)

def at(cfg, sizes):
    return f"{cfg.parallel.pipeline_schedule} {sorted(dict(sizes).items())}"

counted(checks, "divisibility", lambda cfg, sizes: "layout " + at(cfg, sizes))
counted(checks, "check_contract", lambda run: "contract " + at(run.cfg, run.mesh))
counted(train, "validate", lambda *args, **kwargs: "validate")
counted(train, "resolve_schedule", lambda *args, **kwargs: "resolve_schedule")
counted(auto, "step_flops", lambda cfg, sizes, devices, on: "probe " + at(cfg, sizes))
train.main(sys.argv[1:])
print(json.dumps(counts))
"""


def test_importing_the_trainer_loads_no_tool_and_no_optional_library():
    code = "import sys, jaxpar.train; print(' '.join(sorted(sys.modules)))"
    loaded = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert "jaxpar.train" in loaded
    assert not [m for m in loaded if m.startswith("jaxpar.tools")], "jaxpar.train loads the tools folder"
    assert not [m for m in loaded if m.split(".")[0] in OPTIONAL], "jaxpar.train loads an optional library"


def test_the_checks_and_the_auto_schedules_probe_each_run_once(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    args = [
        "--config",
        "configs/gpt2-tiny.yaml",
        "--mesh",
        "pp=2",
        "--write-init",
        str(tmp_path / "init.safetensors"),
        f"run.dir={tmp_path / 'run'}",
        "parallel.pipeline_schedule=auto",
    ]
    proc = subprocess.run([sys.executable, "-c", COUNT, *args], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = collections.Counter(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert counts.pop("validate") == 1 and counts.pop("resolve_schedule") == 1, counts
    chosen = re.search(r"pipeline schedule auto -> (\w+)", proc.stderr).group(1)
    assert any(k.startswith("layout ") for k in counts) and any(k.startswith("probe ") for k in counts), counts
    assert (
        f"layout {chosen} {sorted({'diloco': 1, 'dp': 1, 'fsdp': 1, 'tp': 1, 'pp': 2, 'sp': 1, 'ep': 1}.items())}"
        in counts
    )
    assert {k: n for k, n in counts.items() if n != 1} == {}, "checked or probed more than once"
