"""A jaxpar run's whole training state <-> the shared training-state file (jaxpar/core/weights/state_file.py).

Export reads the run's latest checkpoint (parameters, optax's Adam moments and count -- with optim.name=muon, of the
parameters AdamW steps, and Muon's momentum and count of its matrices --, the step) onto one device;
import writes a run directory whose checkpoint at that step holds them, with the source's config: `jaxpar.train
--config RUN/config.json --mesh ...` then goes on from there, on any mesh (orbax reshards on restore).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxpar.checkpoint import Checkpointer
from jaxpar.core.errors import UserError
from jaxpar.core.run.resume import read_run_config
from jaxpar.core.weights.state_file import (
    diloco_refusal,
    refuse_other_optimizer,
    save_state,
    state_for_run,
    state_meta,
    write_moved_config,
    writing_run,
)
from jaxpar.core.weights.names import flatten, unflatten
from jaxpar.layout import Layout
from jaxpar.mesh import make_mesh
from jaxpar.optim import MuonState
from jaxpar.state import restore_latest, state_from_params


def single_device_layout(cfg):
    """The config's layout on one device: what conversions read a checkpoint onto and write one from."""
    return Layout(cfg, make_mesh({"dp": 1}, jax.devices()[:1]))


def _moment_states():
    """The optimizer states holding moments or counts: optax's Adam and schedule states, and Muon's."""
    return optax.ScaleByAdamState, optax.ScaleByScheduleState, MuonState


def _map_moments(opt_state, fn):
    """opt_state with fn(state) applied to each of _moment_states."""
    is_kind = lambda s: isinstance(s, _moment_states())
    return jax.tree.map(lambda s: fn(s) if is_kind(s) else s, opt_state, is_leaf=is_kind)


def _named(tree, flat: dict):
    """tree (params-shaped) with each array replaced by flat's of its name.

    A MaskedNode (optax.partition's place of a parameter the other optimizer steps) has no array and stays.
    """
    return jax.tree_util.tree_map_with_path(lambda path, _: jnp.asarray(flat[".".join(k.key for k in path)]), tree)


def _as_np(tree) -> dict:
    """flat {name: numpy} of a params-shaped tree, without its MaskedNodes."""
    return {k: np.asarray(v) for k, v in flatten(tree).items() if not isinstance(v, optax.MaskedNode)}


def export_state(run_dir: str, dst: str) -> int:
    cfg = read_run_config(run_dir)
    refuse_other_optimizer(cfg, run_dir)
    ckpt = Checkpointer(run_dir, cfg.checkpoint.keep)
    if "diloco" in (ckpt.newest_tree() or {}):
        raise diloco_refusal(run_dir)
    restored = restore_latest(ckpt, single_device_layout(cfg))
    if restored is None:
        raise UserError(f"no checkpoint in {run_dir}/checkpoints")
    state, meta = restored
    is_kind = lambda s: isinstance(s, _moment_states())
    found = {type(s): s for s in jax.tree.leaves(state["opt_state"], is_leaf=is_kind) if is_kind(s)}
    adam, muon = found[optax.ScaleByAdamState], found.get(MuonState)  # Muon's under optim.name=muon only
    ls = state.get("loss_scale")  # float16: the scaler goes on where it was
    loss_scale = (
        None
        if ls is None
        else {"scale": float(ls["scale"]), "good_steps": int(ls["good_steps"]), "skipped": int(ls["skipped"])}
    )
    tensors = {"param": _as_np(state["params"]), "adam_m": _as_np(adam.mu), "adam_v": _as_np(adam.nu)}
    if muon is not None:
        tensors["muon_m"] = _as_np(muon.mu)
    save_state(
        dst,
        tensors,
        state_meta(cfg, meta["data_step"], adam.count, run_dir, loss_scale, None if muon is None else muon.count),
    )
    return int(meta["data_step"])


def import_state(src: str, run_dir: str) -> int:
    tensors, meta, cfg = state_for_run(src, run_dir)
    state = state_from_params(single_device_layout(cfg), unflatten(tensors["param"]))
    state["opt_state"] = _map_moments(state["opt_state"], lambda s: _moments_of(s, tensors, meta))
    state["step"] = jnp.asarray(meta["step"], jnp.int32)
    if "loss_scale" in state:
        ls = meta.get("loss_scale") or {"scale": cfg.optim.loss_scale_init, "good_steps": 0, "skipped": 0}
        state["loss_scale"] = {
            "scale": jnp.asarray(ls["scale"], jnp.float32),
            **{k: jnp.asarray(ls[k], jnp.int32) for k in ("good_steps", "skipped")},
        }
    with writing_run(run_dir):
        write_moved_config(cfg, meta, src)
        ckpt = Checkpointer(run_dir, cfg.checkpoint.keep)
        ckpt.save(int(meta["step"]), state, {"step": int(meta["step"]), "data_step": int(meta["step"]), "mesh": "dp=1"})
        ckpt.close()
    return int(meta["step"])


def _moments_of(s, tensors: dict, meta: dict):
    """One of _moment_states as the state file has it.

    Muon's momentum and count, Adam's moments and count (the schedule's count is Adam's: it sets AdamW's learning
    rate).
    """
    if isinstance(s, MuonState):
        return s._replace(count=jnp.asarray(meta["muon_step"], jnp.int32), mu=_named(s.mu, tensors["muon_m"]))
    count = jnp.asarray(meta["adam_step"], jnp.int32)
    if isinstance(s, optax.ScaleByAdamState):
        return s._replace(count=count, mu=_named(s.mu, tensors["adam_m"]), nu=_named(s.nu, tensors["adam_v"]))
    return s._replace(count=count)
