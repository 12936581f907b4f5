"""What resuming a run may change: its saved config (<run.dir>/config.json) against the new one.

Keys that decide the parameters' shapes or the data a step reads must match, or the checkpoint would
load into the wrong model or continue on other batches: one line naming every such key, exit 2,
nothing touched (a run written by `jaxpar.tools.convert` has read no data yet: there only the model keys
must match, so fine-tuning picks its own data and batch). Everything else (mesh, steps, learning rate,
checkpoint cadence, ...) may change, is printed once (by the main process, on stdout, with the progress), and the
resumed run acts on it in every trainer and backend: what a checkpoint holds of a setting (an optimizer's
hyperparameters, a scheduler, a loss scaler's rules) never wins over the config (torchpar/optim.py, jaxpar/optim.py).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import sys

from jaxpar.core.config.schema import Config, config_from_dict, saved_value
from jaxpar.core.errors import UserError, check_output_dir
from jaxpar.core.optimizer.lr_schedule import lr_at
from jaxpar.core.run.directory import holds_run, step_dirs

# Free to change on resume inside the model section: numerics and memory, not shapes.
_MODEL_FREE = {"compute_dtype", "remat", "init_from"}
_FIXED = {
    "data.dataset",
    "data.tokenizer",
    "data.seq_len",
    "data.val_fraction",
    "train.seed",
    "train.global_batch_size",
    "train.batch_rampup",
    "data.batching",
    "data.buckets",
    "train.tokens_per_batch",
    "optim.name",
    "parallel.diloco_delay",
}  # optim.name: the optimizer state of one cannot be read as the other's; diloco_delay: the exchanges in flight


def _flat(d: dict) -> dict:
    return {f"{s}.{k}": v for s, keys in d.items() if isinstance(keys, dict) for k, v in keys.items()}


def must_match(key: str) -> bool:
    section, _, name = key.partition(".")
    return (section == "model" and name not in _MODEL_FREE) or key in _FIXED


def fingerprints(cfg: Config) -> dict:
    """What a path in the config does not say: the tokenizer file's content (written into config.json)."""
    if cfg.data.tokenizer == "byte" or not os.path.isfile(cfg.data.tokenizer):
        return {}
    with open(cfg.data.tokenizer, "rb") as f:
        return {"tokenizer_sha256": hashlib.sha256(f.read()).hexdigest()}


def write_run_config(cfg: Config, **extra) -> None:
    """<run.dir>/config.json: the config, its fingerprints and what the trainer adds (resolved mesh, backend)."""
    with open(os.path.join(cfg.run.dir, "config.json"), "w") as f:
        json.dump({**cfg.to_dict(), **fingerprints(cfg), **extra}, f, indent=2)


def read_run_config(run_dir: str) -> Config:
    """The config a run directory was trained with (its config.json; the trainers' own keys left out)."""
    path = os.path.join(run_dir, "config.json")
    if not os.path.isfile(path):
        raise UserError(f"not a run directory: {path} is missing")
    with open(path) as f:
        saved = json.load(f)
    return config_from_dict({k: v for k, v in saved.items() if isinstance(v, dict)})


def check_resume(cfg: Config, is_main: bool = True) -> None:
    """Compares the config with the one the run was started with, when run.dir holds a checkpoint to resume.

    First checks that run.dir is usable at all. Every process checks (each refuses alike); the main one says what
    changed.
    """
    check_output_dir(cfg.run.dir, "run.dir")
    run_dir, path = cfg.run.dir, os.path.join(cfg.run.dir, "config.json")
    ckpts = os.path.join(run_dir, "checkpoints")
    has_checkpoint = bool(step_dirs(ckpts))
    if not cfg.checkpoint.resume or not has_checkpoint or not os.path.isfile(path):
        return
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {path} to check the resumed run against it: {e}") from None
    saved = {k: saved_value(k, v) for k, v in _flat(record).items()}
    old_hash, new_hash = record.get("tokenizer_sha256"), fingerprints(cfg).get("tokenizer_sha256")
    if old_hash and new_hash and old_hash != new_hash:
        raise UserError(
            f"{run_dir} was trained with another tokenizer: {cfg.data.tokenizer} has changed since "
            "(its content hash differs); resume with that tokenizer, or use a new run.dir"
        )
    now = _flat(cfg.to_dict())
    # a key newer than the run's config.json: the run had its default (a default changed since would be misread)
    saved = {**_flat(Config().to_dict()), **saved}
    changed = {k: (saved[k], v) for k, v in now.items() if saved[k] != v}
    # a step-0 run written by `jaxpar.tools.convert` has read no data yet: only its model (and optimizer) must match
    fixed = [
        k for k in changed if must_match(k) and (k.startswith(("model.", "optim.")) or "converted_from" not in record)
    ]
    if "model.compute_dtype" in changed and "float16" in changed["model.compute_dtype"]:
        fixed.append("model.compute_dtype")  # float16 runs carry a loss scaler in their state; the others do not
    if fixed:
        detail = ", ".join(f"{k}: {changed[k][0]!r} -> {changed[k][1]!r}" for k in fixed)
        raise UserError(
            f"{run_dir} was started with another {'/'.join(fixed)} ({detail}); resume with the "
            f"run's values, or use a new run.dir (or checkpoint.resume=false: the old run is moved aside)"
        )
    if changed.get("model.init_from", ("", ""))[1]:  # a run starts from model.init_from at step 0 alone
        raise UserError(
            f"{run_dir} holds a checkpoint to resume: model.init_from={cfg.model.init_from} would not act "
            "on it (weights are read from it when a run starts); drop the key, or use a new run.dir"
        )
    if is_main:
        for k, (old, new) in changed.items():
            print(f"resuming with {k} changed: {old!r} -> {new!r}", flush=True)


# the keys lr_at reads: a change to any of them may move the learning rate of the steps still to train
SCHEDULE_KEYS = ("train.steps", "optim.lr", "optim.min_lr", "optim.warmup_steps", "optim.decay_steps")


def _key(cfg: Config, dotted: str):
    section, _, name = dotted.partition(".")
    return getattr(getattr(cfg, section), name)


def schedule_change_line(old: Config, new: Config, step: int) -> str | None:
    """What a resume after `step` updates does to the learning rate, where a schedule key changed.

    Its value at the next update (0-based `step`, the first the resumed run trains) under the old settings and under
    the new. None for a new run (step 0) or an unchanged schedule. (A float16 run's schedule counts applied updates:
    its skipped steps shift the figure by their number.)
    """
    changed = [k for k in SCHEDULE_KEYS if _key(old, k) != _key(new, k)]
    if not step or not changed:
        return None
    before, after = (lr_at(step, c.optim, c.train.steps) for c in (old, new))
    moves = f"stays {after:.1e}" if f"{before:.1e}" == f"{after:.1e}" else f"moves from {before:.1e} to {after:.1e}"
    return f"resuming after step {step}: the learning rate of step {step + 1} {moves} ({', '.join(changed)} changed)"


def schedule_change(cfg: Config, step: int) -> str | None:
    """schedule_change_line against the settings in <run.dir>/config.json.

    The file is read before write_run_config replaces it; None where it is missing or unreadable: check_resume has said
    so already where it matters.
    """
    try:
        with open(os.path.join(cfg.run.dir, "config.json")) as f:
            saved = _flat(json.load(f))
    except (OSError, ValueError):
        return None
    old, defaults = copy.deepcopy(cfg), _flat(Config().to_dict())
    for key in SCHEDULE_KEYS:  # a key newer than the file: the run had its default
        section, _, name = key.partition(".")
        setattr(getattr(old, section), name, saved.get(key, defaults[key]))
    return schedule_change_line(old, cfg, step)


def start_anew(cfg: Config, is_main: bool) -> None:
    """checkpoint.resume=false where run.dir holds a run (a config, metrics or checkpoints).

    That run is moved aside intact to <run.dir>.prev-<k>, so the new run never mixes with it (by the main process,
    before any process writes into run.dir).
    """
    run_dir = cfg.run.dir.rstrip("/")
    if cfg.checkpoint.resume or not holds_run(run_dir) or not is_main:
        return
    k = 1
    while os.path.exists(f"{run_dir}.prev-{k}"):
        k += 1
    try:
        os.rename(run_dir, f"{run_dir}.prev-{k}")
    except OSError as e:
        raise UserError(f"checkpoint.resume=false: cannot move the run in {run_dir} aside: {e.strerror}") from None
    print(
        f"checkpoint.resume=false: the run in {run_dir} was moved to {run_dir}.prev-{k} as it was; starting anew",
        file=sys.stderr,
        flush=True,
    )


def already_complete(cfg: Config, step: int, is_main: bool) -> bool:
    """A resumed run that has reached train.steps has nothing to train: say so, and how to go on."""
    if step < cfg.train.steps:
        return False
    if is_main:
        more = max(2 * step, step + 1)  # above the step reached, also at step 0
        print(
            f"{cfg.run.dir} is complete: its checkpoint is at step {step} and train.steps={cfg.train.steps}. To "
            f"train on, raise train.steps (e.g. train.steps={more}); to start anew, choose another run.dir",
            file=sys.stderr,
            flush=True,
        )
    return True
