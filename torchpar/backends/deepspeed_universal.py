"""Resuming a DeepSpeed run on another number of ranks, through DeepSpeed's universal checkpoint.

A ZeRO checkpoint holds one optimizer partition per rank, and DeepSpeed loads it only on the world size that
wrote it. When the latest checkpoint was written by another number of ranks, rank 0 converts it once with
DeepSpeed's own converter (`deepspeed.checkpoint.ds_to_universal`: parameters and optimizer state per
parameter, unpartitioned) into <run.dir>/checkpoints/universal/<step>, every rank loads that with the engine's
`checkpoint.load_universal` option, and the folder is removed once loaded: the run saves ordinary checkpoints
at its new size from then on. Measured exact: ZeRO-1/2/3, 2 -> 1 and 2 -> 4 ranks (ZeRO-3 after
`repair_zero3_load`). A checkpoint resumes at another stage only within its layout (1 <-> 2); across layouts (0, 1-2,
3) one line names the conversion that moves the run.
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

import torch

from jaxpar.core.errors import UserError
from torchpar import dist


# DeepSpeed's checkpoint layouts: stage 0 one whole optimizer in the model-states file, stages 1 and 2 one model
# file and an optimizer partition per rank, stage 3 a model partition and an optimizer partition per rank. Its loader
# reads a checkpoint only at a stage of the same layout (any other: a missing file, or a crash inside DeepSpeed)
LAYOUTS = {0: "0", 1: "1-2", 2: "1-2", 3: "3"}


def saved_checkpoint(ckpt_dir: str) -> tuple[str, int, int] | None:
    """(tag, ZeRO stage, ranks) of the latest complete checkpoint, from its model-states file, else None."""
    try:
        with open(os.path.join(ckpt_dir, "latest")) as f:
            tag = f.read().strip()
    except OSError:
        return None
    files = sorted(glob.glob(os.path.join(ckpt_dir, tag, "*model_states.pt")))
    if not files:
        return None

    try:
        saved = torch.load(files[0], map_location="cpu", weights_only=False, mmap=True)
    except Exception as e:  # noqa: BLE001 - a damaged or foreign file: one line, nothing loaded
        raise UserError(
            f"deepspeed: {files[0]} could not be read ({type(e).__name__}: {e}); resume from an "
            "earlier checkpoint (write its step into checkpoints/latest) or start a new run.dir"
        ) from None
    stage = int((saved.get("ds_config") or {}).get("zero_optimization", {}).get("stage", 0))
    return tag, stage, int(saved.get("dp_world_size", 1))


def universal_source(cfg, env, stage_now: int) -> str | None:
    """The universal folder to resume from when the ranks changed (converted here on rank 0), else None.

    stage_now: the engine's ZeRO stage (parallel.zero_stage, or a user JSON's zero_optimization.stage over it).
    """
    ckpt_dir = os.path.abspath(os.path.join(cfg.run.dir, "checkpoints"))
    saved = saved_checkpoint(ckpt_dir) if cfg.checkpoint.resume else None
    if saved is None:
        return None
    tag, stage, ranks = saved
    refuse_other_layout(cfg, tag, stage, stage_now)
    if stage == 0 or ranks == env.world:  # stage 0's whole optimizer loads on any number of ranks
        return None
    out = os.path.join(ckpt_dir, "universal")
    failure = ""
    if env.is_main:
        print(
            f"deepspeed: the checkpoint of step {tag} was written by {ranks} rank{'s' * (ranks != 1)}; converting "
            f"it to DeepSpeed's universal format to resume on {env.world} ({out})",
            file=sys.stderr,
            flush=True,
        )
        failure = convert(os.path.join(ckpt_dir, tag), os.path.join(out, tag))
    if dist.any_rank(bool(failure), env):  # every rank stops, none waits at a barrier for the others
        raise UserError(failure or "deepspeed: rank 0 could not convert the checkpoint to the universal format")
    return out


def refuse_other_layout(cfg, tag: str, stage: int, want: int) -> None:
    """A checkpoint of another layout than the engine's stage `want`.

    One line, with the command that moves the run (through the shared training-state file, jaxpar/tools/convert.py)
    to that stage.
    """
    if LAYOUTS[stage] == LAYOUTS[want]:
        return
    raise UserError(
        f"deepspeed: the checkpoint of step {tag} was written at ZeRO stage {stage}, and DeepSpeed loads "
        f"it only at stage{'s' * (stage in (1, 2))} {LAYOUTS[stage].replace('-', ' or ')}, not {want}: "
        f"resume at parallel.zero_stage={stage}, or move the run to stage {want} with `python -m "
        f"jaxpar.tools.convert --from torchpar {cfg.run.dir} --to deepspeed --zero-stage {want} NEW_DIR` "
        f"and resume NEW_DIR/config.json"
    )


def convert(src: str, dst: str) -> str:
    """DeepSpeed's converter, its progress output kept off the console; '' or the reason it failed."""
    from deepspeed.checkpoint import ds_to_universal  # deferred: deepspeed, optional: --backend deepspeed only

    shutil.rmtree(os.path.dirname(dst), ignore_errors=True)  # a conversion cut short before
    args = argparse.Namespace(
        input_folder=src,
        output_folder=dst,
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
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
    """Give every parameter group's state its own Adam step counter after a ZeRO-3 universal load.

    This undoes a slip of deepspeed 0.19.8's ZeRO-3 universal loader (stage3.py,
    load_hp_checkpoint_state_from_checkpoint_dir_stage3): it gives one Adam step counter object to every group's
    state, which torch's AdamW then advances once per group each step (bias correction off from the first step
    on). (Its other slip, every group given the first group's settings, is undone with every load's settings:
    deepspeed.put_back_settings.)
    """
    inner = getattr(optimizer, "optimizer", optimizer)
    for state in inner.state.values():
        if hasattr(state.get("step"), "clone"):  # a tensor (a plain number is never shared)
            state["step"] = state["step"].clone()


def forget(folder: str, env) -> None:
    """After every rank loaded the universal copy: remove it (the run's own checkpoints are the record)."""
    dist.barrier()
    if env.is_main:
        shutil.rmtree(folder, ignore_errors=True)
