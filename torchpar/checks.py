"""What torchpar refuses before a process group exists: one clear line, identical on every rank.

`validate` is the one entry that runs them all (jaxpar/checks.py's `validate` is its twin).
"""

from __future__ import annotations

import sys

import torch

from jaxpar.core.config.schema import Config
from jaxpar.core.config.contract import Run, check_contract
from jaxpar.core.errors import UserError
from jaxpar.core.data.batch_shapes import for_each_shape
from jaxpar.core.model.experts import check_expert_axis
from jaxpar.core.optimizer.outer import check_diloco
from jaxpar.core.optimizer.torchft_mode import check_torchft
from jaxpar.core.config.mesh_spec import check_torch_mesh, parse_mesh, resolve_sizes
from jaxpar.core.pipeline.choice import resolve
from jaxpar.core.run.resume import check_resume
from jaxpar.core.run.directory import check_run_dir_framework
from jaxpar.core.evaluation.tasks import check_eval_tasks
from jaxpar.core.run.trackers import check_trackers
from torchpar.diloco import layer_fragments
from torchpar.dist import launch_env, launched


def validate(cfg: Config, args) -> None:
    """Everything torchpar refuses before a process group exists, identical on every rank, in this order.

    What the backend and launch run (the config contract last), a launch without a launcher (check_launch), then
    run.dir and what a resume may change (rank 0, from torchrun's or srun's adopted variables, says what changed). A
    line about the launch comes after them all: a refused run says one line.
    """
    check_backend_settings(cfg, args)
    note = check_launch(args)  # after the config's refusals: they stand however the run is launched
    check_run_dir_framework(cfg, "torchpar")
    check_resume(cfg, is_main=launch_env()[0] == 0)
    if note:
        print(note, file=sys.stderr, flush=True)


def check_launch(args) -> str | None:
    """A multi-process backend started as a plain process (no launcher's variables).

    None where a launcher started it or the backend is none; the line saying that it runs as one process, where one
    process still means the backend (ddp and fsdp compute the one-process run, DeepSpeed's ZeRO stages and offload
    run on one GPU, a DeepSpeed checkpoint resumes on one rank); a refusal for the pipeline, whose stages are its
    processes (one process is a pipeline of one stage: --backend none's run). --write-init writes from one process
    anyway.
    """
    if args.backend == "none" or launched() or getattr(args, "write_init", None):
        return None
    how = f"torchrun --nproc_per_node=N -m torchpar.train --backend {args.backend} ... (or srun, one task each)"
    if args.backend == "pipeline":
        raise UserError(
            f"--backend pipeline without a launcher is one process, a pipeline of one stage: start one "
            f"process per stage with {how}, or run one process with --backend none"
        )
    return f"torchpar: --backend {args.backend} without a launcher runs as one process; to run N, start {how}"


def resolve_schedule(cfg: Config, args):
    """(cfg, the start-up line).

    parallel.pipeline_schedule=auto on --backend pipeline is the shared choice (jaxpar/core/pipeline/choice.py)
    among the schedules torchpar runs for this config and launch (its refusals below). torchpar's FLOPs figure is
    1.00 for each: torch's schedules run every F, B (and W) once on real microbatches, GPipe computes nothing in its
    idle ticks; so the least bubble wins, 1f1b before gpipe at a tie.
    """
    if args.backend != "pipeline":
        return cfg, None
    from torchpar.backends.pipeline import pipeline_sizes  # deferred: pipelining, FSDP (~1 s): pipeline backend

    return resolve(
        cfg, pipeline_sizes(cfg, launch_env()[1])[0], lambda c: check_backend_settings(c, args), lambda c: 1.0
    )


def check_backend_settings(cfg: Config, args) -> None:
    """What --backend runs with this config and launch: the processes, the mesh, the settings it refuses."""
    _, world, _ = launch_env()
    if cfg.parallel.torchft_lighthouse:  # torchft's mode: this launch is one of the groups (torchpar/torchft_groups.py)
        world *= check_torchft(cfg, args.backend)
        if not launched():
            raise UserError(
                "parallel.torchft_lighthouse: each group is a torchrun launch (its store is torchrun's), e.g. "
                "torchrun --nproc_per_node=N -m torchpar.train ... parallel.torchft_group=G"
            )
    if args.backend == "none" and world > 1:
        raise UserError(f"--backend none runs one process, but WORLD_SIZE={world}; use ddp, fsdp or deepspeed")
    check_torch_mesh(cfg.parallel.mesh, args.backend, world)
    check_expert_parallel(cfg, args.backend, world)
    groups = check_groups(cfg, world)
    check_trackers(cfg)
    check_eval_tasks(cfg)
    if cfg.train.sample_every and args.backend not in ("none", "ddp"):
        raise UserError(
            "train.sample_every needs the whole model on rank 0: --backend none or ddp, "
            f"not {args.backend} (sample from a checkpoint with python -m torchpar.generate)"
        )
    if args.backend == "ddp" and cfg.parallel.zero_stage:
        raise UserError(
            f"parallel.zero_stage={cfg.parallel.zero_stage} needs --backend deepspeed or fsdp (ddp is ZeRO-0)"
        )
    if args.cpu_offload:
        raise UserError("--cpu-offload was replaced by the config key parallel.offload=optimizer|params+optimizer")
    check_offload(cfg, args.backend)
    if cfg.parallel.grad_compression == "powersgd" and args.backend in ("fsdp", "deepspeed"):
        why = {
            "fsdp": "FSDP2 reduce-scatters flat shards, which PowerSGD cannot factor",
            "deepspeed": "deepspeed 0.19 has no 1-bit or 0/1 Adam any more, and ZeRO++'s quantized gradients "
            "need its CUDA kernels",
        }[args.backend]
        raise UserError(
            f"parallel.grad_compression=powersgd runs on --backend ddp (torch's DDP communication hook), "
            f"not {args.backend}: {why}; parallel.grad_compression=bf16 runs there"
        )
    if cfg.parallel.grad_compression == "powersgd" and cfg.model.compute_dtype == "float16":
        raise UserError(
            "parallel.grad_compression=powersgd with model.compute_dtype=float16: an overflowing step's "
            "inf would stay in PowerSGD's error feedback and poison every later step; use bfloat16"
        )
    if cfg.model.compute_dtype == "float16" and args.backend == "pipeline":
        raise UserError(
            "model.compute_dtype=float16 (loss scaling) runs on --backend none, ddp, fsdp or deepspeed, not pipeline"
        )
    if cfg.train.compile == "on" and args.backend == "deepspeed":
        raise UserError(
            "train.compile=on is not supported with --backend deepspeed (its engine wraps the model "
            "and its ZeRO hooks); leave train.compile=auto"
        )
    if args.deepspeed_config and args.backend != "deepspeed":
        raise UserError("--deepspeed-config needs --backend deepspeed")
    stages = {}
    if args.backend == "pipeline":
        from torchpar.backends.pipeline import check_torch_pipeline, pipeline_sizes  # deferred: pipelining, FSDP (~1 s)

        check_torch_pipeline(cfg, world)
        stages = {"pp": pipeline_sizes(cfg, world)[0]}
    else:
        for_each_shape(cfg, lambda at: check_batch(at, world))
    if args.backend == "deepspeed":
        from torchpar.backends import deepspeed  # deferred: DCP, DTensor (~1 s): --backend deepspeed only

        deepspeed.check_deepspeed(cfg, args.deepspeed_config)
    check_contract(Run(cfg, "torchpar", args.backend, {**stages, "diloco": groups}))


def check_groups(cfg: Config, world: int) -> int:
    """DiLoCo's groups (parallel.mesh's diloco, ddp and fsdp: check_torch_mesh): their number, or one line.

    What they do not run with, as in jaxpar (jaxpar/core/optimizer/outer.py), and expert parallelism, whose exchange
    spans every rank.
    """
    sizes = resolve_sizes(parse_mesh(cfg.parallel.mesh), world) if cfg.parallel.mesh else {}
    groups = sizes.get("diloco", 1)
    if groups == 1:
        return 1
    check_diloco(cfg, sizes)
    if sizes.get("ep", 1) > 1:
        raise UserError(
            f"diloco={groups} with ep={sizes['ep']} in parallel.mesh is not built in torchpar (its expert exchange "
            "spans every rank); jaxpar.train runs experts inside DiLoCo's groups"
        )
    layer_fragments(cfg)
    return groups


def check_expert_parallel(cfg: Config, backend: str, world: int) -> None:
    """parallel.mesh's ep (ddp alone runs it; check_torch_mesh refuses it elsewhere).

    What its exchange and the experts' replicas (torchpar/backends/experts.py) do not run beside.
    """
    if backend != "ddp" or not cfg.parallel.mesh:
        return
    ep = resolve_sizes(parse_mesh(cfg.parallel.mesh), world)["ep"]
    check_expert_axis(cfg.model, ep)
    if ep == 1:
        return
    refused = {
        "parallel.grad_compression": cfg.parallel.grad_compression != "none",
        "model.compute_dtype=float16": cfg.model.compute_dtype == "float16",
        "train.compile=on": cfg.train.compile == "on",
        "train.sample_every": bool(cfg.train.sample_every),
    }
    for setting, on in refused.items():
        if on:
            raise UserError(
                f"{setting} with expert parallelism (ep={ep}) is not built in torchpar (its experts "
                "live on several ranks); jaxpar.train runs it, or drop ep from parallel.mesh"
            )


def check_offload(cfg: Config, backend: str) -> None:
    """parallel.offload: what each backend can keep in host memory, or one line saying why not."""
    off, stage = cfg.parallel.offload, cfg.parallel.zero_stage
    if off == "none":
        return
    if backend not in ("fsdp", "deepspeed"):
        raise UserError(
            f"parallel.offload={off} needs --backend fsdp or deepspeed ({backend} keeps its state on the device)"
        )
    if backend == "fsdp" and off == "optimizer":
        raise UserError(
            "FSDP2 offloads parameters, gradients and the optimizer step together: use "
            "parallel.offload=params+optimizer"
        )
    if backend == "fsdp" and not torch.cuda.is_available():
        raise UserError(
            "parallel.offload with --backend fsdp needs a GPU to offload from (on the CPU, parameters "
            "and optimizer state are in host memory already)"
        )
    if backend == "deepspeed" and stage == 0:
        raise UserError(f"parallel.offload={off} with deepspeed needs parallel.zero_stage >= 1 (ZeRO-Offload)")
    if backend == "deepspeed" and off == "params+optimizer" and stage != 3:
        raise UserError(
            "parallel.offload=params+optimizer with deepspeed needs parallel.zero_stage=3 (DeepSpeed "
            "offloads parameters at stage 3 only); parallel.offload=optimizer works at 1-3"
        )


def check_batch(cfg: Config, world: int) -> None:
    micro = cfg.train.global_batch_size // cfg.train.microbatches
    if micro % world:
        raise UserError(
            f"batch per microbatch {micro} (train.global_batch_size={cfg.train.global_batch_size} / "
            f"train.microbatches={cfg.train.microbatches}) is not divisible by the world size {world}"
        )
