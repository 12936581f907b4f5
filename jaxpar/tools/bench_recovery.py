"""Recovery benchmark: a scripted schedule of node failures, and what each recovery costs.

python -m jaxpar.tools.bench_recovery --trainer jaxpar|ddp|fsdp|deepspeed --kills 5 [--seed 0] [--record]

Recovery under a scripted schedule of failures, on one machine: two torchrun agents ("nodes") of two processes each
train the tiny model (the embedded corpus, CPU; steps slowed by the trainers' SLOW_STEP_S test fault so a failure
lands mid-run); `--kills` times, at a step drawn from `--seed`, the second node is SIGKILLed with its workers, the
survivors' agent restarts them on the smaller group, and once they train the node is started again and the group
grows back. Then every logged step (the replayed ones too) is compared with an uninterrupted one-process run.
Reported: runs lost (an agent that did not exit 0), steps differing by more than 1e-5 (relative), and each
recovery's seconds and replayed steps from run.dir/recoveries.jsonl (jaxpar/core/run/recovery.py). `--record` appends
the row to docs/benchmarks/recovery.md. The first node hosts the c10d rendezvous, which cannot be lost
(docs/cluster.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version

from jaxpar.core.bench_records import append_row
from jaxpar.core.errors import UserError, cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = [
    "model.n_layer=2",
    "model.n_head=4",
    "model.d_model=32",
    "model.max_seq_len=32",
    "data.seq_len=16",
    "train.global_batch_size=8",
    "optim.warmup_steps=3",  # gpt2-tiny's lr 3e-3: at 1e-2 the loss spikes
    # near step 18 and amplifies float32 rounding: two uninterrupted meshes then differ by 3% by step 72
    "train.log_every=1",
    "train.eval_every=0",
    "train.matmul_precision=highest",
    "run.peer_timeout_s=60",
]
TRAINERS = {  # module, the trainer's arguments, the uninterrupted run's arguments (one process), the fault prefix
    "jaxpar": ("jaxpar.train", ["--mesh", "dp=-1,tp=2"], ["--mesh", "dp=2,tp=2"], "JAXPAR"),
    "ddp": ("torchpar.train", ["--backend", "ddp"], ["--backend", "none"], "TORCHPAR"),
    "fsdp": ("torchpar.train", ["--backend", "fsdp"], ["--backend", "none"], "TORCHPAR"),
    "deepspeed": (
        "torchpar.train",
        ["--backend", "deepspeed", "parallel.zero_stage=2"],
        ["--backend", "none"],
        "TORCHPAR",
    ),
}
HEADER = (
    "| date | trainer | kills | runs lost | differing steps | recovered in s (median, max) | steps replayed "
    "(each) | grown back in s (median) | steps, checkpoint every | machine, versions | command |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|\n"
)


def environment(prefix: str, slow_s: float) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JAXPAR_", "TORCHELASTIC_"))}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return {
        **env,
        "JAX_PLATFORMS": "cpu",
        "OMP_NUM_THREADS": "1",
        "DS_ACCELERATOR": "cpu",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",  # a node can join again (docs/cluster.md)
        f"{prefix}_FAULT_SLOW_STEP_S": str(slow_s),
        "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }


class Node:
    """One torchrun agent with `workers` processes of `module args`; its output appended to `log`."""

    def __init__(
        self,
        module: str,
        args: list[str],
        env: dict,
        port: int,
        rdzv_id: str,
        host: bool,
        log: str,
        workers: int = 2,
        restarts: int = 3,
        join_s: int = 240,
    ):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=1:2",
            f"--nproc-per-node={workers}",
            f"--max-restarts={restarts}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id={rdzv_id}",
            f"--rdzv-conf=is_host={str(host).lower()},join_timeout={join_s},last_call_timeout=3",
            "-m",
            module,
            *args,
        ]
        with open(log, "a") as out:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def kill(self) -> None:
        """The node lost: its agent and its workers (torchrun starts each in a session of its own), SIGKILL."""
        workers = children(self.proc.pid)
        os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


def children(pid: int) -> list[int]:
    def parent(p: str) -> int | None:
        try:
            with open(f"/proc/{p}/stat") as f:
                return int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            return None

    return [int(p) for p in os.listdir("/proc") if p.isdigit() and parent(p) == pid]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_jsonl(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def wait_for(what: str, ready, timeout_s: float, log: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            with open(log) as f:
                raise UserError(f"waited {timeout_s:g} s for {what}; the nodes' log ends:\n{f.read()[-3000:]}")
        time.sleep(0.3)


def failure_schedule(kills: int, steps: int, every: int, seed: int) -> list[int]:
    """The steps after which the second node is lost: one per window of steps, each past a checkpoint."""
    rng, window = random.Random(seed), steps // (kills + 1)
    return [k * window + rng.randint(every + 1, max(every + 1, window - 2)) for k in range(kills)]


def run_schedule(trainer: str, kills: int, seed: int, steps: int, every: int, slow_s: float, workdir: str) -> dict:
    """The elastic run under the failure schedule, then the uninterrupted reference; the row's numbers."""
    module, args, reference_args, prefix = TRAINERS[trainer]
    common = ["--config", "configs/gpt2-tiny.yaml", *MODEL, f"train.steps={steps}", f"checkpoint.every={every}"]
    run_dir, log = os.path.join(workdir, "run"), os.path.join(workdir, "nodes.log")
    env, port = environment(prefix, slow_s), free_port()
    nodes = [
        Node(
            module, [*args, *common, f"run.dir={run_dir}"], env, port, f"bench-{seed}", i == 0, log, restarts=kills + 1
        )
        for i in range(2)
    ]  # the first hosts the rendezvous: never lost
    progress = lambda: json.load(open(os.path.join(run_dir, "progress.json")))
    recoveries = lambda: read_jsonl(os.path.join(run_dir, "recoveries.jsonl"))
    try:
        for at in failure_schedule(kills, steps, every, seed):
            wait_for(
                f"4 processes past step {at}",
                lambda: (
                    os.path.exists(os.path.join(run_dir, "progress.json"))
                    and progress()["processes"] == 4
                    and progress()["step"] > at
                ),
                600,
                log,
            )
            seen = len(recoveries())
            nodes[1].kill()
            wait_for(
                "the survivors to train", lambda: any(r["processes"][1] == 2 for r in recoveries()[seen:]), 600, log
            )
            nodes[1] = Node(module, [*args, *common, f"run.dir={run_dir}"], env, port, f"bench-{seed}", False, log)
            wait_for(
                "the group to grow back", lambda: any(r["processes"] == [2, 4] for r in recoveries()[seen:]), 600, log
            )
        codes = [node.proc.wait(timeout=900) for node in nodes]
    finally:
        for node in nodes:
            if node.proc.poll() is None:
                node.kill()
    reference = os.path.join(workdir, "reference")
    subprocess.run(
        [sys.executable, "-m", module, *reference_args, *common, f"run.dir={reference}"],
        cwd=ROOT,
        env=environment(prefix, 0.0),
        capture_output=True,
        check=True,
    )
    want = {r["step"]: r["loss"] for r in read_jsonl(os.path.join(reference, "metrics.jsonl")) if "loss" in r}
    got = [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if "loss" in r]
    return {
        "codes": codes,
        "recoveries": recoveries(),
        "logged": len(got),
        "steps_covered": len({r["step"] for r in got}),
        "differing": sum(abs(r["loss"] - want[r["step"]]) > 1e-5 * abs(want[r["step"]]) for r in got),
        "expected_steps": len(want),
    }


def row(trainer: str, kills: int, steps: int, every: int, result: dict, argv: list[str]) -> str:
    shrink = [r for r in result["recoveries"] if r["processes"][1] == 2]
    grow = [r["recovered_s"] for r in result["recoveries"] if r["processes"] == [2, 4]]
    median = lambda xs: statistics.median(xs) if xs else float("nan")
    lost = sum(c != 0 for c in result["codes"]) + (result["steps_covered"] != result["expected_steps"])
    return (
        f"| {datetime.date.today()} | {trainer} | {kills} | {lost} | {result['differing']} of {result['logged']} | "
        f"{median([r['recovered_s'] for r in shrink]):.1f}, "
        f"{max((r['recovered_s'] for r in shrink), default=0):.1f}"
        f" | {', '.join(str(r['replayed_steps']) for r in shrink)} | {median(grow):.1f} | {steps}, {every} | "
        f"{versions()} | `python -m jaxpar.tools.bench_recovery {' '.join(argv)}` |"
    )


def versions() -> str:
    return (
        f"cpu x{os.cpu_count()}, python {platform.python_version()}, jax {version('jax')}, torch {version('torch')}"
        f", deepspeed {version('deepspeed')}"
    )


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m jaxpar.tools.bench_recovery",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--trainer", choices=tuple(TRAINERS), default="jaxpar")
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=0, help="default: 12 per kill + 12")
    p.add_argument("--every", type=int, default=4, help="checkpoint.every")
    p.add_argument("--slow-s", type=float, default=0.5, help="seconds added to each step (the test fault)")
    p.add_argument("--workdir", help="keep the runs and the nodes' log here (default: a temporary directory)")
    p.add_argument("--record", action="store_true", help="append the row to docs/benchmarks/recovery.md")
    return p.parse_args(argv)


@cli
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    steps = args.steps or 12 * (args.kills + 1)
    if args.kills < 1 or steps // (args.kills + 1) < args.every + 3:
        raise UserError(f"--steps {steps} leave fewer than --every + 3 steps between {args.kills} kills")
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or tmp
        os.makedirs(workdir, exist_ok=True)
        result = run_schedule(args.trainer, args.kills, args.seed, steps, args.every, args.slow_s, workdir)
    line = row(args.trainer, args.kills, steps, args.every, result, argv)
    print(HEADER + line)
    if args.record:
        append_row("recovery.md", HEADER, line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
