"""Parameter-free layers shared by the model files (MLA and Llama): RMS normalisation and rotary embedding."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x, scale, eps):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps) * scale).astype(x.dtype)


def rope(x, positions, theta: float):
    """Rotary embedding on the last dim of x [batch, seq, ..., r]: pairs (i, i + r/2) rotated by pos * theta^(-2i/r);
    positions [seq], or per row [batch, seq] (packed documents)."""
    r = x.shape[-1]
    freqs = theta ** (-jnp.arange(0, r // 2, dtype=jnp.float32) * 2 / r)
    angle = positions.astype(jnp.float32)[..., None] * freqs  # [(batch,) seq, r/2]
    angle = angle.reshape(angle.shape[:-1] + (1,) * (x.ndim - 3) + angle.shape[-1:])
    cos, sin = jnp.cos(angle).astype(x.dtype), jnp.sin(angle).astype(x.dtype)
    x1, x2 = x[..., : r // 2], x[..., r // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
