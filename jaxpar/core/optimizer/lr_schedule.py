"""Learning-rate schedule and weight-decay rule: one definition for both sides.

The schedule is a linear warmup, then a cosine down to min_lr.
`xp` is the array module the caller computes with (jax.numpy inside a jitted step, numpy or math
in torchpar), so the formula is written once.
"""

from __future__ import annotations

import math

from jaxpar.core.config.schema import OptimConfig


def lr_at(step, o: OptimConfig, total_steps: int, xp=math):
    """Learning rate used by the update at 0-based `step`."""
    decay_end = o.decay_steps or total_steps
    warm = o.warmup_steps
    if warm:
        ramp = o.lr * (step + 1) / warm
    progress = (step - warm) / max(decay_end - warm, 1)
    progress = min(max(progress, 0.0), 1.0) if xp is math else xp.clip(progress, 0.0, 1.0)
    cosine = o.min_lr + 0.5 * (o.lr - o.min_lr) * (1.0 + xp.cos(math.pi * progress))
    if not warm:
        return cosine
    if xp is math:
        return ramp if step < warm else cosine
    return xp.where(step < warm, ramp, cosine)


def decays(shared_name: str) -> bool:
    """Weight decay for matrices and embeddings; none for biases, norm scales and attention sinks (by shared name)."""
    last = shared_name.rsplit(".", 1)[-1]
    return last not in ("bias", "scale", "sinks") and not last.endswith("_bias")
