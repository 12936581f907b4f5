"""torchrun --nproc_per_node=N -m torchpar.train --config C --backend ddp|fsdp|deepspeed|pipeline|none [k=v ...]

Also launched by `srun` (one task per process; ranks from SLURM_*) and by DeepSpeed's launcher.

The same model, configs and data order as jaxpar.train, on PyTorch. Also: --deepspeed-config J
(merged over the generated DeepSpeed JSON), --write-init PATH (write the initial
weights in the shared safetensors format and exit), --write-final PATH (the final weights, same format).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from jaxpar.core.config import Config, load_config
from jaxpar.core.contract import Run, check_contract
from jaxpar.core.data_order import GlobalBatches, open_splits
from jaxpar.core.errors import UserError, error_line
from jaxpar.core.flops import flops_per_token, peak_flops
from jaxpar.core.loop import ignore_stop_requests, run_loop, sample_lengths, stop_requests
from jaxpar.core.mesh_spec import parse_mesh, resolve_sizes
from jaxpar.core.metrics_log import MetricsLog
from jaxpar.core.prefetch import Prefetch
from jaxpar.core.resume import already_complete, check_resume, start_anew, write_run_config
from jaxpar.core.trackers import check_trackers, open_trackers
from jaxpar.core.weights import load_weights, save_weights, unflatten
from torchpar import dist
from torchpar.backends import BACKENDS
from torchpar.compiling import compile_blocks, use_compile
from torchpar.dist import launch_env
from torchpar.weights import from_shared, shared_shapes, to_shared

PRECISION = {"default": "high", "high": "high", "highest": "highest"}  # jaxpar's default on GPU is TF32 too
# the parallel.mesh axes each backend implements (tp and sp are jaxpar's alone)
MESH_AXES = {"none": (), "ddp": ("dp",), "fsdp": ("dp", "fsdp"), "deepspeed": ("dp",), "pipeline": ("pp", "dp")}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m torchpar.train", description=__doc__)
    p.add_argument("--config", help="YAML config (configs/*.yaml); built-in defaults if omitted")
    p.add_argument("--backend", default="ddp", help=f"one of {', '.join(BACKENDS)} (default ddp)")
    p.add_argument("--deepspeed-config", default="", help="DeepSpeed JSON merged over the generated one")
    p.add_argument("--cpu-offload", action="store_true", help="replaced by the config key parallel.offload")
    p.add_argument("--write-init", metavar="PATH", help="write the initial weights (.safetensors) and exit")
    p.add_argument("--write-final", metavar="PATH", help="after training, also write the final weights (.safetensors)")
    p.add_argument("--local_rank", "--local-rank", type=int, dest="local_rank",
                   help="set by DeepSpeed's launcher (LOCAL_RANK in the environment says the same)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    return p.parse_intermixed_args(argv)


def check(cfg: Config, args) -> None:
    """Everything knowable before a process group exists: one clear line, identical on every rank."""
    _, world, _ = launch_env()
    if args.backend not in BACKENDS:
        raise UserError(f"unknown backend {args.backend!r}; choose one of {', '.join(BACKENDS)}")
    if args.backend == "none" and world > 1:
        raise UserError(f"--backend none runs one process, but WORLD_SIZE={world}; use ddp, fsdp or deepspeed")
    check_mesh(cfg.parallel.mesh, args.backend, world)
    check_trackers(cfg)
    if cfg.train.sample_every and args.backend not in ("none", "ddp"):
        raise UserError(f"train.sample_every needs the whole model on rank 0: --backend none or ddp, not {args.backend} "
                        "(sample from a checkpoint with python -m torchpar.generate)")
    if args.backend == "ddp" and cfg.parallel.zero_stage:
        raise UserError(f"parallel.zero_stage={cfg.parallel.zero_stage} needs --backend deepspeed or fsdp "
                        "(ddp is ZeRO-0)")
    if args.cpu_offload:
        raise UserError("--cpu-offload was replaced by the config key parallel.offload=optimizer|params+optimizer")
    check_offload(cfg, args.backend)
    if cfg.model.compute_dtype == "float16" and args.backend == "pipeline":
        raise UserError("model.compute_dtype=float16 (loss scaling) runs on --backend none, ddp, fsdp or deepspeed, "
                        "not pipeline")
    if cfg.train.compile == "on" and args.backend == "deepspeed":
        raise UserError("train.compile=on is not supported with --backend deepspeed (its engine wraps the model "
                        "and its ZeRO hooks); leave train.compile=auto")
    if args.deepspeed_config and args.backend != "deepspeed":
        raise UserError("--deepspeed-config needs --backend deepspeed")
    micro = cfg.train.global_batch_size // cfg.train.microbatches
    stages = {}
    if args.backend == "pipeline":
        from torchpar.backends.pipeline import check_pipeline, pipeline_sizes
        check_pipeline(cfg, world)
        stages = {"pp": pipeline_sizes(cfg, world)[0]}
    elif micro % world:
        raise UserError(f"batch per microbatch {micro} (train.global_batch_size={cfg.train.global_batch_size} / "
                        f"train.microbatches={cfg.train.microbatches}) is not divisible by the world size {world}")
    if args.backend == "deepspeed":
        from torchpar.backends import deepspeed
        deepspeed.check(cfg, args.deepspeed_config)
    check_contract(Run(cfg, "torchpar", args.backend, stages))


def check_offload(cfg: Config, backend: str) -> None:
    """parallel.offload: what each backend can keep in host memory, or one line saying why not."""
    off, stage = cfg.parallel.offload, cfg.parallel.zero_stage
    if off == "none":
        return
    if backend not in ("fsdp", "deepspeed"):
        raise UserError(f"parallel.offload={off} needs --backend fsdp or deepspeed ({backend} keeps its state on the "
                        "device)")
    if backend == "fsdp" and off == "optimizer":
        raise UserError("FSDP2 offloads parameters, gradients and the optimizer step together: use "
                        "parallel.offload=params+optimizer")
    if backend == "fsdp" and not torch.cuda.is_available():
        raise UserError("parallel.offload with --backend fsdp needs a GPU to offload from (on the CPU, parameters "
                        "and optimizer state are in host memory already)")
    if backend == "deepspeed" and stage == 0:
        raise UserError(f"parallel.offload={off} with deepspeed needs parallel.zero_stage >= 1 (ZeRO-Offload)")
    if backend == "deepspeed" and off == "params+optimizer" and stage != 3:
        raise UserError("parallel.offload=params+optimizer with deepspeed needs parallel.zero_stage=3 (DeepSpeed "
                        "offloads parameters at stage 3 only); parallel.offload=optimizer works at 1-3")


def check_mesh(mesh: str, backend: str, world: int) -> None:
    """parallel.mesh is honoured, not ignored: its axes must be ones the backend runs, over all ranks."""
    if not mesh:
        return
    sizes = parse_mesh(mesh)
    unsupported = [a for a, n in sizes.items() if n != 1 and a not in MESH_AXES[backend]]
    if unsupported:
        runs = "/".join(MESH_AXES[backend]) or "nothing but one process"
        raise UserError(f"parallel.mesh={mesh}: --backend {backend} does not implement {', '.join(unsupported)} "
                        f"(it runs {runs}; jaxpar.train runs every axis)")
    resolve_sizes(sizes, world)  # the product must be the world size


def build_model(cfg: Config):
    from torchpar.model import GPT

    model = GPT(cfg.model)
    model.init_weights(cfg.train.seed)
    return model


def write_init(cfg: Config, path: str) -> int:
    if launch_env()[0] == 0:
        save_weights(path, unflatten(to_shared(build_model(cfg).state_dict(), cfg.model.n_layer)), vars(cfg.model))
        print(f"wrote initial weights to {path}", file=sys.stderr)
    return 0


class TorchFramework:
    """What the shared loop (jaxpar/core/loop.py) needs from torch: the engine's step, data, DCP saves."""
    fault_prefix = "TORCHPAR"

    def __init__(self, cfg: Config, data, args, engine, env):
        self.cfg, self.engine, self.env, self.backend = cfg, engine, env, args.backend
        self.train_data, self.val_data = data  # read straight from the memmap, in the shared order
        self.profiler = None
        self.copy_stream = torch.cuda.Stream(env.device) if env.device.type == "cuda" else None
        self.prefetch = Prefetch(self._read_ahead)

    def _host_rows(self, data: GlobalBatches, step: int) -> torch.Tensor:
        """This rank's rows of the global batch at `step` (pipeline: every stage of a replica reads its share)."""
        share, ways, n = self.engine.data_rank, self.engine.data_ways, data.global_batch_size
        return torch.from_numpy(data.rows(step, share * n // ways, (share + 1) * n // ways)).long()

    def _rows(self, data: GlobalBatches, step: int) -> torch.Tensor:
        return self._host_rows(data, step).to(self.env.device)

    def _read_ahead(self, step: int):
        """On the prefetch thread: the rows, and on a GPU their copy from pinned memory on a side stream (the
        copy overlaps the running step; the event marks its end)."""
        rows = self._host_rows(self.train_data, step)
        if self.copy_stream is None:
            return rows, None
        with torch.cuda.stream(self.copy_stream):
            rows = rows.pin_memory().to(self.env.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        return rows, done

    def batch(self, step: int):
        rows, done = self.prefetch(step)
        if done is not None:  # the step's stream waits for the copy; the memory is not reused before it ends
            torch.cuda.current_stream().wait_event(done)
            rows.record_stream(torch.cuda.current_stream())
        return rows

    def train_step(self, batch):
        M = self.cfg.train.microbatches  # microbatch m = rows m, m+M, ... (as jaxpar)
        return self.engine.train_step([batch[m::M] for m in range(M)])

    @property
    def process_count(self) -> int:
        return self.env.world

    def roll_call(self, wait_s: float) -> list[int]:
        return dist.roll_call(self.env, wait_s)

    def agree_stop(self, requested: bool) -> bool:
        return dist.all_sum([float(requested)], self.env)[0] > 0  # one tiny all-reduce per step

    def sample(self, step: int) -> list[int] | None:
        """Rank 0 decodes with its whole copy of the model (none and ddp: check() refuses the others)."""
        if not self.env.is_main:
            return None
        from torchpar.decode import generate

        prompt_len, new = sample_lengths(self.cfg.model.max_seq_len)
        prompt = self._rows(self.val_data, 0)[:1, :prompt_len]
        model = self.engine.raw.eval()
        out = generate(model, prompt, new, seed=step, temperature=0.8, top_k=40)
        model.train()
        return prompt[0].tolist() + out[0].tolist()

    def fetch(self, handle) -> dict:
        loss, grad_norm, lr, *extra = handle  # extra: float16's loss_scale and skipped_steps
        loss_sum = dist.all_sum([float(loss)], self.env)[0]
        return {"loss": loss_sum / self.engine.data_ways, "grad_norm": float(grad_norm), "lr": float(lr),
                **(extra[0] if extra else {})}

    def evaluate(self, batches: int) -> float:
        engine = self.engine
        engine.module.eval()
        losses = [engine.eval_loss(self._rows(self.val_data, i)) for i in range(batches)]
        engine.module.train()
        return dist.all_sum([sum(losses) / len(losses)], self.env)[0] / engine.data_ways

    def save(self, step: int) -> None:
        extra = self.engine.extra_state() if hasattr(self.engine, "extra_state") else {}
        self.engine.checkpointer.save(step, {"step": step, "data_step": step, "backend": self.backend,
                                             "world_size": self.env.world, **extra})

    def settle(self) -> None:
        """DCP saves here are synchronous: nothing in flight."""

    def memory(self) -> dict:
        if self.env.device.type != "cuda":
            return {"memory_in_use_gib": None, "memory_gib": None}
        return {"memory_in_use_gib": torch.cuda.memory_allocated(self.env.device) / 2**30,
                "memory_gib": torch.cuda.max_memory_allocated(self.env.device) / 2**30}

    def profile_start(self) -> None:  # train.profile_steps=a:b -> <run.dir>/profile/trace_rank<r>.json
        self.profiler = torch.profiler.profile()
        self.profiler.start()

    def profile_stop(self) -> None:
        self.profiler.stop()
        os.makedirs(os.path.join(self.cfg.run.dir, "profile"), exist_ok=True)
        self.profiler.export_chrome_trace(os.path.join(self.cfg.run.dir, "profile", f"trace_rank{self.env.rank}.json"))
        self.profiler = None

    def poison(self) -> None:
        with torch.no_grad():
            for p in self.engine.module.parameters():
                p.mul_(float("nan"))

    def inject_overflow(self) -> None:
        self.engine.overflow_next = True  # none / ddp / fsdp (torchpar/backends/base.py)


def setup_torch(cfg: Config, backend: str):
    """Matmul precision and determinism, then the process group; the rank's Env."""
    torch.set_float32_matmul_precision(PRECISION[cfg.train.matmul_precision])
    if torch.cuda.is_available():
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS; before first use
    if cfg.run.debug:  # c10d's own consistency checks and logs (before the group exists)
        os.environ.setdefault("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    env = dist.init(backend != "none", cfg.run.peer_timeout_s)
    if env.device.type == "cuda":  # CPU kernels used here are deterministic already (and the call costs ~1 s)
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = False  # DeepSpeed allocates large empty buckets
    return env


def params_per_rank(engine, env) -> str:
    """', N per rank' (or 'A-B per rank' when ranks differ): the parameter elements each rank holds; '' where the
    engine does not say (deepspeed)."""
    local = getattr(engine, "local_params", None)
    if local is None:
        return ""
    counts = [int(c) for c in dist.all_sum([local if r == env.rank else 0 for r in range(env.world)], env)]
    span = f"{min(counts):,}" if min(counts) == max(counts) else f"{min(counts):,}-{max(counts):,}"
    return f", {span} per rank"


def train(cfg: Config, args) -> int:
    from torchpar import backends

    stop = stop_requests()
    env = setup_torch(cfg, args.backend)
    data = open_splits(cfg)
    model = build_model(cfg)
    if cfg.model.init_from:  # a resumed checkpoint below overwrites these
        flat = load_weights(cfg.model.init_from, shared_shapes(cfg.model))
        model.load_state_dict(from_shared(flat, cfg.model.n_layer))
    start_anew(cfg, env.is_main)  # after the inputs are read: a refused run moves nothing
    dist.barrier()  # no rank touches run.dir before rank 0 has moved an old run aside
    n_params = sum(p.numel() for p in model.parameters())
    compiled = use_compile(cfg, args.backend, env.device.type)
    if compiled:
        compile_blocks(model)
    engine = backends.build(args.backend, model, cfg, env, deepspeed_config=args.deepspeed_config)
    fw = TorchFramework(cfg, data, args, engine, env)
    os.makedirs(cfg.run.dir, exist_ok=True)
    engine.checkpointer.remove_partial_saves()  # what an earlier process left unfinished
    resumed = engine.checkpointer.restore() if cfg.checkpoint.resume else None
    step = engine.step = int(resumed["data_step"]) if resumed else 0
    if resumed and hasattr(engine, "load_extra_state"):
        engine.load_extra_state(resumed)
    held = params_per_rank(engine, env)  # a collective: every rank takes part
    if env.is_main:
        write_run_config(cfg, backend=args.backend, world_size=env.world)
        print(f"backend {args.backend} on {env.world} {env.device.type} processes; {n_params:,} params{held}; "
              f"torch.compile {'on' if compiled else 'off'}", flush=True)
    kind = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu"
    peak = peak_flops(kind, cfg.model.compute_dtype)
    if not already_complete(cfg, step, env.is_main):
        log = MetricsLog(cfg.run.dir, env.is_main, cfg.train.steps, step, open_trackers(cfg, env.is_main),
                         cfg.data.tokenizer)
        run_loop(cfg, step, fw, log, peak * env.world if peak else None, flops_per_token(cfg.model, cfg.data.seq_len),
                 stop)
        fw.prefetch.close()
        log.close()
    if args.write_final:
        full = engine.full_state_dict()  # a collective under fsdp / ZeRO: every rank takes part
        if env.is_main:
            save_weights(args.write_final, unflatten(to_shared(full, cfg.model.n_layer)), vars(cfg.model))
            print(f"wrote final weights to {args.write_final}", file=sys.stderr)
    ignore_stop_requests()  # before the process group's teardown, which can take a moment
    return 0


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    dist.adopt_slurm_env()
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    speaks = launch_env()[0] == 0  # who prints the error line
    try:
        cfg = load_config(args.config, args.overrides)
        check(cfg, args)
        check_resume(cfg)
        if args.write_init:
            return write_init(cfg, args.write_init)
        failure = None
        try:
            return train(cfg, args)
        except UserError as e:  # mid-run (a non-finite step, a failed save): a process group is up
            failure = error_line(e)
        except OSError as e:  # this rank's own file system: the others may not know, so every rank says it
            failure = f"rank {launch_env()[0]}: {error_line(e)}"
            speaks = True
        finally:
            dist.teardown()  # frees the groups now, the engine first (a gloo thread alive at exit can abort)
        raise UserError(failure)
    except (UserError, OSError) as e:
        if speaks:  # a line every rank has: printed once
            print(f"error: {error_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
