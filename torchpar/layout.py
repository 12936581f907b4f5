"""The one mapping table between jaxpar's shared parameter layout and torchpar's parameter names.

Shared names/shapes are jaxpar's (jaxpar/models/gpt.py): per-layer parameters are stacked on a
leading `layers` axis ("blocks.attn.qkv.kernel" [L, embed, 3, heads, kv]). torchpar keeps one
module per layer with the same per-layer shape ("blocks.{l}.attn.qkv.weight" [embed, 3, heads,
kv]), so conversion is stack/unstack and nothing else: no transposes, no reshapes.
"""
from __future__ import annotations

import numpy as np
import torch

from jaxpar.config import ModelConfig

# shared name -> torch name; "{l}" marks a per-layer parameter stacked on the leading layers axis.
NAMES = {
    "wte": "wte",
    "wpe": "wpe",
    "ln_f.scale": "ln_f.weight",
    "ln_f.bias": "ln_f.bias",
    "blocks.ln1.scale": "blocks.{l}.ln1.weight",
    "blocks.ln1.bias": "blocks.{l}.ln1.bias",
    "blocks.attn.qkv.kernel": "blocks.{l}.attn.qkv.weight",
    "blocks.attn.qkv.bias": "blocks.{l}.attn.qkv.bias",
    "blocks.attn.out.kernel": "blocks.{l}.attn.out.weight",
    "blocks.attn.out.bias": "blocks.{l}.attn.out.bias",
    "blocks.ln2.scale": "blocks.{l}.ln2.weight",
    "blocks.ln2.bias": "blocks.{l}.ln2.bias",
    "blocks.mlp.fc.kernel": "blocks.{l}.mlp.fc.weight",
    "blocks.mlp.fc.bias": "blocks.{l}.mlp.fc.bias",
    "blocks.mlp.proj.kernel": "blocks.{l}.mlp.proj.weight",
    "blocks.mlp.proj.bias": "blocks.{l}.mlp.proj.bias",
}
# model variants (jaxpar/models/{mla,sketched}.py): their parameters beside or instead of GPT-2's
VARIANT_NAMES = {
    **{f"blocks.attn.{n}.kernel": f"blocks.{{l}}.attn.{n}.weight" for n in ("q_down", "q_up", "kv_down", "kv_up")},
    "blocks.attn.q_norm.scale": "blocks.{l}.attn.q_norm.weight",
    "blocks.attn.kv_norm.scale": "blocks.{l}.attn.kv_norm.weight",
    "blocks.mlp.fc.factor": "blocks.{l}.mlp.fc.factor",
    "blocks.mlp.proj.factor": "blocks.{l}.mlp.proj.factor",
}
ALL_NAMES = {**NAMES, **VARIANT_NAMES}


def shared_name(torch_name: str) -> str:
    """"blocks.3.mlp.fc.weight" -> "blocks.mlp.fc.kernel"."""
    parts = torch_name.split(".")
    pattern = ".".join("{l}" if p.isdigit() else p for p in parts)
    for shared, t in ALL_NAMES.items():
        if t == pattern:
            return shared
    raise KeyError(f"no shared name for torch parameter {torch_name!r}")


def shared_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Expected shared-layout shapes, from a model built on the meta device (nothing allocated)."""
    from torchpar.model import GPT

    with torch.device("meta"):
        sd = GPT(cfg).state_dict()
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
