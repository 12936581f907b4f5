"""python -m jaxpar.train --config configs/gpt2-tiny.yaml --mesh dp=2,tp=4 [section.key=value ...]"""
from __future__ import annotations

if __name__ == "__main__":  # before jax is imported: glibc reads its malloc tunables at process start
    from jaxpar.core.malloc import relaunch_with_huge_pages
    relaunch_with_huge_pages("jaxpar.train")

import argparse
import sys
import time

import jax
from jax.experimental import multihost_utils

from jaxpar import state as st
from jaxpar.checkpoint import Checkpointer
from jaxpar.core.config import Config, load_config
from jaxpar.core.contract import Run, check_contract
from jaxpar.core.data_order import open_splits
from jaxpar.core.errors import cli
from jaxpar.core.flops import params_phrase, peak_flops
from jaxpar.core.loop import stop_requests
from jaxpar.core.mesh_spec import format_mesh, parse_mesh
from jaxpar.core.pipeline_schedules import configured_bubble, resolve_microbatches
from jaxpar.core.resume import check_resume
from jaxpar.core.run import run_training
from jaxpar.core.trackers import check_trackers
from jaxpar.core.weights import flatten, load_weights, save_weights, unflatten
from jaxpar.data import grain_batches
from jaxpar.framework import JaxFramework, any_process
from jaxpar.layout import Layout
from jaxpar.mesh import make_mesh, process_id, setup_devices, show_library_logs


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m jaxpar.train", description=__doc__)
    p.add_argument("--config", help="YAML config (configs/*.yaml); built-in defaults if omitted")
    p.add_argument("--mesh", help="mesh axes, e.g. dp=2,fsdp=2,tp=2 (overrides parallel.mesh)")
    p.add_argument("--write-init", metavar="PATH",
                   help="write the initial weights (model.init_from's, else the seed's) to PATH and exit")
    p.add_argument("--write-final", metavar="PATH",
                   help="after training, also write the final weights (shared safetensors format) to PATH")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    return p.parse_intermixed_args(argv)


class JaxTrainer:
    """jaxpar's side of the run sequence (jaxpar/core/run.py) on a Layout of (config, mesh)."""

    def __init__(self, cfg: Config, layout: Layout, data):
        self.cfg, self.layout, self.data = cfg, layout, data
        self.is_main, self.state, self.fw, self.ckpt = jax.process_index() == 0, None, None, None

    def any_of(self, flag: bool) -> bool:
        return any_process(flag)

    def initial_state(self):
        """model.init_from, else the seed's random initialisation."""
        if not self.cfg.model.init_from:
            return st.init_state(self.layout)
        shapes = {k: v.shape for k, v in flatten(st.abstract_state(self.layout)["params"]).items()}
        return st.state_from_params(self.layout, unflatten(load_weights(self.cfg.model.init_from, shapes)))

    def restore_or_init(self) -> int:
        self.ckpt = Checkpointer(self.cfg.run.dir, self.cfg.checkpoint.keep, trainer=True)
        restored = st.restore_latest(self.ckpt, self.layout) if self.cfg.checkpoint.resume else None
        if restored:
            print(f"resumed from {self.ckpt.dir}/{restored[1]['step']}", file=sys.stderr)
        self.state = restored[0] if restored else self.initial_state()
        return int(self.state["step"])

    def run_config(self) -> dict:
        return {"resolved_mesh": format_mesh(dict(self.layout.mesh.shape))}

    def framework(self) -> JaxFramework:
        t0 = time.perf_counter()
        self.fw = JaxFramework(self.cfg, self.data, self.layout, self.state, self.ckpt)
        self.compile_s = time.perf_counter() - t0
        return self.fw

    def describe(self) -> str:
        n = sum(x.size for x in jax.tree.leaves(self.state["params"]))
        line = (f"mesh {format_mesh(dict(self.layout.mesh.shape))} on {jax.device_count()} "
                f"{jax.devices()[0].platform} devices; {params_phrase(self.cfg.model, n)}; compiled in {self.compile_s:.1f}s")
        bubble, p = self.record_extra()["pipeline_bubble"], self.cfg.parallel
        if bubble is not None:
            line += (f"\npipeline {p.pipeline_schedule}: {self.layout.mesh.shape['pp']} stages x "
                     f"{p.pipeline_virtual_stages} virtual, "
                     f"{resolve_microbatches(self.layout.mesh.shape['pp'], p.pipeline_microbatches)} microbatches, "
                     f"bubble {bubble:.3f}")
        return line

    def peak_flops(self) -> float | None:
        peak = peak_flops(jax.devices()[0].device_kind, self.cfg.model.compute_dtype)
        return peak * jax.device_count() if peak else None

    def record_extra(self) -> dict:
        """The pipeline schedule table's idle fraction (None without pp)."""
        p = self.cfg.parallel
        return {"pipeline_bubble": configured_bubble(p.pipeline_schedule, self.layout.mesh.shape["pp"],
                                                     p.pipeline_microbatches, p.pipeline_virtual_stages)}

    def write_weights(self, path: str, which: str) -> None:
        """Gather the parameters (every process takes part) and write the shared file from process 0."""
        params = multihost_utils.process_allgather((self.fw or self).state["params"], tiled=True)
        if self.is_main:
            save_weights(path, params, vars(self.cfg.model))
            print(f"wrote {which} weights to {path}", file=sys.stderr)

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()  # the save in flight completes, also when training stopped on an error


def train(cfg: Config, mesh_spec: str, write_init: str | None = None, write_final: str | None = None) -> int:
    sizes = parse_mesh(mesh_spec)
    check_resume(cfg, is_main=process_id() == 0)  # before the processes join: what their launcher says
    check_trackers(cfg)
    if cfg.run.debug:
        show_library_logs()
    setup_devices(sizes, cfg.run.peer_timeout_s)
    stop = stop_requests()  # after jax.distributed, whose preemption notifier would take SIGTERM otherwise
    if cfg.train.matmul_precision != "default":
        jax.config.update("jax_default_matmul_precision", cfg.train.matmul_precision)
    mesh = make_mesh(sizes)
    check_contract(Run(cfg, "jaxpar", mesh=dict(mesh.shape)))
    trainer = JaxTrainer(cfg, Layout(cfg, mesh), open_splits(cfg, grain_batches))
    if write_init:
        trainer.state = trainer.initial_state()
        trainer.write_weights(write_init, "initial")
        return 0
    return run_training(cfg, trainer, stop, write_final)


@cli
def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    cfg = load_config(args.config, args.overrides)
    return train(cfg, args.mesh or cfg.parallel.mesh, args.write_init, args.write_final)


if __name__ == "__main__":
    sys.exit(main())
