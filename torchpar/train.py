"""torchrun --nproc_per_node=N -m torchpar.train --config C --backend ddp|fsdp|deepspeed|pipeline|none [k=v ...]

Also launched by `srun` (one task per process; ranks from SLURM_*) and by DeepSpeed's launcher.

The same model, configs and data order as jaxpar.train, on PyTorch, through the same run sequence
(jaxpar/core/run.py). Also: --mesh M (parallel.mesh=M, as jaxpar.train's --mesh), --deepspeed-config J (merged over
the generated DeepSpeed JSON), --write-init PATH (write the initial weights in the shared safetensors format and
exit), --write-final PATH (the final weights).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from jaxpar.core.config import Config, load_config
from jaxpar.core.data_order import open_splits
from jaxpar.core.errors import cli
from jaxpar.core.flops import params_phrase, peak_flops
from jaxpar.core.loop import stop_requests
from jaxpar.core.resume import check_resume
from jaxpar.core.run import run_training
from jaxpar.core.tokens import document_token
from jaxpar.core.weights import load_weights, save_weights, unflatten
from torchpar import backends, dist
from torchpar.checks import check
from torchpar.compiling import compile_blocks, use_compile
from torchpar.dist import launch_env
from torchpar.framework import TorchFramework
from torchpar.models.decoder import Decoder
from torchpar.weights import from_shared, shared_shapes, to_shared

def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m torchpar.train", description=__doc__)
    p.add_argument("--config", help="YAML config (configs/*.yaml); built-in defaults if omitted")
    p.add_argument("--backend", default="ddp", help=f"one of {', '.join(backends.BACKENDS)} (default ddp)")
    p.add_argument("--mesh", help="the same as parallel.mesh=MESH, over the overrides (as in jaxpar.train)")
    p.add_argument("--deepspeed-config", default="", help="DeepSpeed JSON merged over the generated one")
    p.add_argument("--cpu-offload", action="store_true", help="replaced by the config key parallel.offload")
    p.add_argument("--write-init", metavar="PATH",
                   help="write the initial weights (model.init_from's, else the seed's) as .safetensors and exit")
    p.add_argument("--write-final", metavar="PATH", help="after training, also write the final weights (.safetensors)")
    p.add_argument("--local_rank", "--local-rank", type=int, dest="local_rank",
                   help="set by DeepSpeed's launcher (LOCAL_RANK in the environment says the same)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    return p.parse_intermixed_args(argv)


def read_config(args) -> Config:
    """The config of the command line: --mesh is parallel.mesh's override, winning over any other (jaxpar.train's
    --mesh wins over parallel.mesh too)."""
    return load_config(args.config, args.overrides + ([f"parallel.mesh={args.mesh}"] if args.mesh else []))


def build_model(cfg: Config) -> Decoder:
    """The initial model: model.init_from's weights, else the seed's random initialisation."""
    model = Decoder(cfg.model, document_token(cfg))
    model.init_weights(cfg.train.seed)
    if cfg.model.init_from:
        model.load_state_dict(from_shared(load_weights(cfg.model.init_from, shared_shapes(cfg.model)),
                                          cfg.model.n_layer))
    return model


class TorchTrainer:
    """torchpar's side of the run sequence (jaxpar/core/run.py): a backend's engine over the plain Decoder."""

    def __init__(self, cfg: Config, backend: str, deepspeed_config: str, env, data):
        self.cfg, self.backend, self.deepspeed_config, self.env, self.data = cfg, backend, deepspeed_config, env, data
        self.is_main, self.engine = env.is_main, None
        self.model = build_model(cfg)  # before run.dir is touched: a weights file that fails moves nothing

    def any_of(self, flag: bool) -> bool:
        return dist.any_rank(flag, self.env)

    def restore_or_init(self) -> int:
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.compiled = use_compile(self.cfg, self.backend, self.env.device.type)
        if self.compiled:
            compile_blocks(self.model)
        self.engine = backends.build(self.backend, self.model, self.cfg, self.env,
                                     deepspeed_config=self.deepspeed_config)
        return (self.engine.restore() if self.cfg.checkpoint.resume else None) or 0

    def run_config(self) -> dict:
        return {"backend": self.backend, "world_size": self.env.world}

    def framework(self) -> TorchFramework:
        return TorchFramework(self.cfg, self.data, self.backend, self.engine, self.env)

    def describe(self) -> str:
        """Also the parameter elements each rank holds (a collective; a range where ranks differ)."""
        held, local = "", self.engine.local_params
        if local is not None:
            env = self.env
            counts = [int(c) for c in dist.all_sum([local if r == env.rank else 0 for r in range(env.world)], env)]
            held = f", {min(counts):,}" + (f"-{max(counts):,}" if min(counts) != max(counts) else "") + " per rank"
        return (f"backend {self.backend} on {self.env.world} {self.env.device.type} processes; "
                f"{params_phrase(self.cfg.model, self.n_params)}{held}; torch.compile {'on' if self.compiled else 'off'}")

    def peak_flops(self) -> float | None:
        device = self.env.device
        peak = peak_flops(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                          self.cfg.model.compute_dtype)
        return peak * self.env.world if peak else None

    def record_extra(self) -> dict:
        return {}

    def write_weights(self, path: str, which: str) -> None:
        full = self.engine.full_state_dict() if self.engine else self.model.state_dict()  # a collective if sharded
        if self.is_main:
            save_weights(path, unflatten(to_shared(full, self.cfg.model.n_layer)), vars(self.cfg.model))
            print(f"wrote {which} weights to {path}", file=sys.stderr)

    def close(self) -> None:
        """Nothing in flight (DCP and DeepSpeed save synchronously); the groups go in dist.teardown."""


@cli(rank=lambda: launch_env()[0], teardown=dist.teardown)  # teardown: groups freed now (a live gloo thread aborts)
def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    dist.adopt_slurm_env()
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    cfg = read_config(args)
    check(cfg, args)
    check_resume(cfg, is_main=launch_env()[0] == 0)  # before the group: torchrun's (or srun's adopted) rank
    if args.write_init:  # one process, no group: rank 0 writes
        if launch_env()[0] == 0:
            TorchTrainer(cfg, args.backend, "", dist.Env(0, 1, 0, torch.device("cpu")), None).write_weights(
                args.write_init, "initial")
        return 0
    stop = stop_requests()  # early: a signal during start-up also ends in an agreed stop at the first step
    env = dist.setup(cfg, args.backend)
    trainer = TorchTrainer(cfg, args.backend, args.deepspeed_config, env, open_splits(cfg))
    return run_training(cfg, trainer, stop, args.write_final)


if __name__ == "__main__":
    sys.exit(main())
