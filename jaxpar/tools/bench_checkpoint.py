"""Checkpoint-stall benchmark: the train step's time with and without a save started in it.

python -m jaxpar.tools.bench_checkpoint --config C --mesh M [--steps 24 --every 6] [--record] [k=v ...]

What a checkpoint save costs the training step it starts in: the real train step and the real Checkpointer
(orbax) on synthetic tokens, a save started before every `--every`-th timed step. Each timed step is "save
(if due) + step + wait for the step's result"; reported: the median plain step, the median step with a
save started in it, asynchronous (the trainer's) and blocking, and their ratios; and how long after its start
an asynchronous save is on disk (saves closer together than that wait for each other). Each save starts after
the previous one has finished, as in a real run. `--record` appends a dated row to docs/benchmarks/checkpoint-stall.md.
"""

from __future__ import annotations

if __name__ == "__main__":  # before jax is imported: glibc reads its malloc tunables at process start
    from jaxpar.core.run.malloc import relaunch_with_huge_pages

    relaunch_with_huge_pages("jaxpar.tools.bench_checkpoint")

import argparse
import datetime
import platform
import shlex
import sys
import tempfile
import time

import numpy as np

from jaxpar.core.bench_records import append_row
from jaxpar.core.config.schema import load_config
from jaxpar.core.errors import UserError, cli
from jaxpar.core.config.mesh_spec import format_mesh, parse_mesh
from jaxpar.mesh import setup_devices
from jaxpar.tools.bench import warm_step

HEADER = (
    "| date | device | config | mesh | plain step s | async save step s (ratio; of it the save call) | "
    "async save on disk after s | blocking save step s (ratio) | versions | command |\n"
    "|---|---|---|---|---|---|---|---|---|---|\n"
)


def timed_steps(step, state, batch, steps: int, every: int, ckpt):
    """Runs the steps with a save every `every` steps, and times them.

    Returns (plain step times, times of the steps a save started in, times of the save calls alone, times from a save's
    start to its end on disk, final state).
    """
    import jax  # deferred: jax (~1 s), after the arguments are checked

    plain, saving, calls, written = [], [], [], []
    for i in range(1, steps + 1):
        due = i % every == 0
        if due:  # the previous save finishes first, untimed: a real run saves hundreds of steps apart, and orbax's
            ckpt.wait()  # save() would otherwise wait for it, which measures the disk, not the stall
        t0 = time.perf_counter()
        if due:
            ckpt.save(i, state, {"step": i})
            calls.append(time.perf_counter() - t0)
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        (saving if due else plain).append(time.perf_counter() - t0)
        if due:
            ckpt.wait()  # timed apart from the steps: how far apart saves can be before one waits for another
            written.append(time.perf_counter() - t0)
    return plain, saving, calls, written, state


def bench(cfg, sizes, steps: int, every: int, warmup: int) -> dict:
    import jax  # deferred: jax (~1 s), after the arguments are checked

    from jaxpar.checkpoint import Checkpointer  # deferred: orbax, jax (~1 s), after the arguments are checked

    step, state, batch, layout = warm_step(cfg, sizes, warmup)
    out = {}
    for mode, asynchronous in (("async", True), ("blocking", False)):
        with tempfile.TemporaryDirectory() as run_dir:
            ckpt = Checkpointer(run_dir, keep=2, asynchronous=asynchronous)
            plain, saving, calls, written, state = timed_steps(step, state, batch, steps, every, ckpt)
            ckpt.close()
        out[mode] = [float(np.median(t)) for t in (plain, saving, calls, written)]
    plain_s = min(out["async"][0], out["blocking"][0])  # the plain steps of both passes agree; take the quieter
    device = jax.devices()[0]
    return {
        "date": datetime.date.today().isoformat(),
        "device": f"{device.platform}:{device.device_kind}",
        "mesh": format_mesh(dict(layout.mesh.shape)),
        "plain_step_s": plain_s,
        "async_save_step_s": out["async"][1],
        "blocking_save_step_s": out["blocking"][1],
        "async_ratio": out["async"][1] / plain_s,
        "blocking_ratio": out["blocking"][1] / plain_s,
        "async_call_s": out["async"][2],
        "async_written_s": out["async"][3],
        "versions": {"jax": jax.__version__, "python": platform.python_version()},
        "command": "python -m jaxpar.tools.bench_checkpoint " + shlex.join(sys.argv[1:]),
    }


@cli
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m jaxpar.tools.bench_checkpoint",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--config")
    ap.add_argument("--mesh", default="dp=1")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--every", type=int, default=6, help="start a save before every N-th timed step")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--record", action="store_true", help="append a row to docs/benchmarks/checkpoint-stall.md")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args(argv)
    if not 1 <= args.every < args.steps or args.warmup < 0:
        raise UserError("need 1 <= --every < --steps and --warmup >= 0")
    cfg = load_config(args.config, args.overrides)
    sizes = parse_mesh(args.mesh)
    setup_devices(sizes)
    r = bench(cfg, sizes, args.steps, args.every, args.warmup)
    row = (
        f"| {r['date']} | {r['device']} | {args.config or 'defaults'} | {r['mesh']} | {r['plain_step_s']:.3f} | "
        f"{r['async_save_step_s']:.3f} ({r['async_ratio']:.2f}x; {r['async_call_s']:.3f}) | "
        f"{r['async_written_s']:.3f} | "
        f"{r['blocking_save_step_s']:.3f} "
        f"({r['blocking_ratio']:.2f}x) | {', '.join(f'{k} {v}' for k, v in r['versions'].items())} | "
        f"`{r['command']}` |"
    )
    print(HEADER + row)
    if args.record:
        append_row("checkpoint-stall.md", HEADER, row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
