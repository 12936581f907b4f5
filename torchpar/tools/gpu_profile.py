"""Kernel-time profile of one torchpar train step on a device, beside jaxpar's.

python -m torchpar.tools.gpu_profile --config C [--compile] [--steps 5 --warmup 3] [--json F] [k=v ...]

torch.profiler over `--steps` steps of the real one-process step (`--backend none`; `--compile` as train.compile=on),
after `--warmup`: the device's kernel time per step by kernel name and by kind, and the share of the step the device
was busy, summarized as jaxpar.tools.gpu_profile's (jaxpar/core/kernel_profile.py), so gpu_check's report shows the
two steps side by side. On a CPU the "kernels" are torch's operators, by their own (self) CPU time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from jaxpar.core.config.schema import load_config
from jaxpar.core.errors import UserError, check_output_file, cli
from jaxpar.core.kernel_profile import publish, summarize
from torchpar.tools.bench import warm_engine

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")  # a chrome trace's events that ran on the GPU


def device_kernels(trace: dict) -> list[tuple[str, float]]:
    """(name, microseconds) of every event of torch.profiler's chrome trace that ran on the GPU."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    kernels = [(e["name"], float(e["dur"])) for e in events if e.get("cat") in DEVICE_CATEGORIES and "dur" in e]
    if not kernels:
        raise UserError("the CUDA trace has no kernel events (torch.profiler without CUPTI?)")
    return kernels


def profile(cfg, steps: int, warmup: int, compile_model: bool) -> dict:
    import torch  # deferred: torch (~1.5 s), after the arguments are checked

    from torchpar import dist  # deferred: imports torch, after the arguments are checked

    try:
        env, engine, compiled, rows, sync = warm_engine(cfg, "none", warmup, compile_model)
        cuda = env.device.type == "cuda"
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=activities) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.update(rows)
            sync()
            step_s = (time.perf_counter() - t0) / steps
    finally:
        dist.teardown()
    if cuda:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                kernels = device_kernels(json.load(f))
        device = torch.cuda.get_device_name(env.device)
    else:  # the operators' own CPU time: nothing counted twice where one calls another
        kernels = [(e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages() if e.self_cpu_time_total > 0]
        device = "cpu"
    return {**summarize(kernels, steps, step_s), "device": device, "compiled": compiled}


@cli
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m torchpar.tools.gpu_profile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--config", required=True)
    ap.add_argument("--compile", action="store_true", help="torch.compile the blocks (as train.compile=on)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", help="write the summary here too")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        raise UserError("--steps must be >= 1 and --warmup >= 0")
    if args.json:
        check_output_file(args.json, "--json")  # before the trace, as jaxpar's profile does
    result = profile(load_config(args.config, args.overrides), args.steps, args.warmup, args.compile)
    publish(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
