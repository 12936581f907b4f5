"""The other framework's run directory, met by a trainer or a sampler (each command's own main, in-process).

One `error:` line naming the conversion, exit status 2, and the directory exactly as it was.
"""

import json
import os

import pytest

from tests.e2e.test_cli_input import assert_one_error_line
from tests.helpers import TINY

RUNS = {  # as each framework's run looks on disk, without the config.json record (a run written before it)
    "torchpar": {
        "checkpoints/4/.metadata": "",
        "checkpoints/4/meta.json": json.dumps({"step": 4}),
        "config.json": json.dumps({"model": {}, "backend": "ddp", "world_size": 1}),
        "metrics.jsonl": "",
    },
    "jaxpar": {
        "checkpoints/4/_CHECKPOINT_METADATA": "{}",
        "checkpoints/4/state/x": "",
        "config.json": json.dumps({"model": {}}),
        "metrics.jsonl": "",
    },
}


def plant(run_dir, held_by: str) -> dict:
    for rel, text in RUNS[held_by].items():
        os.makedirs(os.path.dirname(run_dir / rel), exist_ok=True)
        (run_dir / rel).write_text(text)
    return tree(run_dir)


def tree(run_dir) -> dict:
    return {
        os.path.relpath(os.path.join(d, f), run_dir): open(os.path.join(d, f)).read()
        for d, _, files in os.walk(run_dir)
        for f in files
    }


@pytest.mark.parametrize(
    "command, held_by",
    [
        ("jaxpar.train", "torchpar"),
        ("torchpar.train", "jaxpar"),
        ("jaxpar.generate", "torchpar"),
        ("torchpar.generate", "jaxpar"),
    ],
)
def test_the_other_frameworks_run_is_refused_naming_convert(command, held_by, tmp_path, capsys):
    import importlib

    run_dir = tmp_path / held_by / "run"
    before = plant(run_dir, held_by)
    framework = command.split(".")[0]
    if command.endswith("train"):
        argv = [*TINY, f"run.dir={run_dir}"] + (["--backend", "none"] if framework == "torchpar" else [])
    else:
        argv = ["--run", str(run_dir), "--prompt", "x", "--max-new-tokens", "2"]
    rc = importlib.import_module(command).main(argv)
    assert_one_error_line(
        rc,
        capsys,
        f"holds a {held_by} run",
        f"python -m jaxpar.tools.convert --from {held_by} "
        f"{run_dir} --to {framework} {tmp_path / framework / 'run-from-'}{held_by}",
    )
    assert tree(run_dir) == before
