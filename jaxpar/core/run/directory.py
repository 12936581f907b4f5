"""Which framework a run directory belongs to, and where a run goes when the config names no directory.

A run directory is one framework's: jaxpar's orbax checkpoints and torchpar's DCP or DeepSpeed ones cannot be
read by the other trainer, and two trainers appending to one metrics.jsonl mix two runs. The trainers record
their name in config.json ("framework"); a directory written before that is recognised by what it holds.
Nothing here imports jax or torch.
"""

from __future__ import annotations

import dataclasses
import json
import os

from jaxpar.core.config.schema import Config
from jaxpar.core.errors import UserError

FRAMEWORKS = ("jaxpar", "torchpar")
RUN_FILES = ("config.json", "metrics.jsonl", "checkpoints")  # what makes a directory a run


def default_run_dir(framework: str, config_path: str | None) -> str:
    """runs/<framework>/<the config file's name>: the README's two trainers on one config never share a directory."""
    name = os.path.splitext(os.path.basename(config_path.rstrip("/")))[0] if config_path else "default"
    return os.path.join("runs", framework, name)


def with_run_dir(cfg: Config, framework: str, config_path: str | None) -> Config:
    """`cfg` with run.dir filled in where the config left it empty."""
    if cfg.run.dir:
        return cfg
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=default_run_dir(framework, config_path)))


def step_dirs(ckpt_dir: str) -> list[int]:
    """The steps of a checkpoints folder's step directories (named by their step), in order; [] without one."""
    return sorted(int(d) for d in os.listdir(ckpt_dir) if d.isdigit()) if os.path.isdir(ckpt_dir) else []


def holds_run(run_dir: str) -> bool:
    return os.path.isdir(run_dir) and any(os.path.exists(os.path.join(run_dir, n)) for n in RUN_FILES)


def framework_of(run_dir: str) -> str | None:
    """The framework whose run `run_dir` holds.

    From config.json's record, else what its files show (a run written before the record: torchpar's config.json names a
    backend, its checkpoints are DCP's `.metadata` or DeepSpeed's `latest`; jaxpar's are orbax's), else None (no
    run, or nothing to tell by).
    """
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            record = json.load(f)
    except (OSError, ValueError):
        record = {}
    record = record if isinstance(record, dict) else {}
    if record.get("framework") in FRAMEWORKS:
        return record["framework"]
    if "backend" in record:
        return "torchpar"
    if "resolved_mesh" in record:
        return "jaxpar"
    ckpts = os.path.join(run_dir, "checkpoints")
    if os.path.exists(os.path.join(ckpts, "latest")):
        return "torchpar"  # DeepSpeed's
    for step in (os.path.join(ckpts, str(s)) for s in step_dirs(ckpts)):
        if os.path.exists(os.path.join(step, ".metadata")) or os.path.exists(os.path.join(step, "meta.json")):
            return "torchpar"
        if os.path.exists(os.path.join(step, "_CHECKPOINT_METADATA")) or os.path.isdir(os.path.join(step, "state")):
            return "jaxpar"
    return None


def converted_dir(run_dir: str, framework: str, to: str) -> str:
    """Where a conversion of `framework`'s run into the format `to` (a framework, or hf) goes by default.

    Runs/<to>/<name>-from-<framework> beside runs/<framework>/<name>, else <run_dir>-<to>.
    """
    src = os.path.normpath(run_dir)
    parent, name = os.path.split(src)
    if os.path.basename(parent) == framework:
        return os.path.join(os.path.dirname(parent), to, f"{name}-from-{framework}")
    return f"{src}-{to}"


def convert_hint(run_dir: str, held_by: str, wanted: str) -> str:
    """The command that turns `held_by`'s run into one `wanted` can read."""
    src = os.path.normpath(run_dir)
    return f"python -m jaxpar.tools.convert --from {held_by} {src} --to {wanted} {converted_dir(src, held_by, wanted)}"


def check_framework(run_dir: str, framework: str, doing: str) -> None:
    """Refuse, in one line naming the conversion, a run directory that holds the other framework's run.

    `doing`: what this command would do with it ("resume", "sample").
    """
    held_by = framework_of(run_dir)
    if held_by is None or held_by == framework:
        return
    tools = {"sample": f"python -m {held_by}.generate", "evaluate": f"python -m {held_by}.eval"}
    instead = tools.get(doing, f"{held_by}.train, or another run.dir")
    raise UserError(
        f"{run_dir} holds a {held_by} run; {framework} cannot {doing} it. Convert it first: "
        f"{convert_hint(run_dir, held_by, framework)} (or use {instead})"
    )


def check_run_dir_framework(cfg: Config, framework: str) -> None:
    """A trainer about to resume run.dir.

    Refused there when it holds the other framework's run (with checkpoint.resume=false any old run is moved aside
    instead).
    """
    if cfg.checkpoint.resume and holds_run(cfg.run.dir):
        check_framework(cfg.run.dir, framework, "resume")


def foreign_checkpoint(ckpt_dir: str, step: int) -> UserError:
    """A save finding its step written already by another run: never skipped, never overwritten."""
    return UserError(
        f"{os.path.join(ckpt_dir, str(step))} exists and was not written by this run (another run "
        "in the same run.dir?): it is left as it is and this save refused; move it away or choose "
        "another run.dir"
    )
