"""Throughput benchmark of the real jaxpar train step on one layout.

python -m jaxpar.tools.bench --config C --mesh M [--steps 10 --warmup 3] [--json F] [--record] [k=v ...]

Times the real train step (compiled once, warmed up, each timed step synchronised on the device)
on synthetic tokens, and reports tokens/s, MFU against the datasheet peak and against a matmul
ceiling measured on the spot, and peak device memory. `--record` appends a dated markdown row to
docs/benchmarks/jaxpar-bench.md with device, versions and the exact command. `--compare` also
runs `torchpar.tools.bench` (torch.compile on, one process) on the same config and reports the ratio.
"""

from __future__ import annotations

if __name__ == "__main__":  # before jax is imported: glibc reads its malloc tunables at process start
    from jaxpar.core.run.malloc import relaunch_with_huge_pages

    relaunch_with_huge_pages("jaxpar.tools.bench")

import argparse
import datetime
import json
import math
import platform
import shlex
import subprocess
import sys
import tempfile
import time

import numpy as np

from jaxpar.core.bench_records import publish, record_row
from jaxpar.core.config.contract import CONTRACT
from jaxpar.core.config.schema import Config, load_config
from jaxpar.core.errors import UserError, cli
from jaxpar.core.model.flops import flops_per_token, peak_flops
from jaxpar.core.config.mesh_spec import format_mesh, parse_mesh
from jaxpar.core.pipeline.schedules import configured_bubble
from jaxpar.mesh import device_memory, setup_devices


def matmul_ceiling(dtype: str) -> float:
    """FLOP/s of one large square matmul on one device: the practical roof for MFU."""
    import jax  # deferred: jax (~1 s), after the arguments are checked
    import jax.numpy as jnp  # deferred: jax (~1 s), after the arguments are checked

    n = 8192 if jax.devices()[0].platform == "gpu" else 1024
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    reps, t0 = 10, time.perf_counter()
    for _ in range(reps):
        out = f(a)
    out.block_until_ready()
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def warm_step(cfg: Config, sizes: dict[str, int], warmup: int, devices=None):
    """(compiled step, state after `warmup` steps, a synthetic batch, layout) of one mesh on `devices`."""
    import jax  # deferred: jax (~1 s), after the arguments are checked

    from jaxpar.step import build_step  # deferred: imports jax, after the arguments are checked

    layout, state, step = build_step(cfg, sizes, devices)
    shape = (cfg.train.global_batch_size, cfg.data.seq_len + 1)
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, shape, dtype=np.int32)
    batch = jax.device_put(tokens, layout.batch_sharding)
    for _ in range(warmup):
        state, metrics = step(state, batch)
    jax.block_until_ready(state)
    return step, state, batch, layout


def bench(cfg: Config, sizes: dict[str, int], steps: int, warmup: int, devices=None) -> dict:
    """One mesh on `devices` (default: all): the median step time and what follows from it."""
    import jax  # deferred: jax (~1 s), after the arguments are checked

    from jaxpar.pipeline.auto import resolve_schedule  # deferred: imports jax, after the arguments are checked
    from jaxpar.cost.peak_bytes import peak_bytes  # deferred: imports jax, after the arguments are checked

    cfg, _ = resolve_schedule(cfg, sizes, jax.devices() if devices is None else devices, peak_bytes)  # auto
    step, state, batch, layout = warm_step(cfg, sizes, warmup, devices)
    shape = batch.shape
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    n_dev = layout.mesh.size
    step_s = float(np.median(times))
    tps = shape[0] * cfg.data.seq_len / step_s
    fpt = flops_per_token(cfg.model, cfg.data.seq_len)
    device = jax.devices()[0]
    peak = peak_flops(device.device_kind, cfg.model.compute_dtype)
    ceiling = matmul_ceiling(cfg.model.compute_dtype)
    p = cfg.parallel
    return {
        "date": datetime.date.today().isoformat(),
        "framework": "jaxpar",
        "mesh": format_mesh(dict(layout.mesh.shape)),
        "devices": n_dev,
        "device_kind": f"{device.platform}:{device.device_kind}",
        "versions": {"jax": jax.__version__, "python": platform.python_version()},
        "compute_dtype": cfg.model.compute_dtype,
        "float8": cfg.model.float8,
        "remat": cfg.model.remat,
        "seq_len": cfg.data.seq_len,
        "global_batch_size": shape[0],
        "step_time_s": step_s,
        "tokens_per_sec": tps,
        "mfu_datasheet": tps * fpt / (peak * n_dev) if peak else None,
        "matmul_ceiling_flops": ceiling,
        "mfu_ceiling": tps * fpt / (ceiling * n_dev),
        "memory_gib": device_memory(device)["memory_gib"],
        "loss": float(metrics["loss"]),
        "pipeline_bubble": configured_bubble(
            p.pipeline_schedule, layout.mesh.shape["pp"], p.pipeline_microbatches, p.pipeline_virtual_stages
        ),
        "command": "python -m jaxpar.tools.bench " + shlex.join(sys.argv[1:]),
    }


def sweep(cfg: Config, meshes: list[dict[str, int]], args) -> int:
    """Each mesh on the first devices it needs (on CPU: as many simulated devices as the largest needs)."""
    import jax  # deferred: jax (~1 s), after the arguments are checked

    setup_devices(max(meshes, key=lambda sizes: math.prod(sizes.values())))
    rows = [bench(cfg, sizes, args.steps, args.warmup, jax.devices()[: math.prod(sizes.values())]) for sizes in meshes]
    for row in rows:
        print(f"{row['mesh']:>24}: {row['tokens_per_sec']:,.0f} tok/s on {row['devices']} devices")
        if args.record:
            record_row(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


def compare(args, result: dict) -> dict:
    """Run torchpar (torch.compile on, one process) on the same config and device; tokens/s ratio."""
    # jaxpar's own keys (e.g. train.scan_layers) have no torchpar meaning: torchpar runs without them
    row = lambda o: CONTRACT.get(o.split("=", 1)[0].strip())
    shared = [o for o in args.overrides if row(o) is None or row(o).torchpar]
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [
            sys.executable,
            "-m",
            "torchpar.tools.bench",
            "--backend",
            "none",
            "--compile",
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--json",
            out.name,
            *(["--config", args.config] if args.config else []),
            *shared,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise UserError(f"torchpar.tools.bench failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
        torch_result = json.load(open(out.name))
    return {
        "jaxpar_tokens_per_sec": result["tokens_per_sec"],
        "torchpar_tokens_per_sec": torch_result["tokens_per_sec"],
        "ratio": result["tokens_per_sec"] / torch_result["tokens_per_sec"],
        "torchpar": torch_result,
    }


@cli
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m jaxpar.tools.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config")
    ap.add_argument(
        "--mesh", action="append", help="mesh axes; repeat it to sweep several meshes in one run (for report --scaling)"
    )
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--record", action="store_true", help="append a row to docs/benchmarks/jaxpar-bench.md")
    ap.add_argument(
        "--compare",
        action="store_true",
        help="also run torchpar (torch.compile, one process) on the same config; report the ratio",
    )
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args(argv)
    if args.steps < 1 or args.warmup < 0:
        raise UserError("--steps must be >= 1 and --warmup >= 0")
    cfg = load_config(args.config, args.overrides)
    meshes = [parse_mesh(m) for m in args.mesh or [cfg.parallel.mesh]]
    if len(meshes) > 1:
        if args.compare or -1 in {n for sizes in meshes for n in sizes.values()}:
            raise UserError("a sweep (several --mesh) takes explicit sizes and no --compare")
        return sweep(cfg, meshes, args)
    setup_devices(meshes[0])
    result = bench(cfg, meshes[0], args.steps, args.warmup)
    publish(result, args.json, args.record)
    if args.compare:
        cmp = compare(args, result)
        print(
            f"jaxpar {cmp['jaxpar_tokens_per_sec']:,.0f} tok/s vs torchpar (compiled) "
            f"{cmp['torchpar_tokens_per_sec']:,.0f} tok/s: ratio {cmp['ratio']:.2f}"
        )
        if args.record:
            record_row(cmp["torchpar"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
