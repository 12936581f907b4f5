"""Compile time of the real train step against model depth.

python -m jaxpar.tools.bench_compile --config configs/gpt2-124m.yaml [--layers 12,48] [--mesh dp=1] [--record]

Compile time of the real train step against depth (nothing is allocated or run: abstract inputs, as the
planner compiles), after one untimed compile of a one-layer model. The blocks are one stacked module under
`jax.lax.scan` (train.scan_layers=on, the CPU's default), so XLA compiles one layer body whatever the depth;
this shows it (unrolled, the GPU's default, compile time grows with depth). `--record` appends a dated row to
docs/benchmarks/compile-time.md.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import shlex
import sys
import time

import jax

from jaxpar.core.bench_records import append_row
from jaxpar.core.config.schema import load_config
from jaxpar.core.errors import UserError, cli
from jaxpar.core.config.mesh_spec import parse_mesh
from jaxpar.mesh import setup_devices
from jaxpar.cost.peak_bytes import compile_layout

HEADER = (
    "| date | device | config | mesh | layers: seconds (trace + compile) | ratio | versions | command |\n"
    "|---|---|---|---|---|---|---|---|\n"
)


@cli
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m jaxpar.tools.bench_compile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--config")
    ap.add_argument("--mesh", default="dp=1")
    ap.add_argument("--layers", default="12,48", help="comma-separated depths (model.n_layer)")
    ap.add_argument("--record", action="store_true", help="append a row to docs/benchmarks/compile-time.md")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args(argv)
    try:
        depths = [int(d) for d in args.layers.split(",")]
    except ValueError:
        raise UserError(f"--layers {args.layers!r} is not a comma-separated list of integers") from None
    sizes = parse_mesh(args.mesh)
    setup_devices(sizes)

    # one untimed compile first: backend start, autotuning and kernel caches would otherwise count against the
    # first depth
    compile_layout(load_config(args.config, [*args.overrides, "model.n_layer=1"]), sizes)
    seconds = {}
    for n in depths:
        cfg = load_config(args.config, [*args.overrides, f"model.n_layer={n}"])
        t0 = time.perf_counter()
        compile_layout(cfg, sizes)
        seconds[n] = time.perf_counter() - t0
        print(f"{n} layers: compiled in {seconds[n]:.1f}s", flush=True)
    ratio = seconds[depths[-1]] / seconds[depths[0]]
    device = jax.devices()[0]
    row = (
        f"| {datetime.date.today().isoformat()} | {device.platform}:{device.device_kind} | "
        f"{args.config or 'defaults'} "
        f"| {args.mesh} | {', '.join(f'{n}: {s:.1f}' for n, s in seconds.items())} | {ratio:.2f}x | "
        f"jax {jax.__version__}, python {platform.python_version()} | "
        f"`python -m jaxpar.tools.bench_compile {shlex.join(sys.argv[1:])}` |"
    )
    print(f"{depths[-1]} vs {depths[0]} layers: {ratio:.2f}x the compile time")
    if args.record:
        append_row("compile-time.md", HEADER, row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
