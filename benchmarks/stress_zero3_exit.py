"""Stress the exit of 2-process DeepSpeed ZeRO-3 runs (issue 26): N tiny torchrun runs in a row. Not run in CI.

    nice -n 10 python benchmarks/stress_zero3_exit.py [--runs 50] [--steps 3] [--config configs/parity/float32.yaml]
        [--keep-going] [k=v ...]

Each run is the parity suite's `float32-torch:zero3` case made short: `torchrun --nproc_per_node=2` of
torchpar.train with `--backend deepspeed parallel.zero_stage=3` over gloo on the CPU (DS_ACCELERATOR=cpu), on
the suite's synthetic token file, with --write-final (gathering collectives just before the teardown).

A run fails when it exits non-zero or prints an abort ("terminate called ...", "Aborted", ...); the stderr
tail of each failing run is printed. The abort itself is a race (a gloo worker thread that waits for the GIL
as the interpreter starts finalizing; torchpar/dist.py), rare on an idle machine, so each rank also reports,
from an atexit handler (just before finalization), how many gloo threads are still alive: any at all means
a process group outlived the teardown, the precondition of the abort, and counts as a failure too.
Exit status 0 when every run passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.helpers import ABORTS, free_port, make_dataset, torch_env  # noqa: E402

ABORT_TEXT = (*ABORTS, "terminate called")
# runs torchpar.train as __main__; at exit, before finalization, reports the gloo threads still alive
WRAPPER = """import atexit, os, runpy, sys
def report():
    tasks = "/proc/self/task"
    names = [open(os.path.join(tasks, t, "comm")).read().strip() for t in os.listdir(tasks)]
    print(f"gloo threads at exit: {sum('gloo' in n for n in names)}", file=sys.stderr, flush=True)
atexit.register(report)
sys.argv[0] = "torchpar.train"
runpy.run_module("torchpar.train", run_name="__main__", alter_sys=True)
"""


def one_run(workdir: str, dataset: str, args, i: int) -> tuple[str, str, float]:
    """('' or why the run failed, its stderr, seconds)."""
    run_dir = os.path.join(workdir, f"run{i}")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        os.path.join(workdir, "wrapper.py"),
        "--backend",
        "deepspeed",
        "--config",
        os.path.join(ROOT, args.config),
        "parallel.zero_stage=3",
        f"data.dataset={dataset}",
        f"train.steps={args.steps}",
        "train.log_every=1",
        "train.eval_every=0",
        "checkpoint.every=0",
        f"run.dir={run_dir}",
        "--write-final",
        os.path.join(run_dir, "final.safetensors"),
        *args.overrides,
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(
        cmd, cwd=ROOT, env=torch_env(), capture_output=True, text=True, timeout=args.timeout, start_new_session=True
    )
    text = proc.stdout + proc.stderr
    left = [int(n) for n in re.findall(r"gloo threads at exit: (\d+)", proc.stderr)]
    why = (
        f"exit {proc.returncode}"
        if proc.returncode
        else "abort message"
        if any(a in text for a in ABORT_TEXT)
        else f"{len(left)} of 2 ranks reported"
        if len(left) != 2
        else f"gloo threads alive at exit: {left}"
        if any(left)
        else ""
    )
    return why, proc.stderr, time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--config", default="configs/parity/float32.yaml")
    p.add_argument("--timeout", type=int, default=300, help="seconds per run")
    p.add_argument("--keep-going", action="store_true", help="do not stop at the first failing run")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides for every run")
    args = p.parse_args()
    failed, done = [], 0
    with tempfile.TemporaryDirectory(prefix="stress_zero3_") as workdir:
        dataset = make_dataset(os.path.join(workdir, "tokens.bin"))
        with open(os.path.join(workdir, "wrapper.py"), "w") as f:
            f.write(WRAPPER)
        for i in range(1, args.runs + 1):
            why, err, seconds = one_run(workdir, dataset, args, i)
            done = i
            print(f"run {i}/{args.runs}: {why or 'ok'} ({seconds:.1f} s)", flush=True)
            if why:
                failed.append(i)
                print(f"--- run {i} stderr (tail) ---\n{err[-3000:]}\n---", flush=True)
                if not args.keep_going:
                    break
    print(f"{len(failed)} of {done} runs failed" + (f": {failed}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
