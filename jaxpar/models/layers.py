"""The building blocks every model file shares, logical axes only.

Parameter creation (every parameter records its logical axes), the norms (LayerNorm, RMSNorm) and rotary embedding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.core.config.schema import ModelConfig


def param(value: jax.Array, axes: tuple[str | None, ...]) -> nnx.Param:
    assert value.ndim == len(axes), (value.shape, axes)
    return nnx.Param(value, logical_axes=axes)


def normal(rngs: nnx.Rngs, shape, std: float) -> jax.Array:
    return std * jax.random.normal(rngs.params(), shape, jnp.float32)


class LayerNorm(nnx.Module):
    def __init__(self, cfg: ModelConfig, stack: tuple[int, ...] = ()):
        lead = ("layers",) * len(stack)
        self.scale = param(jnp.ones(stack + (cfg.d_model,)), lead + ("embed",))
        self.bias = param(jnp.zeros(stack + (cfg.d_model,)), lead + ("embed",))
        self.eps = cfg.layernorm_eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)  # statistics in float32 whatever the compute dtype
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps) * self.scale[...] + self.bias[...]
        return y.astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, cfg: ModelConfig, stack: tuple[int, ...] = ()):
        self.scale = param(jnp.ones(stack + (cfg.d_model,)), ("layers",) * len(stack) + ("embed",))
        self.eps = cfg.layernorm_eps

    def __call__(self, x):
        return rms_norm(x, self.scale[...], self.eps)


def rms_norm(x, scale, eps):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps) * scale).astype(x.dtype)


def rope(x, positions, theta: float, scaled=None):
    """Rotary embedding on the last dim of x [batch, seq, ..., r]: pairs (i, i + r/2) rotated by pos * theta^(-2i/r).

    Positions [seq], or per row [batch, seq] (packed documents). `scaled`: (frequencies, cos/sin factor) of
    core/model/rotary.py's YaRN instead.
    """
    r = x.shape[-1]
    freqs = theta ** (-jnp.arange(0, r // 2, dtype=jnp.float32) * 2 / r) if scaled is None else jnp.asarray(scaled[0])
    angle = positions.astype(jnp.float32)[..., None] * freqs  # [(batch,) seq, r/2]
    angle = angle.reshape(angle.shape[:-1] + (1,) * (x.ndim - 3) + angle.shape[-1:])
    factor = 1.0 if scaled is None else scaled[1]
    cos, sin = (factor * jnp.cos(angle)).astype(x.dtype), (factor * jnp.sin(angle)).astype(x.dtype)
    x1, x2 = x[..., : r // 2], x[..., r // 2 :]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
