"""python -m jaxpar.bench --config C --mesh M [--steps 10 --warmup 3] [--json F] [--record] [k=v ...]

Times the real train step (compiled once, warmed up, each timed step synchronised on the device)
on synthetic tokens, and reports tokens/s, MFU against the datasheet peak and against a matmul
ceiling measured on the spot, and peak device memory. `--record` appends a dated markdown row to
docs/benchmarks/jaxpar-bench.md with device, versions and the exact command.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import time

from jaxpar.config import Config, load_config
from jaxpar.errors import UserError, cli
from jaxpar.mesh import format_mesh, parse_mesh, setup_devices

RECORD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "benchmarks",
                      "jaxpar-bench.md")


def matmul_ceiling(dtype: str) -> float:
    """FLOP/s of one large square matmul on one device: the practical roof for MFU."""
    import jax
    import jax.numpy as jnp

    n = 8192 if jax.devices()[0].platform == "gpu" else 1024
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    reps, t0 = 10, time.perf_counter()
    for _ in range(reps):
        out = f(a)
    out.block_until_ready()
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def bench(cfg: Config, sizes: dict[str, int], steps: int, warmup: int) -> dict:
    import jax
    import numpy as np

    from jaxpar.metrics import device_memory_gib, flops_per_token, peak_flops
    from jaxpar.mesh import make_mesh
    from jaxpar.sharding import rules_for
    from jaxpar.state import Layout, init_state, make_train_step

    layout = Layout(cfg, make_mesh(sizes), rules_for(cfg.parallel.zero_stage))
    shape = (cfg.train.global_batch_size, cfg.data.seq_len + 1)
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, shape, dtype=np.int32)
    batch = jax.device_put(tokens, layout.batch_sharding)
    state = init_state(layout)
    step = make_train_step(layout).lower(state, batch).compile()
    for _ in range(warmup):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    n_dev = jax.device_count()
    step_s = float(np.median(times))
    tps = shape[0] * cfg.data.seq_len / step_s
    fpt = flops_per_token(cfg.model, cfg.data.seq_len)
    device = jax.devices()[0]
    peak = peak_flops(device.device_kind, cfg.model.compute_dtype)
    ceiling = matmul_ceiling(cfg.model.compute_dtype)
    return {
        "date": datetime.date.today().isoformat(), "framework": "jaxpar", "mesh": format_mesh(dict(layout.mesh.shape)),
        "devices": n_dev, "device_kind": f"{device.platform}:{device.device_kind}",
        "versions": {"jax": jax.__version__, "python": platform.python_version()},
        "compute_dtype": cfg.model.compute_dtype, "remat": cfg.model.remat, "seq_len": cfg.data.seq_len,
        "global_batch_size": shape[0], "step_time_s": step_s, "tokens_per_sec": tps,
        "mfu_datasheet": tps * fpt / (peak * n_dev) if peak else None,
        "matmul_ceiling_flops": ceiling, "mfu_ceiling": tps * fpt / (ceiling * n_dev),
        "memory_gib": device_memory_gib(device), "loss": float(metrics["loss"]),
        "command": "python -m jaxpar.bench " + shlex.join(sys.argv[1:]),
    }


def markdown_row(r: dict) -> str:
    pct = lambda x: "-" if x is None else f"{x:.1%}"  # noqa: E731
    mem = "-" if r["memory_gib"] is None else f"{r['memory_gib']:.2f}"
    return (f"| {r['date']} | {r['device_kind']} x{r['devices']} | {r['mesh']} | {r['compute_dtype']} | "
            f"{r['seq_len']}x{r['global_batch_size']} | {r['tokens_per_sec']:,.0f} | {pct(r['mfu_datasheet'])} | "
            f"{pct(r['mfu_ceiling'])} | {mem} | jax {r['versions']['jax']} | `{r['command']}` |")


HEADER = ("| date | device | mesh | dtype | seq x batch | tokens/s | MFU (datasheet) | MFU (matmul ceiling) | "
          "peak GiB | versions | command |\n|---|---|---|---|---|---|---|---|---|---|---|\n")


@cli
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxpar.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config")
    ap.add_argument("--mesh")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--record", action="store_true", help=f"append a row to {os.path.relpath(RECORD)}")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args(argv)
    if args.steps < 1 or args.warmup < 0:
        raise UserError("--steps must be >= 1 and --warmup >= 0")
    cfg = load_config(args.config, args.overrides)
    sizes = parse_mesh(args.mesh or cfg.parallel.mesh)
    setup_devices(sizes)
    result = bench(cfg, sizes, args.steps, args.warmup)
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.record:
        new = not os.path.exists(RECORD)
        with open(RECORD, "a") as f:
            f.write((HEADER if new else "") + markdown_row(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
