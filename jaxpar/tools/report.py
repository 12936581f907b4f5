"""Plots of training runs (loss, eval loss, learning rate, gradient norm, tokens/s by step) and of benchmark results.

    python -m jaxpar.tools.report RUN [RUN ...] [--out PATH]
    python -m jaxpar.tools.report BENCH.json [BENCH.json ...] [--out DIR] [--scaling]
    python -m jaxpar.tools.report --run RUN [--run RUN ...] [--out DIR]

A positional argument that is a directory is a run directory of either trainer (its run.dir, holding metrics.jsonl
and config.json); one that is a file is a benchmark result (`jaxpar.tools.bench --json`, `torchpar.tools.bench
--json`). Both kinds may be given together.

Runs: one PNG, curves.png, with a panel per curve -- loss, eval loss, learning rate, gradient norm, tokens/s, and
each benchmark score the run has (train.eval_tasks, python -m jaxpar.eval: evals/<step>.json) -- against step, each
run a line labelled with its directory's name and framework. A panel no run has data for (eval loss when no run
evaluated) is left out. It is written beside the runs: <RUN>/curves.png for one run, curves.png in the runs' common
parent folder for several (runs/curves.png for runs/jaxpar/a and runs/torchpar/a).

Benchmark files: throughput, MFU and peak memory per device for each result, and scaling (tokens/s against device
count) where results of one framework differ in device count; written beside the first file by default.
--scaling also writes scaling.md: per result its speedup over the same framework's result on the fewest devices and
the scaling efficiency (speedup / device ratio), memory per device and the pipeline bubble (e.g. from one sweep:
`python -m jaxpar.tools.bench --mesh dp=1 --mesh dp=8 --mesh pp=8 --json rows.json`), and efficiency.png.

--run RUN plots its metrics.jsonl's view of the slow process and of communication (docs/observability.md), each
only where a run has that data (a one-process run has no straggler_ratio; a one-device run no per-axis share):
stragglers.png, straggler_ratio by step with the slowest rank marked, and comm_share.png, the sampled step's share
of time in collectives per mesh axis. Written beside the run(s), as curves.png.

--out PATH: the folder for every plot, or a .png file for the curves (the other plots then go to its folder). The
default never lies in this checkout's source folders.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from jaxpar.core.errors import UserError, check_output_dir, check_output_file, cli
from jaxpar.core.evaluation.results import read_evals
from jaxpar.core.run.directory import framework_of


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
    import matplotlib  # deferred: matplotlib, optional (the report extra): plots only

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: matplotlib, optional (report extra), after use("Agg")

    os.makedirs(out_dir, exist_ok=True)
    names = [label(r) for r in runs]
    written = []
    panels = [
        ("throughput.png", "tokens/s", [r["tokens_per_sec"] for r in runs]),
        ("mfu.png", "MFU vs matmul ceiling", [r.get("mfu_ceiling") or 0 for r in runs]),
        ("memory.png", "peak GiB per device", [r.get("memory_gib") or 0 for r in runs]),
    ]
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


# the curves drawn from a run's metrics.jsonl, in panel order: (record key, axis label)
CURVES = (
    ("loss", "loss"),
    ("eval_loss", "eval loss"),
    ("lr", "learning rate"),
    ("grad_norm", "gradient norm"),
    ("tokens_per_sec", "tokens/s"),
)
# folders of this checkout that hold its code and documents: no default output goes there
SOURCE_FOLDERS = ("jaxpar", "torchpar", "parity_tests", "tests", "docs", "configs", "benchmarks", "tools")


def run_records(run_dir: str) -> list[dict]:
    """A run directory's metrics.jsonl records; one line on a missing directory or file, or on no records."""
    if not os.path.isdir(run_dir):
        raise UserError(f"{run_dir}: no such run directory")
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise UserError(f"{run_dir} is not a run directory: it has no metrics.jsonl")
    try:
        with open(path) as f:
            records = [json.loads(line) for line in f if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read {path}: {e}") from None
    if not records:
        raise UserError(f"{path} is empty: the run has logged no step yet")
    return records


def run_labels(run_dirs: list[str]) -> list[str]:
    """Each run's legend label, '<dir name> (<framework>)'.

    The path below the runs' common folder where two labels would be alike, and a count where two paths are.
    """
    paths = [os.path.abspath(d) for d in run_dirs]
    frameworks = [framework_of(d) for d in run_dirs]  # None where nothing tells

    def named(names: list[str]) -> list[str]:
        return [f"{name} ({fw})" if fw else name for name, fw in zip(names, frameworks)]

    labels = named([os.path.basename(p) for p in paths])
    if len(set(labels)) < len(labels):
        common = os.path.commonpath([os.path.dirname(p) for p in paths])
        labels = named([os.path.relpath(p, common) for p in paths])
    return [
        label_ if label_ not in labels[:i] else f"{label_} #{labels[:i].count(label_) + 1}"
        for i, label_ in enumerate(labels)
    ]


def source_root() -> str | None:
    """This checkout's root (where pyproject.toml lies beside the jaxpar package), None for an installed package."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return root if os.path.isfile(os.path.join(root, "pyproject.toml")) else None


def beside(paths: list[str]) -> str:
    """The default output folder: the one run (or file's folder) given, or the common parent folder of several.

    Refused where that is this checkout's root or one of its source folders (--out must say where).
    """
    paths = [os.path.abspath(p) for p in paths]
    folder = paths[0] if len(paths) == 1 else os.path.commonpath([os.path.dirname(p) for p in paths])
    root = source_root()
    if root is not None and (
        folder == root
        or any(os.path.commonpath([folder, os.path.join(root, s)]) == os.path.join(root, s) for s in SOURCE_FOLDERS)
    ):
        raise UserError(f"the default output folder {folder} is in the source tree; choose one with --out")
    return folder


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric in step order.

    A step logged twice (a resumed run replaying it) keeps its last value, and a null (a value that was not finite)
    is left out.
    """
    by_step = {r["step"]: r[key] for r in records if "step" in r and r.get(key) is not None}
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def curve_keys(runs: dict[str, list[dict]]) -> list[tuple[str, str]]:
    """CURVES, then a panel per benchmark score some run has (eval/<task>/<metric>: train.eval_tasks, jaxpar.eval)."""
    scores = sorted({k for records in runs.values() for r in records for k in r if k.startswith("eval/")})
    return list(CURVES) + [(k, k[len("eval/") :].replace("/", " ")) for k in scores]


def curve_data(runs: dict[str, list[dict]]) -> dict[str, dict[str, tuple[list[int], list[float]]]]:
    """{curve key: {run label: (steps, values)}} for every curve of curve_keys some run has values of (panel order)."""
    data: dict[str, dict[str, tuple[list[int], list[float]]]] = {}
    for key, _ in curve_keys(runs):
        for name, records in runs.items():
            steps, values = series(records, key)
            if steps:
                data.setdefault(key, {})[name] = (steps, values)
    return data


def curve_figure(data: dict[str, dict[str, tuple[list[int], list[float]]]], labels: list[str]):
    """One figure with a panel per curve in `data` and a line per run.

    Each panel's Axes are labelled with the curve's key, each line with its run; each run keeps one colour in every
    panel, named once in the figure's legend.
    """
    from matplotlib.figure import Figure  # deferred: matplotlib, optional (the report extra): plots only

    titles = dict(CURVES) | {k: k[len("eval/") :].replace("/", " ") for k in data if k.startswith("eval/")}
    cols = 1 if len(data) == 1 else 2
    rows = -(-len(data) // cols)
    fig = Figure(figsize=(6 * cols, 2.8 * rows + 0.22 * -(-len(labels) // 3)))
    colours = {name: f"C{i % 10}" for i, name in enumerate(labels)}
    handles = {}
    for i, (key, lines) in enumerate(data.items()):
        ax = fig.add_subplot(rows, cols, i + 1, label=key)
        for name, (steps, values) in lines.items():
            style = "o-" if key.startswith("eval") else "-"
            (handles[name],) = ax.plot(steps, values, style, color=colours[name], label=name, markersize=3)
        ax.set_title(titles[key], fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if key == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    fig.legend(
        [handles[n] for n in labels if n in handles],
        [n for n in labels if n in handles],
        loc="upper center",
        ncols=min(len(handles), 3),
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout(rect=(0, 0, 1, 1 - (0.1 + 0.22 * -(-len(handles) // 3)) / fig.get_figheight()))
    return fig


def curves_path(run_dirs: list[str], out: str | None) -> str:
    """Where curves.png goes: --out when it names a .png file, else curves.png in --out's folder or beside the runs."""
    if out is not None and out.endswith(".png") and not os.path.isdir(out):
        return out
    return os.path.join(beside(run_dirs) if out is None else out, "curves.png")


def curves(run_dirs: list[str], out: str | None = None) -> tuple[str, dict]:
    """Draw the runs' curves into one PNG (path: `curves_path`).

    Returns the path written and the plotted data, {curve key: {run label: (steps, values)}}.
    """
    path = curves_path(run_dirs, out)
    check_output_file(path, "--out")
    labels = run_labels(run_dirs)
    runs = {name: run_records(d) + [{"step": s, **v} for s, v in read_evals(d)] for name, d in zip(labels, run_dirs)}
    data = curve_data(runs)
    for name, run_dir in zip(labels, run_dirs):
        if not any(name in lines for lines in data.values()):
            raise UserError(f"{run_dir}/metrics.jsonl has no {', '.join(k for k, _ in CURVES)} to plot")
    fig = curve_figure(data, labels)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    return path, data


def plot_run(runs: dict[str, list[dict]], out_dir: str) -> list[str]:
    """Writes the straggler and communication-share plots of the runs that have them; returns the files written.

    stragglers.png (straggler_ratio by step, each point labelled with its slowest rank) where a run has straggler_ratio,
    and comm_share.png (the share per mesh axis, per run) where a run has a per-axis share.
    """
    from matplotlib.figure import Figure  # deferred: matplotlib, optional (the report extra): plots only

    slow = {name: [r for r in records if r.get("straggler_ratio") is not None] for name, records in runs.items()}
    shares = {
        name: next((r for r in records if any(k.startswith("comm_share_") for k in r)), None)
        for name, records in runs.items()
    }
    written = []
    if any(slow.values()):
        fig = Figure(figsize=(5, 3.5))
        ax = fig.add_subplot()
        for name, records in slow.items():
            if records:
                ax.plot([r["step"] for r in records], [r["straggler_ratio"] for r in records], "o-", label=name)
            for r in records:
                ax.annotate(str(r.get("slowest_rank", "?")), (r["step"], r["straggler_ratio"]), fontsize=7)
        ax.set_xlabel("step")
        ax.set_ylabel("slowest pace / median (rank marked)")
        ax.legend(fontsize=7)
        written.append(save(fig, out_dir, "stragglers.png"))
    if any(shares.values()):
        fig = Figure(figsize=(5, 3.5))
        ax = fig.add_subplot()
        for name, record in shares.items():
            axes = sorted(k[len("comm_share_") :] for k in record or {} if k.startswith("comm_share_"))
            ax.bar([f"{name}\n{a}" for a in axes], [record[f"comm_share_{a}"] for a in axes])
        ax.set_ylabel("share of step time in collectives")
        written.append(save(fig, out_dir, "comm_share.png"))
    return written


def save(fig, out_dir: str, filename: str) -> str:
    """Write a figure as out_dir/filename (the folder made); returns the path."""
    os.makedirs(out_dir, exist_ok=True)
    fig.tight_layout()
    path = os.path.join(out_dir, filename)
    fig.savefig(path, dpi=100)
    return path


def scaling_rows(runs: list[dict]) -> list[dict]:
    """Speedup and efficiency of each run against its framework's run on the fewest devices."""
    out = []
    for r in sorted(runs, key=lambda r: (r.get("framework", "?"), r["devices"], label(r))):
        base = min((b for b in runs if b.get("framework") == r.get("framework")), key=lambda b: b["devices"])
        speedup = r["tokens_per_sec"] / base["tokens_per_sec"]
        out.append(
            {**r, "speedup": speedup, "efficiency": speedup / (r["devices"] / base["devices"]), "baseline": label(base)}
        )
    return out


def scaling_markdown(rows: list[dict]) -> str:
    fmt = lambda x, f: "-" if x is None else format(x, f)
    lines = [
        "| run | devices | tokens/s | speedup | efficiency | peak GiB / device | bubble | baseline |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {label(r)} | {r['devices']} | {r['tokens_per_sec']:,.0f} | {r['speedup']:.2f}x | "
        f"{r['efficiency']:.0%} | {fmt(r.get('memory_gib'), '.2f')} | {fmt(r.get('pipeline_bubble'), '.3f')} | "
        f"{r['baseline']} |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


def plot_efficiency(rows: list[dict], out_dir: str) -> str:
    import matplotlib  # deferred: matplotlib, optional (the report extra): plots only

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: matplotlib, optional (report extra), after use("Agg")

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


def split_inputs(paths: list[str]) -> tuple[list[str], list[str]]:
    """The positional arguments as (run directories, benchmark files).

    A directory is a run, a file (or a missing path ending in .json) a benchmark result; any other missing path is
    one line.
    """
    run_dirs, files = [], []
    for path in paths:
        if os.path.isdir(path):
            run_dirs.append(path)
        elif os.path.exists(path) or path.endswith(".json"):
            files.append(path)
        else:
            raise UserError(f"{path}: no such run directory or benchmark file")
    return run_dirs, files


def out_folder(out: str | None, default_beside: list[str]) -> str:
    """The folder for the per-file plots: --out (the folder of a .png given to it), else beside `default_beside`."""
    if out is None:
        folder = beside(default_beside)
    else:
        folder = os.path.dirname(os.path.abspath(out)) if out.endswith(".png") and not os.path.isdir(out) else out
    check_output_dir(folder, "--out", out)
    return folder


@cli
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m jaxpar.tools.report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("inputs", nargs="*", metavar="RUN_OR_BENCH", help="run directories and benchmark JSON files")
    ap.add_argument(
        "--out",
        default=None,
        help="a folder for the plots, or a .png file for the curves "
        "(default: beside the runs, or the first benchmark file)",
    )
    ap.add_argument("--scaling", action="store_true", help="also the speedup / efficiency table and plot")
    ap.add_argument("--run", action="append", default=[], help="a run.dir: plot its slow process and comm_share")
    args = ap.parse_args(argv)
    if not args.inputs and not args.run:
        raise UserError("give run directories, benchmark files, --run RUN_DIR, or several")
    run_dirs, files = split_inputs(args.inputs)
    runs = load(files) if files else []  # every input read before anything is written
    slow = {name: run_records(d) for name, d in zip(run_labels(args.run), args.run)}
    written = [curves(run_dirs, args.out)[0]] if run_dirs else []
    if slow:
        drawn = plot_run(slow, out_folder(args.out, args.run))
        if not drawn:
            print(
                f"no straggler plots: no straggler_ratio or per-axis comm_share in {', '.join(args.run)} "
                "(a run of one process on one device has neither)"
            )
        written += drawn
    if runs:
        out_dir = out_folder(args.out, [os.path.dirname(os.path.abspath(files[0]))])
        written += plot(runs, out_dir)
        if args.scaling:
            rows = scaling_rows(runs)
            table = scaling_markdown(rows)
            with open(os.path.join(out_dir, "scaling.md"), "w") as f:
                f.write(f"Scaling on {runs[0].get('device_kind', '?')} ({runs[0].get('date', '')})\n\n{table}")
            print(table, end="")
            written += [os.path.join(out_dir, "scaling.md"), plot_efficiency(rows, out_dir)]
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
