"""--backend none: one process, the plain module, no wrapper (the reference the others are held to)."""

from __future__ import annotations

from torchpar.backends.base import TorchEngine


def build(model, cfg, env, **_):
    return TorchEngine(model.to(env.device), model, cfg, env)
