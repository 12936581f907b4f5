"""Convert a torchpar run's whole training state to or from the shared training-state file.

    python -m torchpar.tools.convert --from state FILE --to torchpar|deepspeed RUN
       (or --from torchpar RUN --to state FILE; --from torchpar RUN --to shared FILE: the parameters alone)

A torchpar run's whole training state <-> the shared training-state file (jaxpar/core/weights/state_file.py), which
jaxpar reads and writes too (python -m jaxpar.tools.convert): parameters, AdamW's moments and step count (and with
optim.name=muon Muon's momentum and count, torchpar/optim.py's MuonAdamW), the step (the data cursor) and the
config. Import writes RUN/config.json and a DCP checkpoint at that step from one process; `torchpar.train --config
RUN/config.json --backend ...` goes on from it on any DCP backend and number of ranks (DCP reshards). `--to deepspeed
RUN` writes a DeepSpeed checkpoint instead (one rank, the ZeRO stage of the state's config, or --zero-stage; AdamW's
state only): `torchpar.train --backend deepspeed` goes on from it on any number of ranks (through DeepSpeed's
universal checkpoint, torchpar/backends/deepspeed_universal.py). Export reads DeepSpeed runs too (any ZeRO stage and
number of ranks). float16 DeepSpeed runs are refused both ways: DeepSpeed's loss scaler counts its growth window
differently from the shared one (`loss_scale` in the state file).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from jaxpar.core.config.mesh_spec import parse_mesh
from jaxpar.core.errors import UserError, cli
from jaxpar.core.run.resume import read_run_config
from jaxpar.core.weights.names import save_weights, unflatten
from jaxpar.core.weights.state_file import (
    diloco_refusal,
    first_moments,
    refuse_other_optimizer,
    save_state,
    state_for_run,
    state_meta,
    write_moved_config,
    writing_run,
)
from torchpar import dist
from torchpar.backends import deepspeed, none
from torchpar.models.decoder import Decoder
from torchpar.weights import from_shared, to_shared


def _engine(cfg):
    return none.build(Decoder(cfg.model), cfg, dist.Env(0, 1, 0, torch.device("cpu")))


def import_state(src: str, run_dir: str) -> int:
    tensors, meta, cfg = state_for_run(src, run_dir)
    engine = _engine(cfg)
    n = cfg.model.n_layer
    engine.raw.load_state_dict(from_shared(tensors["param"], n))
    m, v = from_shared({**tensors["adam_m"], **tensors.get("muon_m", {})}, n), from_shared(tensors["adam_v"], n)
    for name, p in engine.raw.named_parameters():  # torch's AdamW and Muon states: the same moments and counts
        if not p.requires_grad:  # the experts' balance bias: no state in torch (_optimizer_state)
            continue
        if name in v:  # AdamW's
            state = {"step": meta["adam_step"], "exp_avg": m[name], "exp_avg_sq": v[name]}
        else:  # one of Muon's matrices (optim.name=muon)
            state = {"step": meta["muon_step"], "momentum_buffer": m[name]}
        engine.optimizer.state[p] = {**state, "step": torch.tensor(float(state["step"]))}
    if engine.scaler is not None and "loss_scale" in meta:  # float16: GradScaler's scale and growth count
        ls = meta["loss_scale"]
        engine.scaler.load_state_dict(
            {**engine.scaler.state_dict(), "scale": ls["scale"], "_growth_tracker": ls["good_steps"]}
        )
        engine.skipped = ls["skipped"]
    step = int(meta["step"])
    with writing_run(run_dir):
        write_moved_config(cfg, meta, src, backend="none")
        engine.save(step, {"step": step, "data_step": step, "backend": "none", "world_size": 1})
    return step


def import_deepspeed(src: str, run_dir: str, zero_stage: int | None) -> int:
    """A DeepSpeed checkpoint of one rank at the state's step.

    DeepSpeed makes Adam's state at the first step, so the weights go into the model before DeepSpeed copies them to
    its fp32 master, one step at lr 0 on zero gradients makes the state (and leaves the weights as they are: AdamW's
    update and its decay are both lr x ...), and DeepSpeed's whole-parameter setters then put the float32 weights
    (bf16 runs: the master was made from the bfloat16 cast) and the moments in their partitions.
    """
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state  # deferred: deepspeed, optional

    tensors, meta, cfg = state_for_run(src, run_dir)
    _refuse_float16(cfg, "import into")
    if cfg.optim.name != "adamw":
        raise UserError(
            f"{src} holds the state of optim.name={cfg.optim.name}, and DeepSpeed builds its own AdamW: "
            "convert it --to torchpar (a run for --backend none, ddp, fsdp or pipeline) or to jaxpar"
        )
    if zero_stage is not None:
        cfg.parallel.zero_stage = zero_stage
    model, n = Decoder(cfg.model), cfg.model.n_layer
    w = from_shared(tensors["param"], n)
    model.load_state_dict(w)
    env = dist.setup(cfg, "deepspeed")
    try:
        engine = deepspeed.build(model, cfg, env)
        _step_at_zero_lr(engine)
        step, ds = int(meta["step"]), engine.engine
        inner = getattr(ds.optimizer, "optimizer", ds.optimizer)
        m, v = from_shared(tensors["adam_m"], n), from_shared(tensors["adam_v"], n)
        for name, p in engine.raw.named_parameters():
            if _own_state(p):
                inner.state[p].update(exp_avg=m[name].clone(), exp_avg_sq=v[name].clone())
                continue
            safe_set_full_fp32_param(p, w[name])  # bf16: DeepSpeed made its master from the bfloat16 weights
            safe_set_full_optimizer_state(p, m[name], "exp_avg")
            safe_set_full_optimizer_state(p, v[name], "exp_avg_sq")
        for state in inner.state.values():
            state["step"] = torch.tensor(float(meta["adam_step"]))
        ds.lr_scheduler.last_epoch = step - 1
        ds.lr_scheduler.step()  # the lr of update `step` (0-based), as a run that did `step` updates has it
        ds.global_steps, ds.global_samples = step, step * cfg.train.global_batch_size
        with writing_run(run_dir):
            write_moved_config(cfg, meta, src, backend="deepspeed")
            engine.save(step, {"step": step, "data_step": step, "backend": "deepspeed", "world_size": 1})
        return step
    finally:
        dist.teardown()


def _step_at_zero_lr(engine) -> None:
    """One optimizer step (every accumulation micro-step) on zero gradients at lr 0.

    DeepSpeed's Adam state exists afterwards; the weights are unchanged (0 x update, and decay 1 - 0 x wd).
    """
    ds, cfg = engine.engine, engine.cfg
    for group in ds.optimizer.param_groups:
        group["lr"] = 0.0
    for _ in range(cfg.train.microbatches):  # one row is enough: the gradients are multiplied by zero
        ds.backward(ds(torch.zeros((1, cfg.data.seq_len), dtype=torch.long)).sum() * 0.0)
        ds.step()
    _link_adam_state(ds.optimizer)


def _link_adam_state(zero) -> None:
    """Link each parameter to its slice of Adam's state, which DeepSpeed's whole-parameter accessors need.

    ZeRO-1/2 of deepspeed 0.19.8 make that link only once, right after the first parameter group's first update: not
    at all after a same-size load_checkpoint, and not for the second (no-decay) group, which had no state yet then.
    """
    if hasattr(zero, "bit16_groups") and hasattr(zero, "single_partition_of_fp32_groups"):
        from deepspeed.utils import lazy_init_hp_params_optimizer_state  # deferred: deepspeed, optional

        for lp, hp in zip(zero.bit16_groups, zero.single_partition_of_fp32_groups):
            lazy_init_hp_params_optimizer_state(lp, hp, zero.optimizer.state)


def _refuse_float16(cfg, what: str) -> None:
    if cfg.model.compute_dtype == "float16":
        raise UserError(
            f"float16 runs are not converted to or from DeepSpeed (its loss scaler's growth window is "
            f"counted differently): cannot {what} {cfg.run.dir}"
        )


def _own_state(p) -> bool:
    """True where DeepSpeed keeps no master copy of p (ZeRO-0 float32).

    Its value and torch's AdamW state are the parameter's own, and DeepSpeed's whole-parameter accessors answer None
    (setters do nothing).
    """
    return getattr(p, "_hp_mapping", None) is None and not hasattr(p, "ds_id")


def _whole(p, inner, key: str | None) -> torch.Tensor:
    """p's whole float32 value (key None) or Adam state `key`."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # deferred: deepspeed, optional

    if _own_state(p):
        return (p if key is None else inner.state[p][key]).detach().float()
    return safe_get_full_fp32_param(p) if key is None else safe_get_full_optimizer_state(p, key)


def export_deepspeed(cfg, dst: str) -> int:
    """A DeepSpeed run's state, read on one process with DeepSpeed's own whole-parameter accessors.

    A run of more ranks is read through the universal checkpoint (torchpar/backends/deepspeed_universal.py).
    """
    _refuse_float16(cfg, "export")
    env = dist.setup(cfg, "deepspeed")
    try:
        engine = deepspeed.build(Decoder(cfg.model), cfg, env)
        meta = engine.load()
        if meta is None:
            raise UserError(f"no checkpoint in {cfg.run.dir}/checkpoints")
        _link_adam_state(engine.engine.optimizer)
        inner = getattr(engine.engine.optimizer, "optimizer", engine.engine.optimizer)
        params = dict(engine.raw.named_parameters())
        whole = {
            kind: {n: _whole(p, inner, key) for n, p in params.items()}
            for kind, key in (("param", None), ("adam_m", "exp_avg"), ("adam_v", "exp_avg_sq"))
        }
        adam_step = int(next(iter(inner.state.values()))["step"])
        save_state(
            dst,
            {k: to_shared(v, cfg.model.n_layer) for k, v in whole.items()},
            state_meta(cfg, meta["data_step"], adam_step, cfg.run.dir),
        )
        return int(meta["data_step"])
    finally:
        dist.teardown()


def export_weights(run_dir: str, dst: str) -> int:
    """A DCP run's parameters (a DiLoCo run's synchronised ones) -> a shared weights file; the checkpoint's step."""
    cfg = read_run_config(run_dir)
    cfg.run.dir = run_dir
    engine = _engine(cfg)
    meta = engine.checkpointer.restore(params_only=True)
    if meta is None:
        raise UserError(f"no checkpoint in {run_dir}/checkpoints")
    save_weights(dst, unflatten(to_shared(engine.raw.state_dict(), cfg.model.n_layer)), vars(cfg.model))
    return int(meta["data_step"])


def _optimizer_state(engine) -> dict:
    """Each parameter's optimizer state by name.

    A parameter no gradient moves (model.moe_bias_update's balance bias, requires_grad False) has none in torch; the
    state file holds jaxpar's for it, Adam's zero moments (its gradient is stopped there, so they stay zero).
    """
    return {
        name: engine.optimizer.state[p]
        if p.requires_grad
        else {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        for name, p in engine.raw.named_parameters()
    }


def export_state(run_dir: str, dst: str) -> int:
    cfg = read_run_config(run_dir)
    refuse_other_optimizer(cfg, run_dir)
    cfg.run.dir = run_dir
    if os.path.exists(os.path.join(run_dir, "checkpoints", "latest")):  # DeepSpeed's tag file
        return export_deepspeed(cfg, dst)
    if cfg.parallel.mesh and parse_mesh(cfg.parallel.mesh).get("diloco", 1) != 1:
        raise diloco_refusal(run_dir)
    engine = _engine(cfg)
    meta = engine.checkpointer.restore()
    if meta is None:
        raise UserError(f"no checkpoint in {run_dir}/checkpoints")
    n, state = cfg.model.n_layer, _optimizer_state(engine)
    adam = {name: s for name, s in state.items() if "exp_avg" in s}
    muon = {name: s for name, s in state.items() if "momentum_buffer" in s}  # Muon's matrices (optim.name=muon)
    first = to_shared({name: s["exp_avg"] if name in adam else s["momentum_buffer"] for name, s in state.items()}, n)
    scaler = meta.get("grad_scaler")  # float16
    loss_scale = (
        None
        if scaler is None
        else {"scale": scaler["scale"], "good_steps": scaler["_growth_tracker"], "skipped": meta["skipped_steps"]}
    )
    tensors = {
        "param": to_shared(engine.raw.state_dict(), n),
        **first_moments(first, cfg.optim.name),
        "adam_v": to_shared({name: s["exp_avg_sq"] for name, s in adam.items()}, n),
    }
    save_state(
        dst,
        tensors,
        state_meta(
            cfg,
            meta["data_step"],
            next(s["step"] for s in adam.values() if "step" in s),
            run_dir,
            loss_scale,
            next(iter(muon.values()))["step"] if muon else None,
        ),
    )
    return int(meta["data_step"])


@cli
def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m torchpar.tools.convert",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--from", dest="src_fmt", choices=("state", "torchpar"), required=True)
    p.add_argument("src")
    p.add_argument("--to", dest="dst_fmt", choices=("state", "torchpar", "deepspeed", "shared"), required=True)
    p.add_argument("dst")
    p.add_argument(
        "--zero-stage",
        type=int,
        choices=(0, 1, 2, 3),
        help="--to deepspeed: the new run's parallel.zero_stage (default: the state's config's)",
    )
    args = p.parse_intermixed_args(argv)
    if (args.src_fmt == "state") == (args.dst_fmt == "state") and args.dst_fmt != "shared":
        raise UserError(
            "convert between a torchpar run and a state file: --from state --to torchpar|deepspeed, or "
            "--from torchpar --to state"
        )
    if args.zero_stage is not None and args.dst_fmt != "deepspeed":
        raise UserError("--zero-stage is for --to deepspeed (a DeepSpeed run's stage is read from its checkpoint)")
    if args.dst_fmt == "shared":
        if args.src_fmt != "torchpar" or os.path.exists(os.path.join(args.src, "checkpoints", "latest")):
            raise UserError("--to shared reads a DCP run's parameters: --from torchpar RUN of --backend none/ddp/fsdp")
        step = export_weights(args.src, args.dst)
        print(f"converted the weights of step {step}: {args.src_fmt} {args.src} -> shared {args.dst}")
        return 0
    if args.src_fmt == "torchpar":
        step = export_state(args.src, args.dst)
    elif args.dst_fmt == "deepspeed":
        step = import_deepspeed(args.src, args.dst, args.zero_stage)
    else:
        step = import_state(args.src, args.dst)
    print(f"converted the training state of step {step}: {args.src_fmt} {args.src} -> {args.dst_fmt} {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
