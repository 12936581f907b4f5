"""A jaxpar run's whole training state <-> the shared training-state file (jaxpar/core/state_file.py).

Export reads the run's latest checkpoint (parameters, optax's Adam moments and count, the step) onto one device;
import writes a run directory whose checkpoint at that step holds them, with the source's config: `jaxpar.train
--config RUN/config.json --mesh ...` then goes on from there, on any mesh (orbax reshards on restore).
"""
from __future__ import annotations

import numpy as np

from jaxpar.core.errors import UserError
from jaxpar.core.state_file import (refuse_other_optimizer, save_state, state_for_run, state_meta, write_moved_config,
                                    writing_run)
from jaxpar.core.weights import flatten, unflatten


def single_device_layout(cfg):
    """The config's layout on one device: what conversions read a checkpoint onto and write one from."""
    import jax

    from jaxpar.layout import Layout
    from jaxpar.mesh import make_mesh

    return Layout(cfg, make_mesh({"dp": 1}, jax.devices()[:1]))


def _map_adam(opt_state, fn):
    """opt_state with fn(state) applied to optax's Adam and schedule states (the ones holding moments/counts)."""
    import jax
    import optax

    kinds = (optax.ScaleByAdamState, optax.ScaleByScheduleState)
    is_kind = lambda s: isinstance(s, kinds)  # noqa: E731
    return jax.tree.map(lambda s: fn(s) if is_kind(s) else s, opt_state, is_leaf=is_kind)


def export_state(run_dir: str, dst: str) -> int:
    import jax
    import optax

    from jaxpar.checkpoint import Checkpointer
    from jaxpar.core.resume import read_run_config
    from jaxpar.state import restore_latest

    cfg = read_run_config(run_dir)
    refuse_other_optimizer(cfg, run_dir)
    restored = restore_latest(Checkpointer(run_dir, cfg.checkpoint.keep), single_device_layout(cfg))
    if restored is None:
        raise UserError(f"no checkpoint in {run_dir}/checkpoints")
    state, meta = restored
    is_adam = lambda s: isinstance(s, optax.ScaleByAdamState)  # noqa: E731
    adam = next(filter(is_adam, jax.tree.leaves(state["opt_state"], is_leaf=is_adam)))
    as_np = lambda tree: {k: np.asarray(v) for k, v in flatten(tree).items()}  # noqa: E731
    ls = state.get("loss_scale")  # float16: the scaler goes on where it was
    loss_scale = None if ls is None else {"scale": float(ls["scale"]), "good_steps": int(ls["good_steps"]),
                                          "skipped": int(ls["skipped"])}
    save_state(dst, {"param": as_np(state["params"]), "adam_m": as_np(adam.mu), "adam_v": as_np(adam.nu)},
               state_meta(cfg, meta["data_step"], adam.count, run_dir, loss_scale))
    return int(meta["data_step"])


def import_state(src: str, run_dir: str) -> int:
    import jax
    import jax.numpy as jnp

    from jaxpar.checkpoint import Checkpointer
    from jaxpar.state import state_from_params

    tensors, meta, cfg = state_for_run(src, run_dir)
    state = state_from_params(single_device_layout(cfg), unflatten(tensors["param"]))
    count = jnp.asarray(meta["adam_step"], jnp.int32)
    mu, nu = (jax.tree.map(jnp.asarray, unflatten(tensors[k])) for k in ("adam_m", "adam_v"))
    state["opt_state"] = _map_adam(state["opt_state"], lambda s: s._replace(count=count, mu=mu, nu=nu)
                                   if hasattr(s, "mu") else s._replace(count=count))
    state["step"] = jnp.asarray(meta["step"], jnp.int32)
    if "loss_scale" in state:
        ls = meta.get("loss_scale") or {"scale": cfg.optim.loss_scale_init, "good_steps": 0, "skipped": 0}
        state["loss_scale"] = {"scale": jnp.asarray(ls["scale"], jnp.float32),
                               **{k: jnp.asarray(ls[k], jnp.int32) for k in ("good_steps", "skipped")}}
    with writing_run(run_dir):
        write_moved_config(cfg, meta, src)
        ckpt = Checkpointer(run_dir, cfg.checkpoint.keep)
        ckpt.save(int(meta["step"]), state, {"step": int(meta["step"]), "data_step": int(meta["step"]), "mesh": "dp=1"})
        ckpt.close()
    return int(meta["step"])
