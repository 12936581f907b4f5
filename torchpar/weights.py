"""torchpar state dicts <-> the shared weight format, by the one name table in jaxpar/core/weights/names.py.

Shared names/shapes are jaxpar's (jaxpar/models/decoder.py): per-layer parameters are stacked on a
leading `layers` axis ("blocks.attn.qkv.kernel" [L, embed, 3, heads, kv]). torchpar keeps one
module per layer with the same per-layer shape ("blocks.{l}.attn.qkv.weight" [embed, 3, heads,
kv]), so conversion is stack/unstack and nothing else: no transposes, no reshapes.
"""

from __future__ import annotations

import numpy as np
import torch

from jaxpar.core.config.schema import ModelConfig
from jaxpar.core.weights.names import ALL_NAMES, stacked_name, stacks_of
from torchpar.models.decoder import Decoder


def shared_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Expected shapes in the shared weight format, from a model built on the meta device (nothing allocated)."""
    with torch.device("meta"):
        sd = Decoder(cfg).state_dict()
    return {name: tuple(a.shape) for name, a in to_shared(sd, cfg.n_layer, like=lambda t: t).items()}


def to_shared(state_dict: dict, n_layer: int, like=lambda t: t.detach().cpu().float().numpy()) -> dict:
    """torch state dict (full tensors) -> flat shared {name.

    float32 numpy} (per-layer tensors stacked, each layer stack of its own: layer_stacks). Names the model does not
    have (another variant's) are skipped.
    """
    first = next((i for i in range(n_layer) if f"blocks.{i}.moe.router.weight" in state_dict), 0)
    depth = next(d for d in range(len(state_dict) + 1) if f"mtp.{d}.proj.weight" not in state_dict)
    out = {}
    for shared, t in ALL_NAMES.items():
        if "{l}" not in t:
            if t in state_dict:
                out[shared] = like(state_dict[t])
            continue
        for prefix, layers in stacks_of(shared, first, n_layer, depth):
            if t.format(l=layers[0]) in state_dict:
                parts = [like(state_dict[t.format(l=i)]) for i in layers]
                stack = torch.stack if isinstance(parts[0], torch.Tensor) else np.stack
                out[stacked_name(prefix, shared)] = stack(parts)
    return out


def from_shared(flat: dict, n_layer: int) -> dict[str, torch.Tensor]:
    """flat shared {name: array} -> torch state dict (stacked tensors unstacked per layer)."""
    first = next((len(v) for k, v in flat.items() if k.startswith("dense_blocks.")), 0)
    depth = len(flat["mtp.proj.kernel"]) if "mtp.proj.kernel" in flat else 0
    out = {}
    for shared, t in ALL_NAMES.items():
        for prefix, layers in stacks_of(shared, first, n_layer, depth) if "{l}" in t else [("", None)]:
            name = stacked_name(prefix, shared) if layers else shared
            if name not in flat:
                continue
            value = torch.tensor(np.array(flat[name], dtype=np.float32))
            out.update({t.format(l=i): value[j].clone() for j, i in enumerate(layers)} if layers else {t: value})
    return out
