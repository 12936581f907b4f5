"""Hugging Face gpt-oss (`GptOssForCausalLM`: config.json + safetensors) <-> the shared weight format. numpy only.

gpt-oss is Llama's decoder (hf_llama.py converts its embeddings, norms and projections) with biases on the attention's
projections (model.attention_bias), a sink logit per head (self_attn.sinks: model.attention_sinks), YaRN rotary
positions (model.rope_scaling) and a mixture of experts in every layer:
- the router (mlp.router.weight [E, embed], .bias [E]: model.moe_expert_bias's logit bias) sends each token to its
  num_experts_per_tok best logits, weighted by their softmax: our softmax router with model.moe_norm_topk;
- each expert's gate and up projections fused in mlp.experts.gate_up_proj [E, embed, 2 x width] with the gate in the
  even columns and up in the odd ones (its bias likewise), down in down_proj [E, width, embed] with its bias;
- the activation is model.moe_activation=gpt_oss with swiglu_limit and swiglu_alpha.
Its layer_types, sliding and full layers alternating, are model.sliding_window with model.full_attention_every=2.
Checkpoint names as transformers' save_pretrained writes them, float or, as the Hub ships gpt-oss, the experts' weights
in MXFP4 (`*_blocks` and `*_scales`, quant_method mxfp4: dequantized on the way in, `dequantize_mxfp4`; written back as
float32). Refused in one line: a mix of sliding and full layers other than every N-th full, other quantizations, and
on the way out what gpt-oss cannot hold.
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
    kinds = hf.get("layer_types") or ["full_attention"] * hf["num_hidden_layers"]
    hf["windows"] = hf_llama.window_settings(kinds, hf.get("sliding_window") or 0, path)
    method = (hf.get("quantization_config") or {}).get("quant_method", "none")
    if hf.get("quantization_config") and method != "mxfp4":
        raise UserError(
            f"{path}: quantization_config {method!r}: only the Hub's MXFP4 expert blocks are read (dequantized); "
            "dequantize with transformers and save_pretrained first"
        )
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise UserError(f"{path}: rope type {kind!r} is not supported (plain or YaRN rotary positions)")
    hf["rope_theta"] = float(rope.get("rope_theta", hf.get("rope_theta", 150000.0)))
    hf["rope_settings"] = hf_llama.yarn_settings(rope, hf) if kind == "yarn" else {}
    return hf


def hf_to_shared(hf_dir: str) -> tuple[dict[str, np.ndarray], dict]:
    """-> (flat shared tensors, model config overrides)."""
    hf = read_config(hf_dir)
    L = hf["num_hidden_layers"]

    def experts(hf: dict, raw: dict) -> dict[str, np.ndarray]:
        g = lambda name: hf_llama.layers(raw, L, name)

        def weight(name: str) -> np.ndarray:  # [L, E, in, out]: float, or the Hub's MXFP4 blocks dequantized
            at = hf_llama.PREFIX.format(i=0) + f"mlp.experts.{name}"
            if at in raw:
                return g(f"mlp.experts.{name}")
            if at + "_blocks" not in raw:
                raise UserError(f"{hf_dir}: no mlp.experts.{name} tensors, float or MXFP4 (_blocks and _scales)")
            pick = lambda i, part: raw[hf_llama.PREFIX.format(i=i) + f"mlp.experts.{name}_{part}"]
            return np.stack(
                [dequantize_mxfp4(pick(i, "blocks"), pick(i, "scales"), f"{hf_dir}: {name}") for i in range(L)]
            )

        gate_up, gate_up_bias = weight("gate_up_proj"), g("mlp.experts.gate_up_proj_bias")
        return {
            "blocks.moe.router.kernel": g("mlp.router.weight").transpose(0, 2, 1),
            "blocks.moe.router.logit_bias": g("mlp.router.bias"),
            "blocks.moe.gate": gate_up[..., ::2],
            "blocks.moe.up": gate_up[..., 1::2],
            "blocks.moe.down": weight("down_proj"),
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
        **hf["windows"],
    }
    return flat, {**dims, **settings}


# MXFP4's 4-bit values (e2m1: a sign, two exponent bits, one mantissa bit), by code
FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray, what: str = "MXFP4 weights") -> np.ndarray:
    """The Hub's MXFP4 expert weights as float32 [experts, in, out] (exact: every value is a float32).

    blocks [experts, out, groups, 16] uint8 hold two 4-bit codes per byte, the low nibble first, 32 values of `in`
    per group; scales [experts, out, groups] uint8 are each group's power of two plus 127.
    """
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape != (*scales.shape, 16):
        raise UserError(
            f"{what}: MXFP4 blocks {blocks.dtype}{list(blocks.shape)} and scales {scales.dtype}{list(scales.shape)} "
            "are not uint8 [..., groups, 16] and [..., groups]"
        )
    values = np.stack([FP4[blocks & 0x0F], FP4[blocks >> 4]], axis=-1)  # [E, out, groups, 16, 2]
    values = np.ldexp(values, (scales.astype(np.int32) - 127)[..., None, None]).astype(np.float32)
    return np.ascontiguousarray(values.reshape(*scales.shape[:-1], -1).swapaxes(-1, -2))


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
    L = flat["blocks.attn.q.kernel"].shape[0]
    config = {
        "model_type": "gpt_oss",
        "architectures": ["GptOssForCausalLM"],
        "intermediate_size": width,
        "num_local_experts": E,
        "num_experts_per_tok": int(model.get("moe_top_k", 4)),
        "swiglu_limit": float(model.get("moe_swiglu_limit", 7.0)),
        "swiglu_alpha": float(model.get("moe_swiglu_alpha", 1.702)),
        "attention_bias": "blocks.attn.q.bias" in flat,
        # transformers wants a window; with every layer full it reads none (128: gpt-oss's)
        "sliding_window": int(model.get("sliding_window") or 0) or 128,
        "layer_types": hf_llama.layer_types(model, L),
        "output_router_logits": False,
        "router_aux_loss_coef": float(model.get("moe_aux_loss", 0.0)),
    }
    hf_llama.shared_to_hf(flat, out_dir, model, mlp=experts, config=config)
