"""python -m jaxpar.tools.report BENCH.json ... --out DIR [--scaling] [--run RUN_DIR ...]

PNG plots from benchmark JSON files (`jaxpar.tools.bench --json`, `torchpar.tools.bench --json`):
throughput, MFU and peak memory per device for each run, and scaling (tokens/s against device
count) where runs of one framework differ in device count.

--run RUN_DIR (either trainer's run.dir) plots its metrics.jsonl's view of the slow process and of communication
(docs/observability.md): <out>/stragglers.png, straggler_ratio by step with the slowest rank marked, and
<out>/comm_share.png, the sampled step's share of time in collectives per mesh axis.

--scaling also writes <out>/scaling.md: per run its speedup over the same framework's run on the fewest
devices and the scaling efficiency (speedup / device ratio), memory per device and the pipeline bubble
(e.g. from one sweep: `python -m jaxpar.tools.bench --mesh dp=1 --mesh dp=8 --mesh pp=8 --json rows.json`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from jaxpar.core.errors import UserError, cli


def load(paths: list[str]) -> list[dict]:
    runs = []
    for path in paths:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise UserError(f"cannot read benchmark file {path}: {e}") from None
        for r in data if isinstance(data, list) else [data]:
            if "tokens_per_sec" not in r:
                raise UserError(f"{path} is not a benchmark result (no tokens_per_sec)")
            runs.append(r)
    if not runs:
        raise UserError("no benchmark results given")
    return runs


def label(r: dict) -> str:
    where = r.get("mesh") or r.get("backend", "")
    return f"{r.get('framework', '?')} {where} {r.get('compute_dtype', '')}".strip()


def plot(runs: list[dict], out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    names = [label(r) for r in runs]
    written = []
    panels = [("throughput.png", "tokens/s", [r["tokens_per_sec"] for r in runs]),
              ("mfu.png", "MFU vs matmul ceiling", [r.get("mfu_ceiling") or 0 for r in runs]),
              ("memory.png", "peak GiB per device", [r.get("memory_gib") or 0 for r in runs])]
    for filename, ylabel, values in panels:
        fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(runs)), 3.5))
        ax.bar(range(len(runs)), values)
        ax.set_xticks(range(len(runs)), names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{ylabel} ({runs[0].get('device_kind', '?')})", fontsize=9)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, filename), dpi=100)
        plt.close(fig)
        written.append(os.path.join(out_dir, filename))
    by_framework: dict[str, list[dict]] = {}
    for r in runs:
        by_framework.setdefault(r.get("framework", "?"), []).append(r)
    if any(len({r["devices"] for r in rs}) > 1 for rs in by_framework.values()):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for fw, rs in by_framework.items():
            rs = sorted(rs, key=lambda r: r["devices"])
            ax.plot([r["devices"] for r in rs], [r["tokens_per_sec"] for r in rs], "o-", label=fw)
        ax.set_xlabel("devices")
        ax.set_ylabel("tokens/s")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "scaling.png"), dpi=100)
        plt.close(fig)
        written.append(os.path.join(out_dir, "scaling.png"))
    return written


def run_records(run_dir: str) -> list[dict]:
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read {run_dir}/metrics.jsonl: {e}") from None


def plot_run(runs: dict[str, list[dict]], out_dir: str) -> list[str]:
    """straggler_ratio by step (each point labelled with its slowest rank) and comm_share per axis, per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    fig, (ratio, comm) = plt.subplots(1, 2, figsize=(10, 3.5))
    for name, records in runs.items():
        slow = [r for r in records if r.get("straggler_ratio") is not None]
        ratio.plot([r["step"] for r in slow], [r["straggler_ratio"] for r in slow], "o-", label=name)
        for r in slow:
            ratio.annotate(str(r["slowest_rank"]), (r["step"], r["straggler_ratio"]), fontsize=7)
        shares = next((r for r in records if "comm_share" in r), {})
        axes = sorted(k[len("comm_share_"):] for k in shares if k.startswith("comm_share_"))
        comm.bar([f"{name}\n{a}" for a in axes], [shares[f"comm_share_{a}"] for a in axes])
    ratio.set_xlabel("step")
    ratio.set_ylabel("slowest pace / median (rank marked)")
    comm.set_ylabel("share of step time in collectives")
    ratio.legend(fontsize=7)
    written = []
    for ax, filename in ((ratio, "stragglers.png"), (comm, "comm_share.png")):
        extent = ax.get_tightbbox(fig.canvas.get_renderer()).transformed(fig.dpi_scale_trans.inverted())
        fig.savefig(os.path.join(out_dir, filename), dpi=100, bbox_inches=extent.expanded(1.05, 1.1))
        written.append(os.path.join(out_dir, filename))
    plt.close(fig)
    return written


def scaling_rows(runs: list[dict]) -> list[dict]:
    """Speedup and efficiency of each run against its framework's run on the fewest devices."""
    out = []
    for r in sorted(runs, key=lambda r: (r.get("framework", "?"), r["devices"], label(r))):
        base = min((b for b in runs if b.get("framework") == r.get("framework")), key=lambda b: b["devices"])
        speedup = r["tokens_per_sec"] / base["tokens_per_sec"]
        out.append({**r, "speedup": speedup, "efficiency": speedup / (r["devices"] / base["devices"]),
                    "baseline": label(base)})
    return out


def scaling_markdown(rows: list[dict]) -> str:
    fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    lines = ["| run | devices | tokens/s | speedup | efficiency | peak GiB / device | bubble | baseline |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {label(r)} | {r['devices']} | {r['tokens_per_sec']:,.0f} | {r['speedup']:.2f}x | "
              f"{r['efficiency']:.0%} | {fmt(r.get('memory_gib'), '.2f')} | {fmt(r.get('pipeline_bubble'), '.3f')} | "
              f"{r['baseline']} |" for r in rows]
    return "\n".join(lines) + "\n"


def plot_efficiency(rows: list[dict], out_dir: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(rows)), 3.5))
    ax.bar(range(len(rows)), [r["efficiency"] for r in rows])
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(range(len(rows)), [f"{label(r)} ({r['devices']})" for r in rows], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("scaling efficiency")
    fig.tight_layout()
    path = os.path.join(out_dir, "efficiency.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


@cli
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxpar.tools.report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*")
    ap.add_argument("--out", default="docs/benchmarks/plots")
    ap.add_argument("--scaling", action="store_true", help="also the speedup / efficiency table and plot")
    ap.add_argument("--run", action="append", default=[], help="a run.dir: plot its slow process and comm_share")
    args = ap.parse_args(argv)
    if not args.files and not args.run:
        raise UserError("give benchmark files, --run RUN_DIR, or both")
    written = plot_run({os.path.basename(os.path.abspath(d)): run_records(d) for d in args.run}, args.out) if (
        args.run) else []
    runs = load(args.files) if args.files else []
    written += plot(runs, args.out) if runs else []
    if args.scaling and runs:
        rows = scaling_rows(runs)
        table = scaling_markdown(rows)
        with open(os.path.join(args.out, "scaling.md"), "w") as f:
            f.write(f"Scaling on {runs[0].get('device_kind', '?')} ({runs[0].get('date', '')})\n\n{table}")
        print(table, end="")
        written += [os.path.join(args.out, "scaling.md"), plot_efficiency(rows, args.out)]
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
