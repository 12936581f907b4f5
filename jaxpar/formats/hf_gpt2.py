"""Hugging Face GPT-2 (config.json + model.safetensors) <-> the shared weight format. numpy only.

HF stores GPT-2 projections as Conv1D weights [in, out] with q, k, v concatenated on `out`, so
every conversion is a reshape; nothing is transposed or rounded, and round trips are bit-exact.
"""

from __future__ import annotations

import json
import os

import numpy as np

from jaxpar.core.errors import UserError
from jaxpar.core.weights.names import model_dims, write_safetensors
from jaxpar.formats.hub_files import read_safetensors

# shared per-layer name -> HF per-layer name (under transformer.h.{i}.)
BLOCK_NAMES = {
    "ln1.scale": "ln_1.weight",
    "ln1.bias": "ln_1.bias",
    "attn.qkv.kernel": "attn.c_attn.weight",
    "attn.qkv.bias": "attn.c_attn.bias",
    "attn.out.kernel": "attn.c_proj.weight",
    "attn.out.bias": "attn.c_proj.bias",
    "ln2.scale": "ln_2.weight",
    "ln2.bias": "ln_2.bias",
    "mlp.fc.kernel": "mlp.c_fc.weight",
    "mlp.fc.bias": "mlp.c_fc.bias",
    "mlp.proj.kernel": "mlp.c_proj.weight",
    "mlp.proj.bias": "mlp.c_proj.bias",
}
TOP_NAMES = {"wte": "wte.weight", "wpe": "wpe.weight", "ln_f.scale": "ln_f.weight", "ln_f.bias": "ln_f.bias"}


def hf_to_shared(hf_dir: str) -> tuple[dict[str, np.ndarray], dict]:
    """Read an HF GPT-2 directory -> (flat shared tensors, model config overrides)."""
    cfg_path, w_path = os.path.join(hf_dir, "config.json"), os.path.join(hf_dir, "model.safetensors")
    for p in (cfg_path, w_path):
        if not os.path.exists(p):
            raise UserError(f"not a Hugging Face GPT-2 directory: {p} is missing")
    with open(cfg_path) as f:
        hf = json.load(f)
    if hf.get("model_type") != "gpt2":
        raise UserError(f"{cfg_path}: model_type {hf.get('model_type')!r} is not 'gpt2'")
    # Some checkpoints prefix "transformer."; lm_head is tied to wte and carries nothing new.
    raw = {k.removeprefix("transformer."): v for k, v in read_safetensors(w_path).items()}
    L, d, h = hf["n_layer"], hf["n_embd"], hf["n_head"]
    k = d // h
    out = {ours: raw[theirs] for ours, theirs in TOP_NAMES.items()}
    for ours, theirs in BLOCK_NAMES.items():
        out[f"blocks.{ours}"] = np.stack([raw[f"h.{i}.{theirs}"] for i in range(L)])
    out["blocks.attn.qkv.kernel"] = out["blocks.attn.qkv.kernel"].reshape(L, d, 3, h, k)
    out["blocks.attn.qkv.bias"] = out["blocks.attn.qkv.bias"].reshape(L, 3, h, k)
    out["blocks.attn.out.kernel"] = out["blocks.attn.out.kernel"].reshape(L, h, k, d)
    model = {**model_dims(out), "layernorm_eps": hf.get("layer_norm_epsilon", 1e-5)}
    if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise UserError(f"{cfg_path}: activation {hf['activation_function']!r} is not GPT-2's tanh GELU")
    return out, model


def shared_to_hf(flat: dict[str, np.ndarray], out_dir: str, layernorm_eps: float = 1e-5) -> None:
    """Write an HF GPT-2 directory (config.json + model.safetensors) from flat shared tensors."""
    dims = model_dims(flat)
    L, d = dims["n_layer"], dims["d_model"]
    reshaped = dict(flat)
    reshaped["blocks.attn.qkv.kernel"] = flat["blocks.attn.qkv.kernel"].reshape(L, d, 3 * d)
    reshaped["blocks.attn.qkv.bias"] = flat["blocks.attn.qkv.bias"].reshape(L, 3 * d)
    reshaped["blocks.attn.out.kernel"] = flat["blocks.attn.out.kernel"].reshape(L, d, d)
    tensors = {f"transformer.{theirs}": np.ascontiguousarray(reshaped[ours]) for ours, theirs in TOP_NAMES.items()}
    for ours, theirs in BLOCK_NAMES.items():
        for i in range(L):
            tensors[f"transformer.h.{i}.{theirs}"] = np.ascontiguousarray(reshaped[f"blocks.{ours}"][i])
    config = {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": dims["vocab_size"],
        "n_positions": dims["max_seq_len"],
        "n_embd": d,
        "n_layer": L,
        "n_head": dims["n_head"],
        "n_inner": dims["d_ff"],
        "activation_function": "gelu_new",
        "layer_norm_epsilon": layernorm_eps,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "tie_word_embeddings": True,
    }
    write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors, {"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
