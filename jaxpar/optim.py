"""optax AdamW: global-norm clipping, weight decay masked off biases and norms, warmup + cosine."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxpar.config import Config
from jaxpar.schedule import lr_at


def decays(path: tuple[str, ...]) -> bool:
    """Weight decay for matrices and embeddings; none for biases and LayerNorm parameters."""
    return path[-1] not in ("bias", "scale")


def schedule_fn(cfg: Config):
    return lambda step: lr_at(jnp.asarray(step, jnp.float32), cfg.optim, cfg.train.steps, xp=jnp)


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    o = cfg.optim
    mask = lambda params: jax.tree_util.tree_map_with_path(  # noqa: E731
        lambda p, _: decays(tuple(k.key for k in p)), params)
    adamw = optax.adamw(schedule_fn(cfg), b1=o.beta1, b2=o.beta2, eps=o.eps, weight_decay=o.weight_decay, mask=mask)
    return optax.chain(optax.clip_by_global_norm(o.grad_clip), adamw) if o.grad_clip else adamw
