"""optax AdamW: global-norm clipping, weight decay by the shared rule, the shared warmup + cosine."""
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
    return optax.chain(optax.clip_by_global_norm(o.grad_clip), adamw) if o.grad_clip else adamw
