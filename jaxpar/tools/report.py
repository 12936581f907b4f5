"""python -m jaxpar.tools.report BENCH.json ... --out DIR

PNG plots from benchmark JSON files (`jaxpar.tools.bench --json`, `torchpar.tools.bench --json`):
throughput, MFU and peak memory per device for each run, and scaling (tokens/s against device
count) where runs of one framework differ in device count.
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


@cli
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxpar.tools.report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", default="docs/benchmarks/plots")
    args = ap.parse_args(argv)
    for path in plot(load(args.files), args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
