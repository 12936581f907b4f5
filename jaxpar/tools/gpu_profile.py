"""Kernel-time profile of one jaxpar train step on a device.

python -m jaxpar.tools.gpu_profile --config C [--steps 5 --warmup 3] [--json F] [k=v ...]

Where the device time of one jaxpar step goes: traces `--steps` steps of the real compiled step (one device,
after `--warmup`), sums the device's kernel time per step by kernel name and by kind (matmul, attention,
convert, reduce, elementwise/other), and reports the share of the step the device was busy. It is the profile
docs/gpu.md's cast/reduction work is guided by, written so that a device session gets it in
the same call as the throughput rows (jaxpar.tools.gpu_check, part "profile"). On a CPU the "kernels" are
XLA:CPU's thunks on its threads (the same path, for tests).
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

from jaxpar.core.config.schema import load_config
from jaxpar.core.errors import UserError, check_output_file, cli
from jaxpar.core.kernel_profile import publish, summarize
from jaxpar.mesh import setup_devices
from jaxpar.tools.bench import warm_step

HOST_IDLE = re.compile(r"Await|Wait|Barrier|ThunkExecutor")  # XLA:CPU's waiting and dispatch, not work


def kernel_events(trace: dict, platform: str) -> list[dict]:
    """The trace's kernel events: a GPU's stream threads, or on a CPU XLA:CPU's threads (its thunks)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    named = [e for e in events if e.get("ph") == "M"]
    procs = {e["pid"]: e["args"]["name"] for e in named if e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in named if e.get("name") == "thread_name"}
    done = [e for e in events if e.get("ph") == "X" and "dur" in e]
    device = [
        e
        for e in done
        if procs.get(e["pid"], "").startswith("/device:") and threads.get((e["pid"], e["tid"]), "").startswith("Stream")
    ]
    if device or platform != "cpu":
        if not device:  # a GPU trace without its device's events: the profiler's CUPTI part did not load
            raise UserError(f"the {platform} trace has no device kernel events (jax.profiler without CUPTI?)")
        return device
    return [
        e
        for e in done
        if threads.get((e["pid"], e["tid"]), "").startswith("tf_XLA") and not HOST_IDLE.search(e["name"])
    ]


def profile(cfg, steps: int, warmup: int) -> dict:
    import jax  # deferred: jax (~1 s), after the arguments are checked

    step, state, batch, _ = warm_step(cfg, {"dp": 1}, warmup, jax.devices()[:1])
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            t0 = time.perf_counter()
            for _ in range(steps):
                state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
            step_s = (time.perf_counter() - t0) / steps
        paths = glob.glob(os.path.join(tmp, "**", "*.trace.json.gz"), recursive=True)
        if not paths:
            raise UserError(f"jax.profiler wrote no perfetto trace under {tmp} (is the profiler plugin installed?)")
        with gzip.open(paths[0]) as f:
            trace = json.load(f)
    device = jax.devices()[0]
    kernels = [(e["name"], e["dur"]) for e in kernel_events(trace, device.platform)]
    return {**summarize(kernels, steps, step_s), "device": device.device_kind}


@cli
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m jaxpar.tools.gpu_profile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--config", required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", help="write the summary here too")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = ap.parse_args(argv)
    if args.json:
        check_output_file(args.json, "--json")  # before the trace, as bench_collectives does

    setup_devices({"dp": 1})
    result = profile(load_config(args.config, args.overrides), args.steps, args.warmup)
    publish(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
