"""torchrun --nproc_per_node=N -m torchpar.train --config C --backend ddp|fsdp|deepspeed|none [section.key=value ...]

The same model, configs and data order as jaxpar.train, on PyTorch. Also: --deepspeed-config J
(merged over the generated DeepSpeed JSON), --cpu-offload, --write-init PATH (write the initial
weights in the shared safetensors layout and exit), --write-final PATH (the final weights, same layout).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # grain (the data pipeline) imports jax: keep it off the GPUs

from jaxpar.config import Config, load_config, profile_window  # noqa: E402
from jaxpar.errors import UserError  # noqa: E402
from jaxpar.faults import fault_hooks  # noqa: E402
from torchpar.backends import BACKENDS  # noqa: E402
from torchpar.dist import launch_env  # noqa: E402

PRECISION = {"default": "high", "high": "high", "highest": "highest"}  # jaxpar's default on GPU is TF32 too


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m torchpar.train", description=__doc__)
    p.add_argument("--config", help="YAML config (configs/*.yaml); built-in defaults if omitted")
    p.add_argument("--backend", default="ddp", help=f"one of {', '.join(BACKENDS)} (default ddp)")
    p.add_argument("--deepspeed-config", default="", help="DeepSpeed JSON merged over the generated one")
    p.add_argument("--cpu-offload", action="store_true", help="fsdp: CPUOffloadPolicy; deepspeed: optimizer/params")
    p.add_argument("--write-init", metavar="PATH", help="write the initial weights (.safetensors) and exit")
    p.add_argument("--write-final", metavar="PATH", help="after training, also write the final weights (.safetensors)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    return p.parse_intermixed_args(argv)


def check(cfg: Config, args) -> None:
    """Everything knowable before a process group exists: one clear line, identical on every rank."""
    _, world, _ = launch_env()
    if args.backend not in BACKENDS:
        raise UserError(f"unknown backend {args.backend!r}; choose one of {', '.join(BACKENDS)}")
    if args.backend == "none" and world > 1:
        raise UserError(f"--backend none runs one process, but WORLD_SIZE={world}; use ddp, fsdp or deepspeed")
    if args.backend == "ddp" and cfg.parallel.zero_stage:
        raise UserError(f"parallel.zero_stage={cfg.parallel.zero_stage} needs --backend deepspeed or fsdp "
                        "(ddp is ZeRO-0)")
    if args.cpu_offload and args.backend not in ("fsdp", "deepspeed"):
        raise UserError("--cpu-offload needs --backend fsdp or deepspeed")
    if args.cpu_offload and args.backend == "fsdp":
        import torch
        if not torch.cuda.is_available():
            raise UserError("--cpu-offload with fsdp needs a GPU to offload from (parameters are on the CPU already)")
    if args.deepspeed_config and args.backend != "deepspeed":
        raise UserError("--deepspeed-config needs --backend deepspeed")
    micro = cfg.train.global_batch_size // cfg.train.microbatches
    if args.backend == "pipeline":
        from torchpar.backends.pipeline import check_pipeline
        check_pipeline(cfg, world)
    elif micro % world:
        raise UserError(f"batch per microbatch {micro} (train.global_batch_size={cfg.train.global_batch_size} / "
                        f"train.microbatches={cfg.train.microbatches}) is not divisible by the world size {world}")
    if args.backend == "deepspeed":
        from torchpar.backends.deepspeed import import_deepspeed, load_user_config
        import_deepspeed()
        if args.deepspeed_config:
            load_user_config(args.deepspeed_config)


def build_model(cfg: Config):
    from torchpar.model import GPT

    model = GPT(cfg.model)
    model.init_weights(cfg.train.seed)
    return model


def write_init(cfg: Config, path: str) -> int:
    from jaxpar.compat.weights import save_weights, unflatten
    from torchpar.layout import to_shared

    if launch_env()[0] == 0:
        save_weights(path, unflatten(to_shared(build_model(cfg).state_dict(), cfg.model.n_layer)))
        print(f"wrote initial weights to {path}", file=sys.stderr)
    return 0


def train(cfg: Config, args) -> int:
    import torch

    from jaxpar.compat.weights import load_weights, save_weights, unflatten
    from jaxpar.data import TokenBatches, resolve_dataset
    from jaxpar.metrics import MetricsLog, flops_per_token, peak_flops
    from torchpar import backends, dist
    from torchpar.layout import from_shared, shared_shapes, to_shared

    torch.set_float32_matmul_precision(PRECISION[cfg.train.matmul_precision])
    if torch.cuda.is_available():
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS; before first use
    env = dist.init(args.backend != "none")
    if env.device.type == "cuda":  # CPU kernels used here are deterministic already (and the call costs ~1 s)
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = False  # DeepSpeed allocates large empty buckets
    t, d = cfg.train, cfg.data
    dataset = resolve_dataset(d)
    micro_batch, M, W, r = t.global_batch_size // t.microbatches, t.microbatches, env.world, env.rank
    train_data = TokenBatches(dataset, d.seq_len, t.global_batch_size, t.seed, "train", d.val_fraction)
    val_data = TokenBatches(dataset, d.seq_len, micro_batch, t.seed, "val", d.val_fraction)
    if train_data.vocab_size > cfg.model.vocab_size:
        raise UserError(f"dataset {dataset} has vocab {train_data.vocab_size} > "
                        f"model.vocab_size={cfg.model.vocab_size}")

    model = build_model(cfg)
    if cfg.model.init_from:  # a resumed checkpoint below overwrites these
        flat = load_weights(cfg.model.init_from, shared_shapes(cfg.model))
        model.load_state_dict(from_shared(flat, cfg.model.n_layer))
    n_params = sum(p.numel() for p in model.parameters())
    engine = backends.build(args.backend, model, cfg, env, deepspeed_config=args.deepspeed_config,
                            cpu_offload=args.cpu_offload)
    os.makedirs(cfg.run.dir, exist_ok=True)
    resumed = engine.checkpointer.restore() if cfg.checkpoint.resume else None
    step = engine.step = int(resumed["data_step"]) if resumed else 0
    if env.is_main:
        with open(os.path.join(cfg.run.dir, "config.json"), "w") as f:
            json.dump({**cfg.to_dict(), "backend": args.backend, "world_size": W}, f, indent=2)
        print(f"backend {args.backend} on {W} {env.device.type} processes; {n_params:,} params", flush=True)

    share, ways = engine.data_rank, engine.data_ways  # pipeline: every stage reads the whole batch

    def rows(data, s, n):  # this rank's rows of the global batch at step s
        return torch.from_numpy(data.rows(s, share * n // ways, (share + 1) * n // ways)).long().to(env.device)

    def evaluate() -> float:
        engine.module.eval()
        losses = [engine.eval_loss(rows(val_data, i, micro_batch)) for i in range(t.eval_batches)]
        engine.module.train()
        return dist.all_sum([sum(losses) / len(losses)], env)[0] / ways

    stop = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _: stop.setdefault("signal", signum))
    log = MetricsLog(cfg.run.dir, env.is_main, t.steps)
    cuda = env.device.type == "cuda"
    peak = peak_flops(torch.cuda.get_device_name(env.device) if cuda else "cpu", cfg.model.compute_dtype)
    fpt = flops_per_token(cfg.model, d.seq_len)
    mark, mark_step = time.perf_counter(), step
    meta = lambda s: {"step": s, "data_step": s, "backend": args.backend, "world_size": W}  # noqa: E731
    window, profiler = profile_window(t.profile_steps), None
    while step < t.steps:
        if window and step == window[0]:  # train.profile_steps=a:b -> <run.dir>/profile/trace_rank<r>.json
            profiler = torch.profiler.profile()
            profiler.start()
        batch = rows(train_data, step, t.global_batch_size)  # microbatch m = rows m, m+M, ... (as jaxpar)
        loss, grad_norm, lr = engine.train_step([batch[m::M] for m in range(M)])
        step += 1
        # One small all-reduce: the global mean loss (for logging) and whether any rank was signalled.
        loss_sum, signalled = dist.all_sum([float(loss), float("signal" in stop)], env)
        halt = signalled > 0
        last = step == t.steps or halt
        do_eval = last or (t.eval_every and step % t.eval_every == 0)
        logged = step % t.log_every == 0 or do_eval or last
        if logged:
            now = time.perf_counter()
            tps = (step - mark_step) * t.global_batch_size * d.seq_len / (now - mark)
            record = {"step": step, "loss": loss_sum / ways, "grad_norm": float(grad_norm), "lr": float(lr),
                      "tokens_per_sec": tps, "step_time_s": (now - mark) / (step - mark_step),
                      "mfu": tps * fpt / (peak * W) if peak else None,
                      "memory_gib": torch.cuda.max_memory_allocated(env.device) / 2**30 if cuda else None}
            if do_eval:
                record["eval_loss"] = evaluate()
            log.log(record)
        if last or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
            engine.checkpointer.save(step, meta(step))
        if logged:  # throughput covers training steps only, not evaluation or checkpoint saves
            mark, mark_step = time.perf_counter(), step
        if profiler and (step == window[1] or last):
            profiler.stop()
            os.makedirs(os.path.join(cfg.run.dir, "profile"), exist_ok=True)
            profiler.export_chrome_trace(os.path.join(cfg.run.dir, "profile", f"trace_rank{r}.json"))
            profiler = None
        fault_hooks("TORCHPAR", step)  # test hooks (jaxpar/faults.py)
        if halt:
            if env.is_main:
                print(f"stopped by signal after step {step}; checkpoint saved", file=sys.stderr)
            break
    if args.write_final:
        full = engine.full_state_dict()  # a collective under fsdp / ZeRO: every rank takes part
        if env.is_main:
            save_weights(args.write_final, unflatten(to_shared(full, cfg.model.n_layer)))
            print(f"wrote final weights to {args.write_final}", file=sys.stderr)
    log.close()
    return 0


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    rank0 = launch_env()[0] == 0
    try:
        cfg = load_config(args.config, args.overrides)
        check(cfg, args)
        if args.write_init:
            return write_init(cfg, args.write_init)
        try:
            return train(cfg, args)
        finally:
            from torchpar import dist
            dist.teardown()
    except UserError as e:
        if rank0:
            print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
