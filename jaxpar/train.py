"""Train a model from a YAML config on a device mesh.

python -m jaxpar.train --config configs/gpt2-tiny.yaml --mesh dp=2,tp=4 [section.key=value ...]
"""

from __future__ import annotations

if __name__ == "__main__":  # before jax is imported: glibc reads its malloc tunables at process start
    from jaxpar.core.run.malloc import relaunch_with_huge_pages

    relaunch_with_huge_pages("jaxpar.train")

import argparse
import sys

import jax

from jaxpar.checks import validate
from jaxpar.core.config.schema import Config, load_config
from jaxpar.core.data.order import open_splits
from jaxpar.core.errors import cli
from jaxpar.core.config.mesh_spec import parse_mesh
from jaxpar.core.run.loop import run_training
from jaxpar.core.run.directory import with_run_dir
from jaxpar.core.run.signals import stop_requests
from jaxpar.data import grain_batches
from jaxpar.layout import Layout
from jaxpar.pipeline.auto import resolve_schedule
from jaxpar.cost.peak_bytes import peak_bytes
from jaxpar.mesh import make_mesh, process_id, setup_devices, show_library_logs
from jaxpar.trainer import JaxTrainer


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m jaxpar.train", description=__doc__)
    p.add_argument("--config", help="YAML config (configs/*.yaml); built-in defaults if omitted")
    p.add_argument("--mesh", help="mesh axes, e.g. dp=2,fsdp=2,tp=2 (overrides parallel.mesh)")
    p.add_argument(
        "--write-init",
        metavar="PATH",
        help="write the initial weights (model.init_from's, else the seed's) to PATH and exit",
    )
    p.add_argument(
        "--write-final",
        metavar="PATH",
        help="after training, also write the final weights (shared safetensors format) to PATH",
    )
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    return p.parse_intermixed_args(argv)


def train(cfg: Config, mesh_spec: str, write_init: str | None = None, write_final: str | None = None) -> int:
    sizes = parse_mesh(mesh_spec)
    if cfg.run.debug:
        show_library_logs()
    setup_devices(sizes, cfg.run.peer_timeout_s)
    stop = stop_requests()  # after jax.distributed, whose preemption notifier would take SIGTERM otherwise
    if cfg.train.matmul_precision != "default":
        jax.config.update("jax_default_matmul_precision", cfg.train.matmul_precision)
    mesh = make_mesh(sizes)
    cfg, chosen = resolve_schedule(cfg, dict(mesh.shape), mesh.devices.flat, peak_bytes)  # pipeline_schedule=auto
    if chosen and process_id() == 0:
        print(chosen, file=sys.stderr)
    validate(cfg, dict(mesh.shape), is_main=process_id() == 0)
    trainer = JaxTrainer(cfg, Layout(cfg, mesh), open_splits(cfg, grain_batches))
    if write_init:
        trainer.state = trainer.initial_state()
        trainer.write_weights(write_init, "initial")
        return 0
    return run_training(cfg, trainer, stop, write_final)


@cli
def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    cfg = with_run_dir(load_config(args.config, args.overrides), "jaxpar", args.config)
    return train(cfg, args.mesh or cfg.parallel.mesh, args.write_init, args.write_final)


if __name__ == "__main__":
    sys.exit(main())
