"""Dynamic loss scaling for float16 compute (model.compute_dtype=float16), with torch.amp.GradScaler's rule.

jaxpar and torchpar follow the same rule, so they skip the same steps and hold the same scale.

The loss is multiplied by `scale` before the backward pass (small float16 cotangents stay representable),
gradients are divided by it again in float32. A step whose gradients are not all finite is skipped: its
parameters and optimizer state stay as they were (so the optimizer's step count and the learning-rate
schedule count applied updates only, as DeepSpeed and Megatron do) and the scale is multiplied by the
backoff factor, not below the minimum. After `growth_interval` finite steps in a row it is multiplied by
the growth factor. The scaler's state lives in the train state (`state["loss_scale"]`), so a resumed run
continues with the scale it had.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxpar.core.config.schema import Config


def enabled(cfg: Config) -> bool:
    return cfg.model.compute_dtype == "float16"


def initial(cfg: Config) -> dict:
    return {
        "scale": jnp.asarray(cfg.optim.loss_scale_init, jnp.float32),
        "good_steps": jnp.zeros((), jnp.int32),
        "skipped": jnp.zeros((), jnp.int32),
    }


def all_finite(grads) -> jax.Array:
    return jnp.isfinite(optax.global_norm(grads))


def update(ls: dict, finite: jax.Array, cfg: Config) -> dict:
    o = cfg.optim
    grow = finite & (ls["good_steps"] + 1 >= o.loss_scale_growth_interval)
    scale = jnp.where(
        finite,
        jnp.where(grow, ls["scale"] * o.loss_scale_growth_factor, ls["scale"]),
        jnp.maximum(ls["scale"] * o.loss_scale_backoff_factor, o.loss_scale_min),
    )
    return {
        "scale": scale,
        "good_steps": jnp.where(finite & ~grow, ls["good_steps"] + 1, 0),
        "skipped": ls["skipped"] + (~finite).astype(jnp.int32),
    }


def keep_if(finite: jax.Array, new, old):
    """`new` where the step's gradients were finite, else `old` (leaf by leaf)."""
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
