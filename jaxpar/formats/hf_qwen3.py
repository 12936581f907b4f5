"""Hugging Face Qwen3 and Qwen3-MoE (`Qwen3ForCausalLM`, `Qwen3MoeForCausalLM`) <-> the shared weight format.

Qwen3 is Llama's decoder (hf_llama.py converts it) with model.qk_norm (self_attn.q_norm / k_norm: each query and key
head RMS-normalised over its width before the rotation) and its own head width (config.json's head_dim ->
model.head_dim). Qwen3-MoE puts a mixture of experts in place of the MLP: a softmax router (mlp.gate [E, embed]) over
num_experts SwiGLU experts (mlp.experts.{j}.{gate,up,down}_proj, the Hub's names, which transformers' save_pretrained
writes), each token sent to its num_experts_per_tok best, renormalised over them only with norm_topk_prob; no shared
experts. Its dense layers (mlp_only_layers, and those decoder_sparse_step skips) keep an MLP of intermediate_size: where
they are the first layers they are model.moe_first_dense's stack; anywhere else they are refused in one line.

Sliding-window attention is model.sliding_window when every layer slides (Qwen3-MoE's use_sliding_window; Qwen3's
layers from max_window_layers on, or its layer_types), with model.full_attention_every when Qwen3's layer_types make
every N-th layer full. Refused in one line: Llama's refusals, any other mix of sliding and full layers, and on the way
out what these families cannot hold (shared experts, sigmoid scores, expert groups, a
balance bias, a routed scale, a capacity); weights without query/key norms go to Llama or Mixtral instead.
"""

from __future__ import annotations

import numpy as np

from jaxpar.core.errors import UserError
from jaxpar.core.weights.names import model_dims
from jaxpar.formats import hf_llama

MLP = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}  # shared name -> HF's


def read_config(hf_dir: str) -> dict:
    """config.json checked as Llama's, then for what Qwen3's adds; its windows as our keys under "windows"."""
    hf = hf_llama.read_config(hf_dir)
    L, window = hf["num_hidden_layers"], hf.get("sliding_window") if hf.get("use_sliding_window") else None
    if hf["model_type"] == "qwen3_moe":  # every layer slides when the config says so
        return {**hf, "windows": {"sliding_window": window} if window else {}}
    # Qwen3: the layers from max_window_layers on slide, unless config.json lists each layer's type
    first = hf.get("max_window_layers", 28)
    kinds = hf.get("layer_types") or [
        "sliding_attention" if window and i >= first else "full_attention" for i in range(L)
    ]
    where = f"{hf_dir}/config.json (use_sliding_window, max_window_layers, layer_types)"
    return {**hf, "windows": hf_llama.window_settings(kinds, hf.get("sliding_window") or 0, where)}


def dense_layers(hf: dict) -> list[int]:
    """The layers whose feed-forward is Qwen3-MoE's dense MLP, as transformers places them."""
    L, step, only = hf["num_hidden_layers"], hf.get("decoder_sparse_step") or 1, set(hf.get("mlp_only_layers") or [])
    experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
    return [i for i in range(L) if i in only or not (experts > 0 and (i + 1) % step == 0)]


def hf_to_shared(hf_dir: str) -> tuple[dict[str, np.ndarray], dict]:
    """-> (flat shared tensors, model config overrides)."""
    hf = read_config(hf_dir)
    windows = hf["windows"]  # model.sliding_window, model.full_attention_every
    if hf["model_type"] == "qwen3":
        flat, dims = hf_llama.hf_to_shared(hf_dir, check=read_config)
        return flat, {**dims, **windows}
    L, dense = hf["num_hidden_layers"], dense_layers(hf)
    if dense != list(range(len(dense))):
        raise UserError(
            f"{hf_dir}/config.json: dense layers {dense} (mlp_only_layers, decoder_sparse_step) are not the first "
            "layers; jaxpar keeps dense layers only before the experts' (model.moe_first_dense)"
        )
    first, E = len(dense), hf.get("num_experts") or hf.get("num_local_experts")
    if first == L:
        raise UserError(f"{hf_dir}/config.json: no layer has experts (num_experts, mlp_only_layers)")

    def feed_forward(hf: dict, raw: dict) -> dict[str, np.ndarray]:
        stack = lambda name, layers: np.stack([raw[f"model.layers.{i}.{name}"] for i in layers])
        moe = range(first, L)
        if f"model.layers.{first}.mlp.experts.0.gate_proj.weight" not in raw:
            raise UserError(
                f"{hf_dir}: no mlp.experts.{{j}}.*_proj tensors (the Hub's names); save it with transformers' "
                "save_pretrained first"
            )
        out = {"blocks.moe.router.kernel": stack("mlp.gate.weight", moe).transpose(0, 2, 1)}
        for ours, theirs in MLP.items():  # [L, E, out, in] -> [L, E, in, out]
            experts = [stack(f"mlp.experts.{j}.{theirs}.weight", moe) for j in range(E)]
            out[f"blocks.moe.{ours}"] = np.stack(experts, axis=1).transpose(0, 1, 3, 2)
            if first:
                out[f"dense_blocks.mlp.{ours}.kernel"] = stack(f"mlp.{theirs}.weight", dense).transpose(0, 2, 1)
        return out

    flat, dims = hf_llama.hf_to_shared(hf_dir, mlp=feed_forward, check=read_config, first_dense=first)
    experts = {"moe_top_k": hf.get("num_experts_per_tok", 2), "moe_norm_topk": bool(hf.get("norm_topk_prob", False))}
    return flat, {**dims, **experts, **windows}


def _refuse_experts(flat: dict, model: dict) -> None:
    """One line for a mixture of experts Qwen3MoeForCausalLM cannot hold."""
    refused = {
        "shared experts (model.moe_shared_experts)": "blocks.moe.shared.gate.kernel" in flat,
        "sigmoid scores (model.moe_router=sigmoid)": model.get("moe_router", "softmax") != "softmax",
        "expert groups (model.moe_n_group>1)": model.get("moe_n_group", 1) > 1,
        "a balance bias (model.moe_bias_update, model.moe_router_bias)": "blocks.moe.router.bias" in flat,
        "a routed scale (model.moe_routed_scale)": model.get("moe_routed_scale", 1.0) != 1.0,
        "a capacity (model.moe_capacity_factor; Qwen3-MoE is dropless)": model.get("moe_capacity_factor", 0.0) > 0,
    }
    for what, bad in refused.items():
        if bad:
            raise UserError(f"these weights have no Qwen3-MoE form: {what}")


def shared_to_hf(flat: dict[str, np.ndarray], out_dir: str, model: dict) -> None:
    """Write an HF Qwen3 (or, with experts, Qwen3-MoE) directory from flat shared tensors with model.qk_norm's."""
    window = int(model.get("sliding_window") or 0)
    slide = {"use_sliding_window": bool(window), "sliding_window": window or None}
    if "blocks.moe.gate" not in flat:
        L = model_dims(flat, model)["n_layer"]
        every = {"max_window_layers": 0 if window else L, "layer_types": hf_llama.layer_types(model, L)}
        config = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], **slide, **every}
        hf_llama.shared_to_hf(flat, out_dir, model, config=config)
        return
    _refuse_experts(flat, model)
    first = flat["dense_blocks.ln1.scale"].shape[0] if "dense_blocks.ln1.scale" in flat else 0
    t = lambda a: np.ascontiguousarray(a.T)  # shared [in, out] -> HF [out, in]

    def feed_forward(flat: dict, i: int) -> dict[str, np.ndarray]:
        if i < first:
            return {
                f"mlp.{theirs}.weight": t(flat[f"dense_blocks.mlp.{ours}.kernel"][i]) for ours, theirs in MLP.items()
            }
        out = {"mlp.gate.weight": t(flat["blocks.moe.router.kernel"][i - first])}
        for ours, theirs in MLP.items():
            for j, w in enumerate(flat[f"blocks.moe.{ours}"][i - first]):
                out[f"mlp.experts.{j}.{theirs}.weight"] = t(w)
        return out

    _, E, _, width = flat["blocks.moe.gate"].shape
    config = {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "intermediate_size": flat["dense_blocks.mlp.gate.kernel"].shape[-1] if first else width,
        "moe_intermediate_size": width,
        "num_experts": E,
        "num_experts_per_tok": int(model.get("moe_top_k", 2)),
        "norm_topk_prob": bool(model.get("moe_norm_topk", True)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(first)),
        **slide,
        "output_router_logits": False,
    }
    hf_llama.shared_to_hf(flat, out_dir, model, mlp=feed_forward, config=config)
