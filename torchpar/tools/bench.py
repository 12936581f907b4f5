"""torchrun --nproc_per_node=N -m torchpar.tools.bench --config C --backend B [--compile] [--json F] [--record].

torchpar's twin of `jaxpar.tools.bench`: the real backend step on synthetic tokens, warmed up, each
timed step synchronised on the device; tokens/s, MFU against the datasheet peak and a matmul
ceiling measured on the spot, peak memory. Same JSON fields and markdown row as jaxpar's.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import shlex
import sys
import time

import numpy as np

from jaxpar.core.bench_records import publish
from jaxpar.core.config.schema import load_config
from jaxpar.core.errors import UserError, cli
from jaxpar.core.model.flops import flops_per_token, peak_flops
from torchpar.backends import BACKENDS


def matmul_ceiling(device, dtype) -> float:
    import torch  # deferred: torch (~1.5 s), after the arguments are checked

    n = 8192 if device.type == "cuda" else 1024
    a = torch.ones((n, n), dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a @ a
    sync()
    reps, t0 = 10, time.perf_counter()
    for _ in range(reps):
        a @ a
    sync()
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def warm_engine(cfg, backend: str, warmup: int, compile_model: bool, eager_loss: bool = False):
    """The backend's engine over the config's model, run `warmup` steps on synthetic rows.

    (env, engine, whether its blocks were compiled, this rank's rows, the device's synchronize).
    `eager_loss`: the chunked loss's step left uncompiled under compile (the side-by-side of gpu_check).
    """
    import torch  # deferred: torch (~1.5 s), after the arguments are checked

    from torchpar import dist  # deferred: imports torch, after the arguments are checked
    from torchpar.models.decoder import Decoder  # deferred: imports torch, after the arguments are checked
    from torchpar.models.head import chunk_loss  # deferred: imports torch, after the arguments are checked
    from torchpar.parallelize import parallelize  # deferred: imports torch, after the arguments are checked

    env = dist.init(backend != "none", cfg.run.peer_timeout_s)
    model = Decoder(cfg.model)
    model.init_weights(cfg.train.seed)
    # as torchpar.train does; --compile, or train.compile
    engine, compile_model = parallelize(model, cfg, env, backend, compile_model=compile_model or None)
    if eager_loss:
        model.loss_chunk = chunk_loss
    B = cfg.train.global_batch_size
    share, ways = engine.data_rank, engine.data_ways  # as the trainer: pipeline stages read the whole batch
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (B, cfg.data.seq_len + 1))
    mine = torch.from_numpy(tokens[share * B // ways : (share + 1) * B // ways]).long().to(env.device)
    sync = torch.cuda.synchronize if env.device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        engine.update(mine)
    sync()
    return env, engine, compile_model, mine, sync


def bench(cfg, backend: str, steps: int, warmup: int, compile_model: bool, eager_loss: bool = False) -> dict:
    import torch  # deferred: torch (~1.5 s), after the arguments are checked

    env, engine, compile_model, mine, sync = warm_engine(cfg, backend, warmup, compile_model, eager_loss)
    B, W = cfg.train.global_batch_size, env.world
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        handle = engine.update(mine)
        sync()
        times.append(time.perf_counter() - t0)
    step_s = float(np.median(times))
    tps = B * cfg.data.seq_len / step_s
    fpt = flops_per_token(cfg.model, cfg.data.seq_len)
    cuda = env.device.type == "cuda"
    kind = torch.cuda.get_device_name(env.device) if cuda else "cpu"
    peak = peak_flops(kind, cfg.model.compute_dtype)
    dtype = torch.bfloat16 if cfg.model.compute_dtype == "bfloat16" else torch.float32
    ceiling = matmul_ceiling(env.device, dtype)
    return {
        "date": datetime.date.today().isoformat(),
        "framework": "torchpar",
        "backend": backend,
        "devices": W,
        "device_kind": f"{env.device.type}:{kind}",
        "compiled": compile_model,
        "loss_compiled": compile_model and not eager_loss and backend != "pipeline",  # its last stage: eager
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "compute_dtype": cfg.model.compute_dtype,
        "remat": cfg.model.remat,
        "seq_len": cfg.data.seq_len,
        "global_batch_size": B,
        "step_time_s": step_s,
        "tokens_per_sec": tps,
        "mfu_datasheet": tps * fpt / (peak * W) if peak else None,
        "matmul_ceiling_flops": ceiling,
        "mfu_ceiling": tps * fpt / (ceiling * W),
        "memory_gib": torch.cuda.max_memory_allocated(env.device) / 2**30 if cuda else None,
        "loss": engine.read(handle)["loss"],
        "command": "python -m torchpar.tools.bench " + shlex.join(sys.argv[1:]),
        "is_main": env.is_main,
    }


@cli
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m torchpar.tools.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config")
    ap.add_argument("--backend", default="none", choices=BACKENDS)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="torch.compile the blocks (as train.compile=on)")
    ap.add_argument("--eager-loss", action="store_true", help="under compile, leave the chunked loss's step eager")
    ap.add_argument("--json")
    ap.add_argument("--record", action="store_true", help="append a row to docs/benchmarks/torchpar-bench.md")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args(argv)
    if args.steps < 1 or args.warmup < 0:
        raise UserError("--steps must be >= 1 and --warmup >= 0")
    cfg = load_config(args.config, args.overrides)
    from torchpar import dist  # deferred: imports torch, after the arguments are checked

    try:
        result = bench(cfg, args.backend, args.steps, args.warmup, args.compile, args.eager_loss)
    finally:
        dist.teardown()
    if not result.pop("is_main"):
        return 0
    publish(result, args.json, args.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
