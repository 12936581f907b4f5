"""Parameter creation shared by the model files: every parameter records its logical axes."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def param(value: jax.Array, axes: tuple[str | None, ...]) -> nnx.Param:
    assert value.ndim == len(axes), (value.shape, axes)
    return nnx.Param(value, logical_axes=axes)


def normal(rngs: nnx.Rngs, shape, std: float) -> jax.Array:
    return std * jax.random.normal(rngs.params(), shape, jnp.float32)
