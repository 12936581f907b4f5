"""python -m parity_tests.report --out docs/parity-report [--full] [--device cpu|gpu] [--steps K].

Runs the parity selection (the default one, or every config x layout/backend with --full) and writes
<out>/report.md (maximum deviations per config x side, against the reference each is checked
against, pass/fail) and <out>/loss_curves.png (loss per step, jaxpar and torchpar overlaid).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time

from jaxpar.core.errors import check_output_dir, cli


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    out = [f"python {platform.python_version()}"]
    for pkg in ("jax", "jaxlib", "flax", "optax", "torch", "deepspeed", "numpy"):
        try:
            out.append(f"{pkg} {version(pkg)}")
        except PackageNotFoundError:
            pass
    return ", ".join(out)


def _plot(runs_by_config: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(runs_by_config)
    fig, axes = plt.subplots(1, n, figsize=(4.5 * n, 3.6), squeeze=False)
    for ax, (config, runs) in zip(axes[0], runs_by_config.items()):
        for run in runs:
            jax_side = run.side.startswith("jax")
            ax.plot(
                range(1, len(run.loss) + 1),
                run.loss,
                label=run.side,
                lw=2.5 if jax_side else 1.0,
                ls="-" if jax_side else "--",
                alpha=0.6 if jax_side else 1.0,
            )
        ax.set_title(config)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.legend(fontsize=7)
    fig.suptitle("jaxpar (solid) and torchpar (dashed): loss per step from the same initial weights")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def key_bias(d: dict) -> str:
    """The key-bias column; variants without a key bias (mla) have none."""
    return f"{d['key_bias_abs']:.1e} (bound {d['key_bias_bound']:.0e})" if "key_bias_abs" in d else "n/a"


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m parity_tests.report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default="docs/parity-report", help="output directory (report.md, loss_curves.png)")
    p.add_argument("--full", action="store_true", help="every config x every layout/backend")
    p.add_argument("--device", choices=("cpu", "gpu"), default=os.environ.get("PARITY_DEVICE", "cpu"))
    p.add_argument("--steps", type=int, default=int(os.environ.get("PARITY_STEPS", "50")))
    p.add_argument("--workdir", help="where runs are written (default: a temporary directory)")
    return p.parse_args(argv)


def informational(case) -> bool:
    """bfloat16 across frameworks, for information: each is checked against its own float32 run."""
    return case.config == "bfloat16" and not case.ref_overrides


def run_cases(args, runner) -> tuple[list, dict]:
    """(rows of (case, comparison or None, why skipped), loss curves by config and side)."""
    from parity_tests.compare import BFLOAT16, compare
    from parity_tests.matrix import Case, cases
    from parity_tests.runner import REFERENCE

    rows, curves = [], {}
    for case in [*cases(args.full), Case("bfloat16", "torch:none", REFERENCE)]:
        skipped = runner.unavailable(case.side) or runner.unavailable(case.ref_side)
        if skipped:
            rows.append((case, None, skipped))
            continue
        ref = runner.run(case.config, case.ref_side, case.ref_overrides)
        got = runner.run(case.config, case.side)
        c = compare(got, ref, BFLOAT16 if case.config == "bfloat16" else case.tol)
        rows.append((case, c, None))
        print(c.message(), flush=True)
        curves.setdefault(case.config, {})[got.side] = got
        if not case.ref_overrides:  # not a float32 twin
            curves[case.config][ref.side] = ref
    return rows, curves


def report_lines(args, rows, runs: int, elapsed: float) -> list[str]:
    lines = [
        f"# Parity report ({'full matrix' if args.full else 'default selection'})",
        "",
        f"{datetime.date.today().isoformat()}, device {args.device}, {args.steps} steps per run, "
        f"{runs} runs in {elapsed:.0f} s.  ",
        _versions() + ".  ",
        f"Command: `python -m parity_tests.report --out {args.out}"
        + (" --full" if args.full else "")
        + (f" --device {args.device}" if args.device != "cpu" else "")
        + "`",
        "",
        "Maximum deviation over all steps (relative) and over final parameters (relative norm; max abs per "
        "tensor, key bias apart). Tolerances: docs/parity.md.",
        "",
        "| config | side | against | loss | grad_norm | lr | params (rel norm) | max abs (tensor) "
        "| key bias abs | result |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case, c, skipped in rows:
        against = f"{case.ref_side}" + (" float32" if case.ref_overrides else "")
        if c is None:
            lines.append(f"| {case.config} | {case.side} | {against} | | | | | | | skipped: {skipped} |")
            continue
        d = c.deviations
        result = "(info)" if informational(case) else ("pass" if c.ok else f"**FAIL** ({c.first_param or 'series'})")
        lines.append(
            f"| {case.config} | {case.side} | {against} | {d['loss']:.1e} | {d['grad_norm']:.1e} | "
            f"{d['lr']:.1e} | {d['params']:.1e} | {d['param_abs']:.1e} ({d['param_abs_name']}) | "
            f"{key_bias(d)} | {result} |"
        )
    return lines + ["", "![loss curves](loss_curves.png)", ""]


@cli
def main(argv=None) -> int:
    args = parse_args(argv)
    for name, path in (("--out", args.out), ("--workdir", args.workdir)):
        if path is not None:
            check_output_dir(path, name)  # before the runs (an hour with --full), not after them
    from parity_tests.runner import Runner

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="parity-") as tmp:
        runner = Runner(args.workdir or tmp, device=args.device, steps=args.steps)
        rows, curves = run_cases(args, runner)
    elapsed = time.perf_counter() - t0
    os.makedirs(args.out, exist_ok=True)
    _plot({k: list(v.values()) for k, v in curves.items()}, os.path.join(args.out, "loss_curves.png"))
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write("\n".join(report_lines(args, rows, len(runner.cache), elapsed)))
    print(f"wrote {args.out}/report.md and {args.out}/loss_curves.png ({elapsed:.0f} s)")
    return 1 if any(c is not None and not c.ok and not informational(case) for case, c, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
