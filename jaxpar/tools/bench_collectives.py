"""Collective-bandwidth benchmark over all devices, in nccl-tests' terms.

python -m jaxpar.tools.bench_collectives [--devices N] [--max-mib 64] [--json F]

Bandwidth of all-reduce, all-gather, reduce-scatter and a ring ppermute over all devices, for
message sizes from 4 KiB up, via `jax.shard_map`. Message size and bandwidths follow nccl-tests:
algbw = size / time (size = the all-gather's output, the other ops' input), busbw = algbw times
the bytes each link must carry per byte of message, so numbers compare across tools.
"""

from __future__ import annotations

import argparse
import sys
import time

from jaxpar.core.bench_records import measurement, print_rows, write_json
from jaxpar.core.errors import UserError, check_output_file, cli
from jaxpar.mesh import setup_devices


def _ops(n: int):
    import jax  # deferred: jax (~1 s), after the arguments are checked

    ring = [(i, (i + 1) % n) for i in range(n)]
    return {
        "all_reduce": lambda x: jax.lax.psum(x, "x"),
        "all_gather": lambda x: jax.lax.all_gather(x, "x", tiled=True),
        "reduce_scatter": lambda x: jax.lax.psum_scatter(x, "x", tiled=True),
        "ppermute": lambda x: jax.lax.ppermute(x, "x", ring),
    }


def run(max_bytes: int, reps: int = 5) -> list[dict]:
    import jax  # deferred: jax (~1 s), after the arguments are checked
    import jax.numpy as jnp  # deferred: jax (~1 s), after the arguments are checked
    from jax.sharding import NamedSharding, PartitionSpec as P  # deferred: jax (~1 s), after the arguments are checked

    devices = jax.devices()
    n = len(devices)
    mesh = jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,), devices=devices)
    rows, size = [], 4096
    while size <= max_bytes:
        elems = max(size // 4 // n * n, n)  # per-device float32 elements, divisible for reduce-scatter
        x = jax.device_put(jnp.ones((n * elems,), jnp.float32), NamedSharding(mesh, P("x")))
        for name, op in _ops(n).items():
            f = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
            f(x).block_until_ready()
            t0 = time.perf_counter()
            for _ in range(reps):
                y = f(x)
            y.block_until_ready()
            dt = (time.perf_counter() - t0) / reps
            nbytes = elems * 4 * (n if name == "all_gather" else 1)  # message size: all-gather's is its output
            rows.append(measurement(name, nbytes, dt, n, devices[0].platform))
        size *= 4
    return rows


@cli
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m jaxpar.tools.bench_collectives",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--devices", type=int, default=8, help="simulated CPU devices when there is no accelerator")
    ap.add_argument("--max-mib", type=float, default=16)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.devices < 1 or not args.max_mib > 0:
        raise UserError("--devices must be at least 1 and --max-mib above 0")
    if args.json:
        check_output_file(args.json, "--json")  # before the measurements, not after them

    setup_devices({"dp": args.devices})
    rows = run(int(args.max_mib * 2**20))
    print_rows(rows)
    if args.json:
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
