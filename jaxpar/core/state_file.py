"""The shared training state: what a run needs to go on in the other framework (or on any layout).

One safetensors file beside the weight format (jaxpar/core/weights.py), float32, shared names and shapes:
  param/<name>   the parameters                       adam_m/<name>  Adam's first moment
  adam_v/<name>  Adam's second moment (not its root)   (names as in the weights file: stacked over layers)
and metadata: `step` (updates done, = the data cursor: the batch of step s is a function of (data, seed, s)),
`adam_step` (Adam's bias-correction count: updates applied), `loss_scale` (float16 runs: {scale, good_steps:
clean steps since the scale last changed, skipped: updates skipped}), `config` (the run's
config as JSON) and `source` (the run it came from). optax's adamw and torch's AdamW keep the same moments and
the same count, so both read and write this file as it is.
"""
from __future__ import annotations

import contextlib
import json
import os

import numpy as np

from jaxpar.core.errors import UserError
from jaxpar.core.run_lock import RunLock

KINDS = ("param", "adam_m", "adam_v")


def state_meta(cfg, step: int, adam_step: int, source: str, loss_scale: dict | None = None) -> dict:
    """The metadata every exporter writes (module docstring); `loss_scale` for float16 runs only."""
    meta = {"step": int(step), "adam_step": int(adam_step), "config": cfg.to_dict(), "source": os.path.abspath(source)}
    return {**meta, "loss_scale": loss_scale} if loss_scale is not None else meta


def refuse_other_optimizer(cfg, run_dir: str) -> None:
    """One line for a run this file cannot hold the optimizer of: it carries AdamW's moments alone (Muon's momentum
    not yet; the weights move with --write-final / model.init_from)."""
    if cfg.optim.name != "adamw":
        raise UserError(f"{run_dir} trains with optim.name={cfg.optim.name}: the training-state file holds AdamW's "
                        "moments only; move its weights instead (a weights file and model.init_from)")


def refuse_mixing(run_dir: str) -> None:
    """One line if a run directory a conversion would write already holds checkpoints (two runs never mix)."""
    if os.path.exists(os.path.join(run_dir, "checkpoints")):
        raise UserError(f"{run_dir} already holds checkpoints; refusing to mix runs")


@contextlib.contextmanager
def writing_run(run_dir: str):
    """While a conversion writes a run directory: it is its one writer (jaxpar/core/run_lock.py; a trainer or
    another conversion there refuses it), and the directory holds no checkpoints (checked again under the lock)."""
    with RunLock(run_dir).acquire():
        refuse_mixing(run_dir)
        yield


def state_for_run(src: str, run_dir: str):
    """(tensors, metadata, config with run.dir = run_dir) of a state file a new run directory is written from
    (refuse_mixing first)."""
    from jaxpar.core.config import config_from_dict

    refuse_mixing(run_dir)
    tensors, meta = read_state(src)
    cfg = config_from_dict(meta["config"])
    cfg.run.dir = run_dir
    return tensors, meta, cfg


def write_moved_config(cfg, meta: dict, src: str, **extra) -> None:
    """The new run directory and its config.json, naming the run the state came from (`state_from`)."""
    from jaxpar.core.resume import write_run_config

    os.makedirs(cfg.run.dir, exist_ok=True)
    write_run_config(cfg, state_from=meta.get("source", os.path.abspath(src)), **extra)


def save_state(path: str, tensors: dict[str, dict[str, np.ndarray]], meta: dict) -> None:
    """tensors: kind -> {shared name: array}; written atomically (temp file + rename)."""
    from safetensors.numpy import save_file

    flat = {f"{kind}/{name}": np.ascontiguousarray(a, dtype=np.float32)
            for kind in KINDS for name, a in tensors[kind].items()}
    tmp = f"{path}.tmp{os.getpid()}"
    save_file(flat, tmp, metadata={k: json.dumps(v) for k, v in meta.items()})
    os.replace(tmp, path)


def read_state(path: str) -> tuple[dict[str, dict[str, np.ndarray]], dict]:
    """(kind -> {name: array}, metadata) of a training-state file; one line if it is not one."""
    from safetensors import safe_open

    if not os.path.isfile(path):
        raise UserError(f"training-state file not found: {path}")
    try:
        with safe_open(path, "np") as f:
            meta = {k: json.loads(v) for k, v in (f.metadata() or {}).items()}
            tensors = {kind: {} for kind in KINDS}
            for key in f.keys():
                kind, _, name = key.partition("/")
                tensors.setdefault(kind, {})[name] = f.get_tensor(key)
    except Exception as e:  # noqa: BLE001 - any unreadable file is bad input
        raise UserError(f"{path} is not a readable training-state file: {e}") from None
    missing = [k for k in ("step", "adam_step", "config") if k not in meta]
    if missing or set(tensors) != set(KINDS) or tensors["param"].keys() != tensors["adam_m"].keys():
        raise UserError(f"{path} is not a training-state file (jaxpar/core/state_file.py): "
                        f"{'metadata ' + ', '.join(missing) if missing else 'tensors'} missing")
    return tensors, meta
