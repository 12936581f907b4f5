"""Self CPU time per op of torchpar's `none` engine step (eager or with the blocks torch.compile'd), torch.profiler.

    python benchmarks/cpu_gap/profile_torch.py [--compiled] [--d_model ... same flags as minimal_step.py] [--steps 10]

Compiled: inductor's generated C++ kernels are recorded too (torch._inductor.config.cpp.enable_kernel_profile).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import minimal_step as ms  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    for name, default in (
        ("d_model", 128),
        ("n_layer", 4),
        ("n_head", 4),
        ("seq_len", 64),
        ("batch", 16),
        ("vocab", 256),
    ):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--compiled", action="store_true")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--override", action="append", default=[])
    a = ap.parse_args()
    import torch
    import torch._inductor.config as ic

    ic.cpp.enable_kernel_profile = True
    run = ms.build_torch(a, a.compiled)
    for _ in range(3):
        run()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(a.steps):
            with torch.profiler.record_function("train_step"):
                run()
    avgs = prof.key_averages()
    step = next(e for e in avgs if e.key == "train_step").cpu_time_total / a.steps
    print(f"# torch {'compiled' if a.compiled else 'eager'}: {step / 1e3:.2f} ms/step (profiled)")
    rows = sorted((e for e in avgs if e.key != "train_step"), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in rows)
    print(f"{'op':<60} {'self ms/step':>12} {'share':>6} {'calls/step':>10}")
    for e in rows[: a.top]:
        print(
            f"{e.key[:60]:<60} {e.self_cpu_time_total / a.steps / 1e3:>12.3f} {e.self_cpu_time_total / total:>6.1%} "
            f"{e.count / a.steps:>10.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
