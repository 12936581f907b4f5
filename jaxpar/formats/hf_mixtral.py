"""Hugging Face Mixtral (`MixtralForCausalLM`: config.json + safetensors) <-> the shared weight format. numpy only.

Mixtral is Llama's decoder (hf_llama.py converts its attention, norms and embeddings) with each MLP replaced by
a mixture of experts: a softmax router over num_local_experts SwiGLU experts, each token sent to its
num_experts_per_tok best, their weights renormalised over the chosen -- jaxpar's model.moe_* with
moe_router=softmax, moe_norm_topk=true, no shared experts, dropless; its sliding_window is model.sliding_window.
Checkpoint names as the Hub keeps them (and transformers' save_pretrained writes them): block_sparse_moe.gate
[E, embed] and experts.{j}.w1 (gate), w3 (up) [width, embed], w2 (down) [embed, width]; the shared format stacks the
experts (jaxpar/models/moe.py).
"""

from __future__ import annotations

import numpy as np

from jaxpar.core.errors import UserError
from jaxpar.formats import hf_llama

MOE = "block_sparse_moe."
EXPERT = MOE + "experts.{j}.{w}.weight"
WEIGHTS = {"gate": "w1", "up": "w3", "down": "w2"}  # shared name -> Mixtral's


def _experts_to_shared(hf: dict, raw: dict) -> dict[str, np.ndarray]:
    L, E = hf["num_hidden_layers"], hf["num_local_experts"]
    if f"model.layers.0.{MOE}gate.weight" not in raw:
        raise UserError(
            "this Mixtral checkpoint does not keep block_sparse_moe.* tensors (the Hub's names); "
            "save it with transformers' save_pretrained first"
        )
    out = {"blocks.moe.router.kernel": hf_llama.layers(raw, L, MOE + "gate.weight").transpose(0, 2, 1)}
    for ours, theirs in WEIGHTS.items():  # [L, E, out, in] -> [L, E, in, out]
        stacked = np.stack([hf_llama.layers(raw, L, EXPERT.format(j=j, w=theirs)) for j in range(E)], axis=1)
        out[f"blocks.moe.{ours}"] = stacked.transpose(0, 1, 3, 2)
    return out


def hf_to_shared(hf_dir: str) -> tuple[dict[str, np.ndarray], dict]:
    """-> (flat shared tensors, model config overrides: Llama's and the experts' model.moe_*)."""
    hf = hf_llama.read_config(hf_dir)
    if hf.get("router_jitter_noise"):
        raise UserError(
            f"{hf_dir}/config.json: router_jitter_noise {hf['router_jitter_noise']} scales tokens at "
            "random in training; jaxpar routes deterministically (set it to 0.0)"
        )
    flat, dims = hf_llama.hf_to_shared(hf_dir, mlp=_experts_to_shared)
    window = {"sliding_window": hf["sliding_window"]} if hf.get("sliding_window") else {}
    return flat, {**dims, "moe_top_k": hf.get("num_experts_per_tok", 2), **window}


def _experts_to_hf(flat: dict, i: int) -> dict[str, np.ndarray]:
    out = {MOE + "gate.weight": np.ascontiguousarray(flat["blocks.moe.router.kernel"][i].T)}
    for ours, theirs in WEIGHTS.items():
        for j, w in enumerate(flat[f"blocks.moe.{ours}"][i]):
            out[EXPERT.format(j=j, w=theirs)] = np.ascontiguousarray(w.T)
    return out


def shared_to_hf(flat: dict[str, np.ndarray], out_dir: str, model: dict) -> None:
    if model.get("moe_first_dense"):
        raise UserError(
            f"these weights keep {model['moe_first_dense']} dense first layers "
            "(model.moe_first_dense); Mixtral has experts in every layer, so they have no Mixtral form"
        )
    if (
        model.get("moe_shared_experts")
        or model.get("moe_router", "softmax") != "softmax"
        or not model.get("moe_norm_topk", True)
        or model.get("moe_capacity_factor")
        or "blocks.moe.router.bias" in flat
        or model.get("moe_n_group", 1) > 1
        or model.get("moe_routed_scale", 1.0) != 1.0
    ):
        raise UserError(
            "Mixtral routes by softmax over the chosen experts, dropless, with no shared experts, no "
            "balance bias, no expert groups and no scale: these weights' model (moe_shared_experts, "
            "moe_router, moe_norm_topk, moe_capacity_factor, moe_bias_update, moe_n_group, "
            "moe_routed_scale) has no Mixtral equivalent"
        )
    E, f = flat["blocks.moe.gate"].shape[1], flat["blocks.moe.gate"].shape[-1]
    config = {
        "model_type": "mixtral",
        "architectures": ["MixtralForCausalLM"],
        "intermediate_size": f,
        "num_local_experts": E,
        "num_experts_per_tok": int(model.get("moe_top_k", 2)),
        "router_jitter_noise": 0.0,
        "sliding_window": int(model.get("sliding_window") or 0) or None,
        "output_router_logits": False,
    }
    hf_llama.shared_to_hf(flat, out_dir, model, mlp=_experts_to_hf, config=config)
