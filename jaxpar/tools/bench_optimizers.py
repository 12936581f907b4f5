"""Optimizer quality on one model and corpus: learning-rate sweeps trained in turn and compared.

python -m jaxpar.tools.bench_optimizers --config configs/gpt2-tiny.yaml --sweep adamw=1e-3,3e-3,1e-2
    --sweep muon=1e-3,3e-3,1e-2 [--out runs/bench-optimizers] [--reuse] [--table PATH] [section.key=value ...]

Each (optim.name, optim.lr) of the sweeps is trained in turn by `python -m jaxpar.train` (one device, `--mesh dp=1`, the
overrides given, optim.min_lr kept at the config's ratio to optim.lr, a checkpoint at the end only) into
OUT/<name>-lr<lr>; then its metrics.jsonl is read back. Reported: every run's evaluation losses; for the best run of
each sweep (lowest evaluation loss at the last step) the evaluation loss at equal steps and at equal training time.
Training time is what metrics.jsonl's meter counts (step_time_s over each logged interval: the steps, not evaluations or
saves), summed; the equal-time budget is the shortest best run's total. The runs are sequential and timed under whatever
else the machine runs: compare times within one invocation only. `--reuse` reads a run that already reached train.steps
in OUT instead of training it again. The markdown tables are printed and written to --table (default OUT/table.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys

from jaxpar.core.config.schema import load_config
from jaxpar.core.errors import UserError, cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_sweep(text: str) -> tuple[str, list[float]]:
    """'muon=1e-3,3e-3' -> ('muon', [0.001, 0.003])."""
    name, _, lrs = text.partition("=")
    try:
        values = [float(v) for v in lrs.split(",") if v]
    except ValueError:
        values = []
    if not name or not values:
        raise UserError(f"--sweep {text!r}: expected NAME=LR[,LR...], e.g. muon=1e-3,3e-3")
    return name, values


def read_metrics(run_dir: str) -> list[dict]:
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def train_run(args, name: str, lr: float, ratio: float, run_dir: str) -> None:
    """One sweep point through the trainer's own entry point; its output goes to run_dir/train.log."""
    cmd = [
        sys.executable,
        "-m",
        "jaxpar.train",
        *(["--config", args.config] if args.config else []),
        "--mesh",
        "dp=1",
        *args.overrides,
        f"optim.name={name}",
        f"optim.lr={lr:g}",
        f"optim.min_lr={lr * ratio:g}",
        "checkpoint.every=0",
        "checkpoint.resume=false",
        f"run.dir={run_dir}",
    ]
    os.makedirs(run_dir, exist_ok=True)
    print(f"training {name} lr {lr:g} -> {run_dir}", flush=True)
    with open(os.path.join(run_dir, "train.log"), "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        with open(os.path.join(run_dir, "train.log")) as f:
            raise UserError(f"{shlex.join(cmd)} exited {rc}; its log ends:\n{f.read()[-2000:]}")


def summarize(records: list[dict]) -> dict:
    """Evaluations as {step: (eval loss, training seconds up to that step)}, the total and median step time."""
    evals, elapsed, last, steps = {}, 0.0, 0, []
    for r in records:
        if r.get("step_time_s") is None:
            continue
        elapsed += r["step_time_s"] * (r["step"] - last)
        steps.append(r["step_time_s"])
        last = r["step"]
        if r.get("eval_loss") is not None:
            evals[r["step"]] = (r["eval_loss"], elapsed)
    return {
        "evals": evals,
        "seconds": elapsed,
        "last_step": last,
        "median_step_s": statistics.median(steps[1:] or steps) if steps else None,
    }


def marks(steps: list[int], total: int) -> list[int]:
    """The evaluated steps nearest a third, two thirds and all of the run."""
    return sorted({min(steps, key=lambda s: abs(s - total * k / 3)) for k in (1, 2, 3)})


def sweep_table(runs: list[dict], total: int) -> str:
    cols = marks(sorted(runs[0]["evals"]), total)
    head = (
        "| optimizer | lr | "
        + " | ".join(f"eval loss @{s}" for s in cols)
        + " | lowest (step) | training s | s/step (median) |\n|---|---|"
        + "---|" * (len(cols) + 3)
        + "\n"
    )
    lines = []
    for r in runs:
        low = min(r["evals"], key=lambda s: r["evals"][s][0])
        cells = " | ".join(f"{r['evals'][s][0]:.4f}" if s in r["evals"] else "-" for s in cols)
        lines.append(
            f"| {r['name']} | {r['lr']:g} | {cells} | {r['evals'][low][0]:.4f} ({low}) | "
            f"{r['seconds']:.0f} | {r['median_step_s']:.3f} |"
        )
    return head + "\n".join(lines) + "\n"


def best_runs(runs: list[dict], total: int) -> list[dict]:
    """Per optimizer, in sweep order, the run with the lowest evaluation loss at the last step."""
    best = {}
    for r in runs:
        if total in r["evals"] and (r["name"] not in best or r["evals"][total][0] < best[r["name"]]["evals"][total][0]):
            best[r["name"]] = r
    return list(best.values())


def curve_table(best: list[dict]) -> str:
    head = (
        "| step | "
        + " | ".join(f"{r['name']} lr {r['lr']:g}: eval loss (training s)" for r in best)
        + " |\n|---|"
        + "---|" * len(best)
        + "\n"
    )
    rows = [
        f"| {s} | "
        + " | ".join(f"{r['evals'][s][0]:.4f} ({r['evals'][s][1]:.0f})" if s in r["evals"] else "-" for r in best)
        + " |"
        for s in sorted(best[0]["evals"])
    ]
    return head + "\n".join(rows) + "\n"


def relative(x: float | None, base: float | None) -> str:
    return "" if x is None or base is None else f"{(x - base) / base:+.2%}"


def equal_time_table(best: list[dict], total: int) -> str:
    """The last step's evaluation, and each run's last evaluation within the shortest best run's training time."""
    budget = min(r["seconds"] for r in best)
    rows = []
    for r in best:
        within = [s for s, (_, t) in r["evals"].items() if t <= budget * (1 + 1e-9)]
        at = max(within, default=None)
        rows.append((r, r["evals"][total][0], at, r["evals"][at][0] if at else None))
    _, base_final, _, base_budget = rows[0]
    lines = [
        f"| {r['name']} | {r['lr']:g} | {final:.4f} | {relative(final, base_final) if i else ''} | "
        f"{r['seconds']:.0f} | "
        + (
            f"{loss:.4f} (step {at}) | {relative(loss, base_budget) if i else ''} |"
            if at
            else "no evaluation within the budget | |"
        )
        for i, (r, final, at, loss) in enumerate(rows)
    ]
    name = best[0]["name"]
    return (
        f"| optimizer | lr | eval loss @{total} | vs {name} | training s | eval loss within {budget:.0f} s of "
        f"training | vs {name} |\n|---|---|---|---|---|---|---|\n" + "\n".join(lines) + "\n"
    )


def environment() -> str:
    import jax  # deferred: jax (~1 s), for the device's name: the runs train in subprocesses

    device = jax.devices()[0]
    return (
        f"{datetime.date.today().isoformat()}, {device.platform}:{device.device_kind}, {os.cpu_count()} CPU cores, "
        f"jax {jax.__version__}, python {platform.python_version()}"
    )


@cli
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m jaxpar.tools.bench_optimizers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--config")
    ap.add_argument("--sweep", action="append", required=True, help="NAME=LR[,LR...]: optim.name and its lrs")
    ap.add_argument("--out", default="runs/bench-optimizers", help="the runs' parent directory")
    ap.add_argument("--reuse", action="store_true", help="read runs in OUT that reached train.steps, train the rest")
    ap.add_argument("--table", help="where to write the tables (default OUT/table.md)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args(argv)
    sweeps = [parse_sweep(s) for s in args.sweep]
    cfg = load_config(args.config, args.overrides)
    for name, _ in sweeps:  # the schema refuses an unknown optimizer before anything trains
        load_config(args.config, [*args.overrides, f"optim.name={name}"])
    total, ratio = cfg.train.steps, cfg.optim.min_lr / cfg.optim.lr if cfg.optim.lr else 0.0
    runs = []
    for name, lrs in sweeps:
        for lr in lrs:
            run_dir = os.path.join(args.out, f"{name}-lr{lr:g}")
            if not (args.reuse and summarize(read_metrics(run_dir))["last_step"] == total):
                train_run(args, name, lr, ratio, run_dir)
            summary = summarize(read_metrics(run_dir))
            if total not in summary["evals"]:
                raise UserError(f"{run_dir}: no evaluation at step {total} in its metrics.jsonl")
            runs.append({"name": name, "lr": lr, **summary})
    best = best_runs(runs, total)
    command = shlex.join(sys.argv[1:] if argv is None else argv)
    text = (
        f"{environment()}; `python -m jaxpar.tools.bench_optimizers {command}`"
        f"\n\nEvery run:\n\n{sweep_table(runs, total)}\nThe best of each sweep, at equal steps:\n\n"
        f"{curve_table(best)}\nAt the last step and at equal training time:\n\n{equal_time_table(best, total)}"
    )
    print(text)
    path = args.table or os.path.join(args.out, "table.md")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
