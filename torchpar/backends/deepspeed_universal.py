"""Resuming a DeepSpeed run on another number of ranks, through DeepSpeed's universal checkpoint.

A ZeRO checkpoint holds one optimizer partition per rank, and DeepSpeed loads it only on the world size that
wrote it. When the latest checkpoint was written by another number of ranks, rank 0 converts it once with
DeepSpeed's own converter (`deepspeed.checkpoint.ds_to_universal`: parameters and optimizer state per
parameter, unpartitioned) into <run.dir>/checkpoints/universal/<step>, every rank loads that with the engine's
`checkpoint.load_universal` option, and the folder is removed once loaded: the run saves ordinary checkpoints
at its new size from then on. Measured exact: ZeRO-1/2/3, 2 -> 1 and 2 -> 4 ranks (ZeRO-3 after
`repair_zero3_load`).
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import io
import logging
import os
import shutil
import sys

from jaxpar.core.errors import UserError
from torchpar import dist


def saved_ranks(ckpt_dir: str) -> tuple[str, int] | None:
    """(tag, ranks) of the latest complete checkpoint where ZeRO partitioned its optimizer (stages 1-3: one
    optimizer file per rank), else None (no checkpoint, or stage 0, which loads on any world size)."""
    try:
        with open(os.path.join(ckpt_dir, "latest")) as f:
            tag = f.read().strip()
    except OSError:
        return None
    ranks = len(glob.glob(os.path.join(ckpt_dir, tag, "*zero_pp_rank_*_optim_states.pt")))
    return (tag, ranks) if ranks else None


def universal_source(cfg, env) -> str | None:
    """The universal folder to resume from when the ranks changed (converted here on rank 0), else None."""
    ckpt_dir = os.path.abspath(os.path.join(cfg.run.dir, "checkpoints"))
    saved = saved_ranks(ckpt_dir) if cfg.checkpoint.resume else None
    if saved is None and cfg.checkpoint.resume:
        refuse_unpartitioned(ckpt_dir, cfg.parallel.zero_stage, env.world)
    if saved is None or saved[1] == env.world:
        return None
    tag, ranks = saved
    out = os.path.join(ckpt_dir, "universal")
    failure = ""
    if env.is_main:
        print(f"deepspeed: the checkpoint of step {tag} was written by {ranks} ranks; converting it to DeepSpeed's "
              f"universal format to resume on {env.world} ({out})", file=sys.stderr, flush=True)
        failure = convert(os.path.join(ckpt_dir, tag), os.path.join(out, tag))
    if dist.any_rank(bool(failure), env):  # every rank stops, none waits at a barrier for the others
        raise UserError(failure or "deepspeed: rank 0 could not convert the checkpoint to the universal format")
    return out


def refuse_unpartitioned(ckpt_dir: str, stage: int, world: int) -> None:
    """A stage-0 checkpoint holds one whole optimizer (no partitions for ds_to_universal to merge), and DeepSpeed's
    ZeRO loader takes it only on the number of ranks that wrote it: at stages 1-3 on another number, one line."""
    try:
        with open(os.path.join(ckpt_dir, "latest")) as f:
            tag = f.read().strip()
    except OSError:
        return
    path = os.path.join(ckpt_dir, tag, "mp_rank_00_model_states.pt")
    if stage == 0 or not os.path.exists(path):
        return
    import torch

    written = torch.load(path, map_location="cpu", weights_only=False).get("dp_world_size", world)
    if written != world:
        raise UserError(f"deepspeed: the checkpoint of step {tag} was written at ZeRO stage 0 by {written} ranks, and "
                        f"DeepSpeed loads it at stage {stage} only on {written}: resume on {written} ranks, or at "
                        f"parallel.zero_stage=0 on {world} (whose next checkpoint loads at any stage there)")


def convert(src: str, dst: str) -> str:
    """DeepSpeed's converter, its progress output kept off the console; '' or the reason it failed."""
    from deepspeed.checkpoint import ds_to_universal

    shutil.rmtree(os.path.dirname(dst), ignore_errors=True)  # a conversion cut short before
    args = argparse.Namespace(input_folder=src, output_folder=dst, num_extract_workers=1, num_merge_workers=1,
                              keep_temp_folder=False, strict=True, inject_missing_state=True)
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            ds_to_universal.main(args)
    except Exception as e:  # noqa: BLE001 - any failure of the converter is reported in one line
        shutil.rmtree(os.path.dirname(dst), ignore_errors=True)
        return f"deepspeed: converting {src} to the universal format failed: {type(e).__name__}: {e}"
    return ""


@contextlib.contextmanager
def quiet_universal_load(universal: bool):
    """DeepSpeed warns once per rank that no model-parallel unit was given (none exists here): not for the console."""
    logger = logging.getLogger("DeepSpeed")
    level = logger.level
    if universal:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def repair_zero3_load(optimizer) -> None:
    """Undo a slip of deepspeed 0.19.8's ZeRO-3 universal loader (stage3.py,
    load_hp_checkpoint_state_from_checkpoint_dir_stage3): it gives one Adam step counter object to every group's
    state, which torch's AdamW then advances once per group each step (bias correction off from the first step
    on). (Its other slip, every group given the first group's settings, is undone with every load's settings:
    deepspeed.put_back_settings.)"""
    inner = getattr(optimizer, "optimizer", optimizer)
    for state in inner.state.values():
        if hasattr(state.get("step"), "clone"):  # a tensor (a plain number is never shared)
            state["step"] = state["step"].clone()


def forget(folder: str, env) -> None:
    """After every rank loaded the universal copy: remove it (the run's own checkpoints are the record)."""
    dist.barrier()
    if env.is_main:
        shutil.rmtree(folder, ignore_errors=True)
