"""Hugging Face gpt-oss (`GptOssForCausalLM`: config.json + safetensors) <-> the shared weight format. numpy only.

gpt-oss is Llama's decoder (hf_llama.py converts its embeddings, norms and projections) with biases on the attention's
projections (model.attention_bias), a sink logit per head (self_attn.sinks: model.attention_sinks), YaRN rotary
positions (model.rope_scaling) and a mixture of experts in every layer:
- the router (mlp.router.weight [E, embed], .bias [E]: model.moe_expert_bias's logit bias) sends each token to its
  num_experts_per_tok best logits, weighted by their softmax: our softmax router with model.moe_norm_topk;
- each expert's gate and up projections fused in mlp.experts.gate_up_proj [E, embed, 2 x width] with the gate in the
  even columns and up in the odd ones (its bias likewise), down in down_proj [E, width, embed] with its bias;
- the activation is model.moe_activation=gpt_oss with swiglu_limit and swiglu_alpha.
Checkpoint names as transformers' save_pretrained writes them (float weights). Refused in one line: layers that mix
sliding and full attention (gpt-oss's own alternation: model.sliding_window applies to every layer), the Hub's MXFP4
expert blocks (not read yet), and on the way out what gpt-oss cannot hold.
"""

from __future__ import annotations

import json
import os

import numpy as np

from jaxpar.core.errors import UserError
from jaxpar.formats import hf_llama


def read_config(hf_dir: str) -> dict:
    """config.json checked for what the shared model holds; Llama's keys read as hf_llama does."""
    path = os.path.join(hf_dir, "config.json")
    with open(path) as f:
        hf = json.load(f)
    kinds = set(hf.get("layer_types") or ["full_attention"])
    if len(kinds) > 1:
        raise UserError(
            f"{path}: layer types {sorted(kinds)}: gpt-oss's alternation of sliding and full attention is not built "
            "(model.sliding_window applies to every layer)"
        )
    if hf.get("quantization_config"):
        raise UserError(
            f"{path}: quantization_config {hf['quantization_config'].get('quant_method')!r}: the MXFP4 expert blocks "
            "are not read yet; dequantize with transformers (Mxfp4Config(dequantize=True)) and save_pretrained first"
        )
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise UserError(f"{path}: rope type {kind!r} is not supported (plain or YaRN rotary positions)")
    hf["rope_theta"] = float(rope.get("rope_theta", hf.get("rope_theta", 150000.0)))
    hf["rope_settings"] = hf_llama.yarn_settings(rope, hf) if kind == "yarn" else {}
    hf["window"] = (hf.get("sliding_window") or 0) if kinds == {"sliding_attention"} else 0
    return hf


def hf_to_shared(hf_dir: str) -> tuple[dict[str, np.ndarray], dict]:
    """-> (flat shared tensors, model config overrides)."""
    hf = read_config(hf_dir)
    L = hf["num_hidden_layers"]

    def experts(hf: dict, raw: dict) -> dict[str, np.ndarray]:
        g = lambda name: hf_llama.layers(raw, L, name)
        if "model.layers.0.mlp.experts.gate_up_proj" not in raw:
            raise UserError(f"{hf_dir}: no mlp.experts.gate_up_proj tensors (MXFP4 blocks are not read yet)")
        gate_up, gate_up_bias = g("mlp.experts.gate_up_proj"), g("mlp.experts.gate_up_proj_bias")
        return {
            "blocks.moe.router.kernel": g("mlp.router.weight").transpose(0, 2, 1),
            "blocks.moe.router.logit_bias": g("mlp.router.bias"),
            "blocks.moe.gate": gate_up[..., ::2],
            "blocks.moe.up": gate_up[..., 1::2],
            "blocks.moe.down": g("mlp.experts.down_proj"),
            "blocks.moe.gate_bias": gate_up_bias[..., ::2],
            "blocks.moe.up_bias": gate_up_bias[..., 1::2],
            "blocks.moe.down_bias": g("mlp.experts.down_proj_bias"),
        }

    flat, dims = hf_llama.hf_to_shared(hf_dir, mlp=experts, check=read_config)
    settings = {
        "moe_top_k": hf.get("num_experts_per_tok", 4),
        "moe_norm_topk": True,
        "moe_activation": "gpt_oss",
        "moe_swiglu_limit": float(hf.get("swiglu_limit", 7.0)),
        "moe_swiglu_alpha": float(hf.get("swiglu_alpha", 1.702)),
        **({"sliding_window": hf["window"]} if hf["window"] else {}),
    }
    return flat, {**dims, **settings}


def _refuse(flat: dict, model: dict) -> None:
    """One line for what GptOssForCausalLM cannot hold."""
    refused = {
        "no attention sinks (model.attention_sinks)": "blocks.attn.sinks" not in flat,
        "no expert biases (model.moe_expert_bias)": "blocks.moe.gate_bias" not in flat,
        "query/key norms (model.qk_norm)": "blocks.attn.k_norm.scale" in flat,
        "dense first layers (model.moe_first_dense)": "dense_blocks.ln1.scale" in flat,
        "shared experts (model.moe_shared_experts)": "blocks.moe.shared.gate.kernel" in flat,
        "a balance bias (model.moe_bias_update, model.moe_router_bias)": "blocks.moe.router.bias" in flat,
        "an activation other than gpt_oss (model.moe_activation)": model.get("moe_activation") != "gpt_oss",
        "a router other than softmax over the chosen (model.moe_router, moe_norm_topk, moe_n_group, "
        "moe_routed_scale)": model.get("moe_router", "softmax") != "softmax"
        or not model.get("moe_norm_topk", True)
        or model.get("moe_n_group", 1) > 1
        or model.get("moe_routed_scale", 1.0) != 1.0,
        "a capacity (model.moe_capacity_factor; gpt-oss is dropless)": model.get("moe_capacity_factor", 0.0) > 0,
    }
    for what, bad in refused.items():
        if bad:
            raise UserError(f"these weights have no gpt-oss form: {what}")


def shared_to_hf(flat: dict[str, np.ndarray], out_dir: str, model: dict) -> None:
    """Write an HF gpt-oss directory (config.json + model.safetensors) from flat shared tensors."""
    _refuse(flat, model)
    interleave = lambda gate, up: np.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], -1)  # gate even, up odd

    def experts(flat: dict, i: int) -> dict[str, np.ndarray]:
        w = lambda name: flat[f"blocks.moe.{name}"][i]
        return {
            "mlp.router.weight": np.ascontiguousarray(flat["blocks.moe.router.kernel"][i].T),
            "mlp.router.bias": flat["blocks.moe.router.logit_bias"][i],
            "mlp.experts.gate_up_proj": interleave(w("gate"), w("up")),
            "mlp.experts.gate_up_proj_bias": interleave(w("gate_bias"), w("up_bias")),
            "mlp.experts.down_proj": w("down"),
            "mlp.experts.down_proj_bias": w("down_bias"),
        }

    _, E, _, width = flat["blocks.moe.gate"].shape
    L, window = flat["blocks.attn.q.kernel"].shape[0], int(model.get("sliding_window") or 0)
    config = {
        "model_type": "gpt_oss",
        "architectures": ["GptOssForCausalLM"],
        "intermediate_size": width,
        "num_local_experts": E,
        "num_experts_per_tok": int(model.get("moe_top_k", 4)),
        "swiglu_limit": float(model.get("moe_swiglu_limit", 7.0)),
        "swiglu_alpha": float(model.get("moe_swiglu_alpha", 1.702)),
        "attention_bias": "blocks.attn.q.bias" in flat,
        "sliding_window": window or 128,  # transformers wants one; with every layer full it reads none (gpt-oss's)
        "layer_types": [("sliding" if window else "full") + "_attention"] * L,
        "output_router_logits": False,
        "router_aux_loss_coef": float(model.get("moe_aux_loss", 0.0)),
    }
    hf_llama.shared_to_hf(flat, out_dir, model, mlp=experts, config=config)
