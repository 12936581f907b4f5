"""The shared training state: what a run needs to go on in the other framework (or on any layout).

One safetensors file beside the weight format (jaxpar/core/weights/names.py), float32, shared names and shapes (names
as in the weights file: stacked over layers):
  param/<name>   the parameters                       adam_m/<name>  Adam's first moment
  adam_v/<name>  Adam's second moment (not its root)  muon_m/<name>  Muon's momentum (optim.name=muon)
Under optim.name=muon, muon_m holds Muon's matrices (jaxpar/core/optimizer/muon.py) and adam_m, adam_v the other
parameters.
Metadata: `optimizer` (the optim.name whose state it holds: adamw, or muon; a file without it is AdamW's), `step`
(updates done, = the data cursor: the batch of step s is a function of (data, seed, s)), `adam_step` (Adam's
bias-correction count: updates applied), `muon_step` (Muon's count, muon only), `loss_scale` (float16 runs: {scale,
good_steps: clean steps since the scale last changed, skipped: updates skipped}), `config` (the run's config as
JSON) and `source` (the run it came from). optax's adamw and torch's AdamW keep the same moments and the same
count, and jaxpar's and torchpar's Muon the same momentum (a matrix's, in the parameter's layout) and count, so both
read and write this file as it is.
"""

from __future__ import annotations

import contextlib
import json
import os

import numpy as np
from safetensors import safe_open

from jaxpar.core.config.schema import config_from_dict
from jaxpar.core.optimizer import muon
from jaxpar.core.errors import UserError
from jaxpar.core.run.lock import RunLock
from jaxpar.core.run.resume import write_run_config
from jaxpar.core.weights.names import write_safetensors

# optim.name -> the tensor kinds of its state
KINDS = {"adamw": ("param", "adam_m", "adam_v"), "muon": ("param", "adam_m", "adam_v", "muon_m")}
# optimizers whose state the file does not hold, and why (another name not in KINDS gets a generic reason)
NOT_HELD = {
    "adamw8bit": "its moments are quantized in blocks of each framework's own layout (jaxpar's stacked "
    "tensors, torch's one per layer), not the file's float32 shared tensors; converting them "
    "means dequantizing and quantizing again in the other layout, not written yet"
}


def state_meta(
    cfg, step: int, adam_step: int, source: str, loss_scale: dict | None = None, muon_step: int | None = None
) -> dict:
    """The metadata every exporter writes (module docstring).

    `loss_scale` for float16 runs only, `muon_step` for optim.name=muon only.
    """
    meta = {
        "optimizer": cfg.optim.name,
        "step": int(step),
        "adam_step": int(adam_step),
        "config": cfg.to_dict(),
        "source": os.path.abspath(source),
    }
    return {
        **meta,
        **({"loss_scale": loss_scale} if loss_scale is not None else {}),
        **({"muon_step": int(muon_step)} if muon_step is not None else {}),
    }


def diloco_refusal(run_dir: str) -> UserError:
    """The one line for a DiLoCo run's training state, which the file does not hold."""
    return UserError(
        f"{run_dir} is a DiLoCo run: a training-state file has no place for its groups' parameters and optimizer "
        "states yet; convert its weights (--to shared or hf), which are the groups' synchronised parameters"
    )


def refuse_other_optimizer(cfg, run_dir: str) -> None:
    """One line for a run whose optimizer's state the file does not hold (any optim.name but those of KINDS)."""
    if cfg.optim.name not in KINDS:
        raise UserError(_not_held(f"{run_dir} trains with", cfg.optim.name))


def _not_held(subject: str, name: str) -> str:
    why = NOT_HELD.get(name, f"the training-state file holds the state of optim.name={' or '.join(KINDS)} only")
    return f"{subject} optim.name={name}: {why}; move its weights instead (a weights file and model.init_from)"


def first_moments(first: dict, optimizer: str) -> dict:
    """Every parameter's first moment, split into the file's kinds.

    `first`: shared name -> array (Adam's m, or Muon's momentum of its matrices). Under optim.name=muon its matrices' go
    in muon_m, the rest's in adam_m.
    """
    matrices = _expected("muon_m", first, optimizer)
    return {
        "adam_m": {n: a for n, a in first.items() if n not in matrices},
        **({"muon_m": {n: first[n] for n in matrices}} if optimizer == "muon" else {}),
    }


def _expected(kind: str, params, optimizer: str) -> set[str]:
    """The names a kind holds, of the parameters' names `params`.

    Muon's matrices its own (muon_m), the others AdamW's.
    """
    matrices = {n for n in params if optimizer == "muon" and muon.per_layer_axes(n)}
    return set(params) if kind == "param" else matrices if kind == "muon_m" else set(params) - matrices


def refuse_mixing(run_dir: str) -> None:
    """One line if a run directory a conversion would write already holds checkpoints (two runs never mix)."""
    if os.path.exists(os.path.join(run_dir, "checkpoints")):
        raise UserError(f"{run_dir} already holds checkpoints; refusing to mix runs")


@contextlib.contextmanager
def writing_run(run_dir: str):
    """While a conversion writes a run directory.

    It is its one writer (jaxpar/core/run/lock.py; a trainer or another conversion there refuses it), and the
    directory holds no checkpoints (checked again under the lock).
    """
    with RunLock(run_dir).acquire():
        refuse_mixing(run_dir)
        yield


def state_for_run(src: str, run_dir: str):
    """Reads a state file that a new run directory is written from.

    Returns (tensors, metadata, config with run.dir = run_dir); refuse_mixing runs first.
    """
    refuse_mixing(run_dir)
    tensors, meta = read_state(src)
    cfg = config_from_dict(meta["config"])
    if meta["optimizer"] != cfg.optim.name:  # an edited config: the run would step another optimizer's state
        raise UserError(
            f"{src} holds the state of optim.name={meta['optimizer']}, but its config trains "
            f"optim.name={cfg.optim.name}: a run goes on with the optimizer it trained with (start a new "
            "run from its weights, model.init_from, to change it)"
        )
    cfg.run.dir = run_dir
    return tensors, meta, cfg


def write_moved_config(cfg, meta: dict, src: str, **extra) -> None:
    """The new run directory and its config.json, naming the run the state came from (`state_from`)."""
    os.makedirs(cfg.run.dir, exist_ok=True)
    write_run_config(cfg, state_from=meta.get("source", os.path.abspath(src)), **extra)


def save_state(path: str, tensors: dict[str, dict[str, np.ndarray]], meta: dict) -> None:
    """tensors: kind -> {shared name: array}, the kinds of meta's optimizer; written atomically (temp file + rename)."""
    assert set(tensors) == set(KINDS[meta.get("optimizer", "adamw")]), (sorted(tensors), meta.get("optimizer"))
    flat = {
        f"{kind}/{name}": np.ascontiguousarray(a, dtype=np.float32)
        for kind, named in tensors.items()
        for name, a in named.items()
    }
    write_safetensors(path, flat, {k: json.dumps(v) for k, v in meta.items()})


def read_state(path: str) -> tuple[dict[str, dict[str, np.ndarray]], dict]:
    """(kind -> {name: array}, metadata) of a training-state file; one line if it is not one."""
    if not os.path.isfile(path):
        raise UserError(f"training-state file not found: {path}")
    try:
        with safe_open(path, "np") as f:
            meta = {k: json.loads(v) for k, v in (f.metadata() or {}).items()}
            tensors = {}
            for key in f.keys():
                kind, _, name = key.partition("/")
                tensors.setdefault(kind, {})[name] = f.get_tensor(key)
    except Exception as e:  # noqa: BLE001 - any unreadable file is bad input
        raise UserError(f"{path} is not a readable training-state file: {e}") from None
    return _checked(path, tensors, meta)


def _checked(path: str, tensors: dict, meta: dict) -> tuple[dict, dict]:
    """read_state's answer, checked: the file's tensors by kind and its metadata.

    Each kind must name the parameters it should (a kind with no tensors is not in the file); one line if not.
    """
    optimizer = meta.setdefault("optimizer", "adamw")  # files written before Muon's held AdamW's state
    if optimizer not in KINDS:
        raise UserError(_not_held(f"{path} holds the state of", optimizer))
    tensors = {kind: {} for kind in KINDS[optimizer]} | tensors
    missing = [
        k for k in ("step", "adam_step", "config", *(("muon_step",) if optimizer == "muon" else ())) if k not in meta
    ]
    if missing:
        raise UserError(
            f"{path} is not a training-state file (jaxpar/core/weights/state_file.py): metadata "
            f"{', '.join(missing)} missing"
        )
    wrong = [
        k
        for k, named in tensors.items()
        if k not in KINDS[optimizer] or named.keys() != _expected(k, tensors["param"], optimizer)
    ]
    if wrong:
        raise UserError(
            f"{path} is not a training-state file of optim.name={optimizer} "
            "(jaxpar/core/weights/state_file.py): "
            f"its tensors under {', '.join(k + '/' for k in wrong)} are not those of its parameters"
        )
    return tensors, meta
