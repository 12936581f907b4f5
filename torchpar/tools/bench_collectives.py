"""torchrun --nproc_per_node=N -m torchpar.tools.bench_collectives [--max-mib 16] [--json F].

torch.distributed's all_reduce, all_gather_into_tensor, reduce_scatter_tensor and a ring of
send/recv (batch_isend_irecv) over message sizes from 4 KiB up: algorithm and bus bandwidth with
the same definitions as `jaxpar.tools.bench_collectives` (nccl-tests'), so the two compare directly.
"""

from __future__ import annotations

import argparse
import sys
import time

from jaxpar.core.bench_records import measurement, print_rows, write_json
from jaxpar.core.config.schema import RunConfig
from jaxpar.core.errors import UserError, check_output_file, cli


def _ops(dist, world: int, rank: int):
    def ring(x):
        out = x.new_empty(x.shape)
        reqs = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, x, (rank + 1) % world), dist.P2POp(dist.irecv, out, (rank - 1) % world)]
        )
        for r in reqs:
            r.wait()
        return out

    return {
        "all_reduce": (lambda x: dist.all_reduce(x), 1),
        "all_gather": (lambda x: dist.all_gather_into_tensor(x.new_empty(x.numel() * world), x), world),
        "reduce_scatter": (lambda x: dist.reduce_scatter_tensor(x.new_empty(x.numel() // world), x), 1),
        "ppermute": (ring, 1),
    }


def run(max_bytes: int, reps: int = 5) -> list[dict]:
    import torch  # deferred: torch (~1.5 s), after the arguments are checked
    import torch.distributed as dist  # deferred: torch (~1.5 s), after the arguments are checked

    from torchpar import dist as tdist  # deferred: imports torch, after the arguments are checked

    env = tdist.init(True, RunConfig().peer_timeout_s)
    sync = torch.cuda.synchronize if env.device.type == "cuda" else (lambda: None)
    rows, size = [], 4096
    while size <= max_bytes:
        elems = max(size // 4 // env.world * env.world, env.world)
        x = torch.ones(elems, device=env.device)
        for name, (op, scale) in _ops(dist, env.world, env.rank).items():
            op(x)
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(reps):
                op(x)
            sync()
            dt = (time.perf_counter() - t0) / reps
            nbytes = elems * 4 * scale  # message size: all-gather's is its output
            rows.append(measurement(name, nbytes, dt, env.world, env.device.type))
        size *= 4
    return rows if env.is_main else []


@cli
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m torchpar.tools.bench_collectives",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--max-mib", type=float, default=16)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if not args.max_mib > 0:
        raise UserError("--max-mib must be above 0")
    if args.json:
        check_output_file(args.json, "--json")  # before the measurements, not after them
    from torchpar import dist  # deferred: imports torch, after the arguments are checked

    try:
        rows = run(int(args.max_mib * 2**20))
    finally:
        dist.teardown()
    if rows:  # rank 0
        print_rows(rows)
    if args.json and rows:
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
