"""torchpar state dicts <-> the shared weight format, by the one name table in jaxpar/core/weights.py.

Shared names/shapes are jaxpar's (jaxpar/models/decoder.py): per-layer parameters are stacked on a
leading `layers` axis ("blocks.attn.qkv.kernel" [L, embed, 3, heads, kv]). torchpar keeps one
module per layer with the same per-layer shape ("blocks.{l}.attn.qkv.weight" [embed, 3, heads,
kv]), so conversion is stack/unstack and nothing else: no transposes, no reshapes.
"""
from __future__ import annotations

import numpy as np
import torch

from jaxpar.core.config import ModelConfig
from jaxpar.core.weights import ALL_NAMES

def shared_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Expected shapes in the shared weight format, from a model built on the meta device (nothing allocated)."""
    from torchpar.models.decoder import Decoder

    with torch.device("meta"):
        sd = Decoder(cfg).state_dict()
    return {name: tuple(a.shape) for name, a in to_shared(sd, cfg.n_layer, like=lambda t: t).items()}


def to_shared(state_dict: dict, n_layer: int, like=lambda t: t.detach().cpu().float().numpy()) -> dict:
    """torch state dict (full tensors) -> flat shared {name: float32 numpy} (per-layer tensors stacked).
    Names the model does not have (another variant's) are skipped."""
    out = {}
    for shared, t in ALL_NAMES.items():
        if t.format(l=0) not in state_dict:
            continue
        if "{l}" in t:
            parts = [like(state_dict[t.format(l=i)]) for i in range(n_layer)]
            out[shared] = torch.stack(parts) if isinstance(parts[0], torch.Tensor) else np.stack(parts)
        else:
            out[shared] = like(state_dict[t])
    return out


def from_shared(flat: dict, n_layer: int) -> dict[str, torch.Tensor]:
    """flat shared {name: array} -> torch state dict (stacked tensors unstacked per layer)."""
    out = {}
    for shared, t in ALL_NAMES.items():
        if shared not in flat:
            continue
        value = torch.tensor(np.array(flat[shared], dtype=np.float32))
        if "{l}" in t:
            out.update({t.format(l=i): value[i].clone() for i in range(n_layer)})
        else:
            out[t] = value
    return out
