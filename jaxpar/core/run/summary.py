"""What a run says about itself: where it is going at the start, and at its end what it did and what comes next.

Printed by the main process of either trainer (jaxpar/core/run/loop.py); the commands name the run's own directory,
so each can be pasted as it is. Nothing here imports jax or torch.
"""

from __future__ import annotations

import os
import shlex
import statistics
from dataclasses import dataclass, field

from jaxpar.core.config.mesh_spec import parse_mesh
from jaxpar.core.config.schema import Config
from jaxpar.core.run.directory import converted_dir, framework_of, step_dirs


@dataclass
class Outcome:
    """What one call of the training loop did (filled by the loop and the metrics log)."""

    first_step: int  # the step it started from (0 for a new run)
    last_step: int = 0  # the last step it completed
    stopped_by: str | None = None  # what stopped it before train.steps (a signal), if anything did
    loss: float | None = None  # the last logged training loss
    eval_loss: float | None = None  # the last evaluation
    rates: list = field(default_factory=list)  # tokens/s of every record
    mfus: list = field(default_factory=list)  # MFU of every record where known


def start_line(cfg: Config, framework: str, step: int) -> str:
    """The line that says where the run goes.

    A new run in a default directory also names the run the same config made before run directories were per framework
    (runs/<config name>), which it does not continue.
    """
    where = f"resuming at step {step} of {cfg.train.steps}" if step else f"{cfg.train.steps} steps from scratch"
    line = f"{framework}: run {cfg.run.dir} ({where}; metrics, checkpoints and config.json there)"
    parent, name = os.path.split(os.path.normpath(cfg.run.dir))
    older = os.path.join(os.path.dirname(parent), name)
    if not step and os.path.basename(parent) == framework and framework_of(older) == framework:
        line += f"; {older} holds an earlier {framework} run of this config: run.dir={older} continues it"
    return line


def next_commands(cfg: Config, framework: str, info: dict, steps_done: int) -> list[tuple[str, str]]:
    """(what, command) of the steps a person takes next with this run."""
    run = shlex.quote(os.path.normpath(cfg.run.dir))
    more = f"train.steps={max(2 * steps_done, steps_done + 1)}"
    processes, backend = info.get("processes", 1), info.get("backend", "ddp")
    here = int(os.environ.get("LOCAL_WORLD_SIZE", processes))  # torchrun's processes on this node
    if framework == "jaxpar" and processes == 1:
        mesh = f" --mesh {info['resolved_mesh']}" if info.get("resolved_mesh") else ""
        go_on = f"python -m jaxpar.train --config {run}/config.json{mesh} {more}"
    elif framework == "torchpar" and processes == here:  # one node: its launch is known
        launch = f"torchrun --nproc_per_node={processes} -m" if processes > 1 else "python -m"
        go_on = f"{launch} torchpar.train --config {run}/config.json --backend {backend} {more}"
    else:
        go_on = f"this run's launch, with --config {run}/config.json {more}"
    other = "torchpar" if framework == "jaxpar" else "jaxpar"
    convert = f"python -m jaxpar.tools.convert --from {framework} {run}"
    sample = f'python -m {framework}.generate --run {run} --prompt "def "'
    evaluate = f"python -m {framework}.eval --run {run} --tasks hellaswag,arc_easy --limit 200"
    if backend == "deepspeed":  # torchpar.generate and .eval read DCP runs; DeepSpeed's through a weights file
        weights = shlex.quote(converted_dir(cfg.run.dir, framework, "shared") + ".safetensors")
        sample = f'{convert} --to shared {weights} && python -m torchpar.generate --weights {weights} --prompt "def "'
        evaluate = (
            f"{convert} --to shared {weights} && python -m torchpar.eval --weights {weights} "
            f"--tasks hellaswag,arc_easy --limit 200 --output {run}/evals/last.json"
        )
    meshes = (info.get("resolved_mesh"), cfg.parallel.mesh)  # DiLoCo's groups: their state converts nowhere yet
    groups = any(parse_mesh(m).get("diloco", 1) != 1 for m in meshes if m)
    move = (
        []
        if groups
        else [(other, f"{convert} --to {other} {shlex.quote(converted_dir(cfg.run.dir, framework, other))}")]
    )
    return [
        ("sample", sample),
        ("curves", f"python -m jaxpar.tools.report {run}"),
        ("evaluate", evaluate),
        ("continue", go_on),
        *move,
        ("hugging face", f"{convert} --to hf {shlex.quote(converted_dir(cfg.run.dir, framework, 'hf'))}"),
    ]


def summary_lines(cfg: Config, framework: str, info: dict, outcome: Outcome, wall_s: float) -> list[str]:
    """The run's last lines: what it did, its numbers, its checkpoints and the next commands."""
    o = outcome
    how = f"stopped by {o.stopped_by} after step {o.last_step}" if o.stopped_by else f"trained to step {o.last_step}"
    lines = [f"{framework}: {how} of {cfg.train.steps} (from step {o.first_step}) in {wall_s:.0f} s; run {cfg.run.dir}"]
    numbers = []
    if o.loss is not None:
        numbers.append(f"loss {o.loss:.4f}")
    if o.eval_loss is not None:
        numbers.append(f"eval loss {o.eval_loss:.4f}")
    if o.rates:
        numbers.append(f"{statistics.median(o.rates):,.0f} tokens/s")
    if o.mfus:
        numbers.append(f"MFU {statistics.median(o.mfus):.1%}")
    kept = step_dirs(os.path.join(cfg.run.dir, "checkpoints"))
    numbers.append(
        f"checkpoint{'s' * (len(kept) > 1)} at step{'s' * (len(kept) > 1)} {', '.join(map(str, kept))}"
        if kept
        else "no checkpoint kept"
    )
    lines.append("  " + " | ".join(numbers))
    commands = next_commands(cfg, framework, info, o.last_step)
    if o.stopped_by:  # the same command resumes it; the rest waits for the run to finish
        commands = [c for c in commands if c[0] == "continue"]
        commands[0] = ("continue", commands[0][1].rsplit(" train.steps=", 1)[0] + f" train.steps={cfg.train.steps}")
    lines.append("next:")
    width = max(len(what) for what, _ in commands)
    lines += [f"  {what:<{width}}  {command}" for what, command in commands]
    return lines
