"""python -m torchpar.tools.convert --from state FILE --to torchpar RUN   (or --from torchpar RUN --to state FILE)

A torchpar run's whole training state <-> the shared training-state file (jaxpar/core/train_state.py), which
jaxpar reads and writes too (python -m jaxpar.tools.convert): parameters, AdamW's moments and step count, the
step (the data cursor) and the config. Import writes RUN/config.json and a DCP checkpoint at that step from one
process; `torchpar.train --config RUN/config.json --backend ...` goes on from it on any DCP backend and number of
ranks (DCP reshards). Export also reads DeepSpeed runs (any ZeRO stage and number of ranks); writing a DeepSpeed
run from a state file is not built.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from jaxpar.core.errors import UserError, cli
from jaxpar.core.resume import read_run_config, write_run_config
from jaxpar.core.train_state import save_state, state_for_run, state_meta
from torchpar import dist
from torchpar.backends import none
from torchpar.models.decoder import Decoder
from torchpar.weights import from_shared, to_shared


def _engine(cfg):
    return none.build(Decoder(cfg.model), cfg, dist.Env(0, 1, 0, torch.device("cpu")))


def import_state(src: str, run_dir: str) -> int:
    tensors, meta, cfg = state_for_run(src, run_dir)
    engine = _engine(cfg)
    n = cfg.model.n_layer
    engine.raw.load_state_dict(from_shared(tensors["param"], n))
    m, v = from_shared(tensors["adam_m"], n), from_shared(tensors["adam_v"], n)
    for name, p in engine.raw.named_parameters():  # torch's AdamW state: the same moments, the same count
        engine.optimizer.state[p] = {"step": torch.tensor(float(meta["adam_step"])), "exp_avg": m[name],
                                     "exp_avg_sq": v[name]}
    os.makedirs(run_dir, exist_ok=True)
    write_run_config(cfg, backend="none", state_from=meta.get("source", os.path.abspath(src)))
    if engine.scaler is not None and "loss_scale" in meta:  # float16: GradScaler's scale and growth count
        ls = meta["loss_scale"]
        engine.scaler.load_state_dict({**engine.scaler.state_dict(), "scale": ls["scale"],
                                       "_growth_tracker": ls["good_steps"]})
        engine.skipped = ls["skipped"]
    step = int(meta["step"])
    engine.save(step, {"step": step, "data_step": step, "backend": "none", "world_size": 1})
    return step


def export_deepspeed(cfg, dst: str) -> int:
    """A DeepSpeed run's state, read on one process (a run of more ranks through the universal checkpoint:
    torchpar/backends/deepspeed_universal.py) with DeepSpeed's own whole-parameter accessors."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from torchpar.backends import deepspeed

    if cfg.model.compute_dtype == "float16":
        raise UserError(f"{cfg.run.dir} is a float16 DeepSpeed run: its loss scaler is not exported (not built)")
    env = dist.setup(cfg, "deepspeed")
    try:
        engine = deepspeed.build(Decoder(cfg.model), cfg, env)
        meta = engine.load()
        if meta is None:
            raise UserError(f"no checkpoint in {cfg.run.dir}/checkpoints")
        params = dict(engine.raw.named_parameters())
        whole = {"param": {n: safe_get_full_fp32_param(p) for n, p in params.items()},
                 **{kind: {n: safe_get_full_optimizer_state(p, key) for n, p in params.items()}
                    for kind, key in (("adam_m", "exp_avg"), ("adam_v", "exp_avg_sq"))}}
        states = getattr(engine.engine.optimizer, "optimizer", engine.engine.optimizer).state.values()
        adam_step = int(next(iter(states))["step"])
        save_state(dst, {k: to_shared(v, cfg.model.n_layer) for k, v in whole.items()},
                   state_meta(cfg, meta["data_step"], adam_step, cfg.run.dir))
        return int(meta["data_step"])
    finally:
        dist.teardown()


def export_state(run_dir: str, dst: str) -> int:
    cfg = read_run_config(run_dir)
    cfg.run.dir = run_dir
    if os.path.exists(os.path.join(run_dir, "checkpoints", "latest")):  # DeepSpeed's tag file
        return export_deepspeed(cfg, dst)
    engine = _engine(cfg)
    meta = engine.checkpointer.restore()
    if meta is None:
        raise UserError(f"no checkpoint in {run_dir}/checkpoints")
    params = dict(engine.raw.named_parameters())
    state = {name: engine.optimizer.state[p] for name, p in params.items()}
    moments = {k: to_shared({name: s[k] for name, s in state.items()}, cfg.model.n_layer)
               for k in ("exp_avg", "exp_avg_sq")}
    scaler = meta.get("grad_scaler")  # float16
    loss_scale = None if scaler is None else {"scale": scaler["scale"], "good_steps": scaler["_growth_tracker"],
                                              "skipped": meta["skipped_steps"]}
    save_state(dst, {"param": to_shared(engine.raw.state_dict(), cfg.model.n_layer), "adam_m": moments["exp_avg"],
                     "adam_v": moments["exp_avg_sq"]},
               state_meta(cfg, meta["data_step"], next(iter(state.values()))["step"], run_dir, loss_scale))
    return int(meta["data_step"])


@cli
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m torchpar.tools.convert", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="src_fmt", choices=("state", "torchpar"), required=True)
    p.add_argument("src")
    p.add_argument("--to", dest="dst_fmt", choices=("state", "torchpar"), required=True)
    p.add_argument("dst")
    args = p.parse_intermixed_args(argv)
    if args.src_fmt == args.dst_fmt:
        raise UserError("convert between a torchpar run and a state file: --from state --to torchpar, or the reverse")
    step = import_state(args.src, args.dst) if args.src_fmt == "state" else export_state(args.src, args.dst)
    print(f"converted the training state of step {step}: {args.src_fmt} {args.src} -> {args.dst_fmt} {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
