"""torchrun --nproc_per_node=N -m torchpar.train --config C --backend ddp|fsdp|deepspeed|pipeline|none [k=v ...].

Also launched by `srun` (one task per process; ranks from SLURM_*) and by DeepSpeed's launcher.

The same model, configs and data order as jaxpar.train, on PyTorch, through the same run sequence
(jaxpar/core/run/loop.py). Also: --mesh M (parallel.mesh=M, as jaxpar.train's --mesh), --deepspeed-config J (merged over
the generated DeepSpeed JSON), --write-init PATH (write the initial weights in the shared safetensors format and
exit), --write-final PATH (the final weights).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from jaxpar.core.config.schema import Config, load_config
from jaxpar.core.data.order import open_splits
from jaxpar.core.errors import cli
from jaxpar.core.run.loop import run_training
from jaxpar.core.run.directory import with_run_dir
from jaxpar.core.run.signals import stop_requests
from torchpar import backends, dist
from torchpar.checks import resolve_schedule, validate
from torchpar.dist import launch_env
from jaxpar.core.optimizer.torchft_mode import launch_groups
from torchpar.trainer import TorchTrainer


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m torchpar.train", description=__doc__)
    p.add_argument("--config", help="YAML config (configs/*.yaml); built-in defaults if omitted")
    p.add_argument("--backend", default="ddp", help=f"one of {', '.join(backends.BACKENDS)} (default ddp)")
    p.add_argument("--mesh", help="the same as parallel.mesh=MESH, over the overrides (as in jaxpar.train)")
    p.add_argument("--deepspeed-config", default="", help="DeepSpeed JSON merged over the generated one")
    p.add_argument("--cpu-offload", action="store_true", help="replaced by the config key parallel.offload")
    p.add_argument(
        "--write-init",
        metavar="PATH",
        help="write the initial weights (model.init_from's, else the seed's) as .safetensors and exit",
    )
    p.add_argument("--write-final", metavar="PATH", help="after training, also write the final weights (.safetensors)")
    p.add_argument(
        "--local_rank",
        "--local-rank",
        type=int,
        dest="local_rank",
        help="set by DeepSpeed's launcher (LOCAL_RANK in the environment says the same)",
    )
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    return p.parse_intermixed_args(argv)


def read_config(args) -> Config:
    """The config of the command line.

    --mesh is parallel.mesh's override, winning over any other (jaxpar.train's --mesh wins over parallel.mesh too).
    """
    cfg = load_config(args.config, args.overrides + ([f"parallel.mesh={args.mesh}"] if args.mesh else []))
    return with_run_dir(cfg, "torchpar", args.config)


@cli(rank=lambda: launch_env()[0], teardown=dist.teardown)  # teardown: groups freed now (a live gloo thread aborts)
def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    dist.adopt_slurm_env()
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    cfg, chosen = resolve_schedule(read_config(args), args)  # parallel.pipeline_schedule=auto
    if chosen and launch_env()[0] == 0:
        print(chosen, file=sys.stderr)
    validate(cfg, args)  # before the group: identical on every rank
    if args.write_init:  # one process, no group: rank 0 writes
        if launch_env()[0] == 0:
            TorchTrainer(cfg, args.backend, "", dist.Env(0, 1, 0, torch.device("cpu")), None).write_weights(
                args.write_init, "initial"
            )
        return 0
    stop = stop_requests()  # early: a signal during start-up also ends in an agreed stop at the first step
    ours, torchft = launch_groups(cfg)  # torchft's mode: this launch's own mesh, one of the groups (config.json: cfg)
    env = dist.setup(ours, args.backend)
    trainer = TorchTrainer(ours, args.backend, args.deepspeed_config, env, open_splits(ours), torchft)
    return run_training(cfg, trainer, stop, args.write_final)


if __name__ == "__main__":
    sys.exit(main())
