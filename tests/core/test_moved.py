"""Old entry points keep working or say where they went.

The shared core's modules moved into folders (jaxpar/moved.py has the table): an old module path fails with one line
naming the new one, every new one exists, and the config's command and names read as before.
"""

import importlib.util
import json
import subprocess
import sys

import pytest

from jaxpar.moved import MOVED
from tests.helpers import ROOT


def python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True)


def test_an_old_module_path_names_its_new_place():
    proc = python("-m", "jaxpar.core.run_dir")
    assert proc.returncode != 0 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "jaxpar.core.run_dir moved to jaxpar.core.run.directory" in proc.stderr


def test_an_old_import_names_its_new_place():
    with pytest.raises(ImportError, match=r"jaxpar\.tools\.hf_gpt2 moved to jaxpar\.formats\.hf_gpt2"):
        importlib.import_module("jaxpar.tools.hf_gpt2")


@pytest.mark.parametrize("old", sorted(MOVED))
def test_every_new_place_exists(old):
    assert importlib.util.find_spec(MOVED[old]) is not None, f"{old} -> {MOVED[old]}, which does not exist"


def test_the_config_command_and_names_read_as_before():
    from jaxpar.core.config import Config, load_config

    assert isinstance(load_config(None, ["train.steps=7"]), Config)
    proc = python("-m", "jaxpar.core.config", "configs/gpt2-tiny.yaml", "train.steps=7")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["train"]["steps"] == 7
