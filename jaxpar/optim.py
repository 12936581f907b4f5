"""optax AdamW: global-norm clipping, weight decay by the shared rule, the shared warmup + cosine.

Every hyperparameter is a closure over the config, none is in the optimizer state (counts and moments only), so a
resumed run takes its optim.* and train.steps from the config it runs with. The state has one structure whether
or not it clips (optim.grad_clip=0: an identity in the clipping slot; both slots hold optax's empty state), so a
resume may also turn clipping on or off.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxpar.core.config import Config
from jaxpar.core.lr_schedule import decays, lr_at


def lr_fn(cfg: Config):
    """step -> learning rate, traceable (the shared formula with jax.numpy)."""
    return lambda step: lr_at(jnp.asarray(step, jnp.float32), cfg.optim, cfg.train.steps, xp=jnp)


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    o = cfg.optim
    mask = lambda params: jax.tree_util.tree_map_with_path(  # noqa: E731
        lambda p, _: decays(".".join(k.key for k in p)), params)
    adamw = optax.adamw(lr_fn(cfg), b1=o.beta1, b2=o.beta2, eps=o.eps, weight_decay=o.weight_decay, mask=mask)
    return optax.chain(optax.clip_by_global_norm(o.grad_clip) if o.grad_clip else optax.identity(), adamw)


def with_clip_slot(fit):
    """Checkpointer.restore_latest's `fit`, extended to checkpoints written while optim.grad_clip=0 left the
    clipping slot out (AdamW's state alone): read as saved, then the empty slot put in front."""
    def extended(saved: dict):
        target, after = fit(saved)
        if len(saved["opt_state"]) == len(target["opt_state"]):
            return target, after

        def slotted(state: dict) -> dict:
            state = {**state, "opt_state": (optax.EmptyState(), state["opt_state"])}
            return after(state) if after is not None else state

        return {**target, "opt_state": target["opt_state"][1]}, slotted

    return extended
