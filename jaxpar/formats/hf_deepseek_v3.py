"""Hugging Face DeepSeek-V3 (`DeepseekV3ForCausalLM`: config.json + safetensors) <-> the shared weight format.

DeepSeek-V3 is jaxpar's model.family=llama with model.attention=mla (jaxpar/models/mla.py, no output bias) and a
mixture of experts (jaxpar/models/moe.py) after first_k_dense_replace dense layers (model.moe_first_dense): sigmoid
scores (moe_router=sigmoid), group-limited choice (n_group, topk_group), norm_topk_prob, routed_scaling_factor,
n_shared_experts experts of moe_intermediate_size as one SwiGLU, and the choice's bias e_score_correction_bias (kept
as blocks.moe.router.bias where it is nonzero: model.moe_router_bias, a fixed bias; a zero one is left out and
written back as zeros). Checkpoint names as the Hub keeps them (and transformers' save_pretrained writes them):
mlp.experts.{j}.{gate,up,down}_proj.weight per expert, nn.Linear's [out, in].

Attention, per layer (HF -> shared): q_a_proj [q_lora, embed] -> q_down [embed, q_lora]; q_b_proj [heads x (nope +
rope), q_lora] -> q_up [q_lora, heads, nope + rope]; kv_a_proj_with_mqa [kv_lora + rope, embed] -> kv_down; kv_b_proj
[heads x (nope + v), kv_lora] -> kv_up [kv_lora, 2, heads, nope]; o_proj [embed, heads x v] -> out [heads, v, embed].
With rope_interleave (DeepSeek's layout) HF rotates the pairs (2i, 2i + 1) of the rotary features; ours are (i, i +
rope/2), so the rotary columns of q_b_proj and kv_a_proj_with_mqa are permuted (evens, then odds) on the way in and
back on the way out: the attention scores are the same sums, and round trips are bit-exact.

YaRN (the long-context DeepSeek-V3's rope_type yarn) is model.rope_scaling=yarn on the rotary part, with its mscale
and mscale_all_dim pair as the cos/sin factor (model.rope_attention_factor) and the scores' scale
(model.rope_mscale_all_dim). What the shared model cannot hold is refused in one line: other rope types, attention
biases, a q_proj without the low-rank query (q_lora_rank null), qk_nope_head_dim or v_head_dim
other than hidden_size / num_attention_heads, num_key_value_heads other than num_attention_heads, and rms_norm_eps
other than 1e-6 (HF's latent norms keep 1e-6 whatever it is; ours share model.layernorm_eps). The multi-token
prediction layers (num_nextn_predict_layers) are not in transformers' model: read, they are left out.
"""

from __future__ import annotations

import json
import os

import numpy as np

from jaxpar.core.errors import UserError
from jaxpar.core.model.rotary import mscale
from jaxpar.core.weights.names import model_dims
from jaxpar.formats import hf_llama

EPS = 1e-6  # HF's q_a_layernorm and kv_a_layernorm
MLP = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}  # shared name -> HF's


def read_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    with open(path) as f:
        hf = json.load(f)
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    h, d = hf["num_attention_heads"], hf["hidden_size"]
    refused = {
        f"rope type {rope_type!r} (plain rotary positions or yarn)": rope_type not in ("default", "yarn"),
        "attention_bias (jaxpar's llama attention has no biases)": hf.get("attention_bias"),
        "q_lora_rank null (jaxpar's mla always has the low-rank query)": hf.get("q_lora_rank") is None,
        f"hidden_act {hf.get('hidden_act')!r} (SwiGLU is silu's)": hf.get("hidden_act", "silu") != "silu",
        f"qk_nope_head_dim={hf.get('qk_nope_head_dim')} and v_head_dim={hf.get('v_head_dim')} (jaxpar's mla heads are "
        f"hidden_size/num_attention_heads = {d / h:g} wide)": d % h
        or hf.get("qk_nope_head_dim") != d // h
        or hf.get("v_head_dim") != d // h,
        f"num_key_value_heads={hf.get('num_key_value_heads')} (mla's keys and values are per head: {h})": (
            hf.get("num_key_value_heads") or h
        )
        != h,
        f"rms_norm_eps={hf.get('rms_norm_eps')} (HF's latent norms keep {EPS}; "
        "jaxpar's share model.layernorm_eps)": hf.get("rms_norm_eps", EPS) != EPS,
    }
    for what, bad in refused.items():
        if bad:
            raise UserError(f"{path}: {what} is not supported")
    hf["rope_theta"] = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    hf["rope_settings"] = _yarn_settings(rope, hf) if rope_type == "yarn" else {}
    return hf


def _yarn_settings(rope: dict, hf: dict) -> dict:
    """model.rope_* of DeepSeek-V3's YaRN: Llama's, its mscale pair's cos/sin factor and its scores' mscale_all_dim."""
    out = hf_llama.yarn_settings(rope, hf)
    pair, all_dim, factor = rope.get("mscale"), rope.get("mscale_all_dim"), out["rope_factor"]
    if not rope.get("attention_factor") and pair and all_dim:  # transformers' ratio of yarn_get_mscale's
        out["rope_attention_factor"] = mscale(factor, pair) / mscale(factor, all_dim)
    return {**out, **({"rope_mscale_all_dim": float(all_dim)} if all_dim else {})}


def _rope_order(hf: dict) -> np.ndarray:
    """Our rotary feature j is HF's feature order[j]: (evens, odds) with rope_interleave, else as it is."""
    r = hf["qk_rope_head_dim"]
    return np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)]) if hf.get("rope_interleave", True) else np.arange(r)


def _attention_in(hf: dict, g, order) -> dict[str, np.ndarray]:
    """One layer's attention in the shared names (under blocks.); g(name): its HF tensor."""
    h, d, k, r = hf["num_attention_heads"], hf["hidden_size"], hf["qk_nope_head_dim"], hf["qk_rope_head_dim"]
    ql, kvl = hf["q_lora_rank"], hf["kv_lora_rank"]
    q_up = g("self_attn.q_b_proj.weight").T.reshape(ql, h, k + r)
    kv_down = g("self_attn.kv_a_proj_with_mqa.weight").T
    kv_up = g("self_attn.kv_b_proj.weight").T.reshape(kvl, h, 2 * k)
    return {
        "attn.q_down.kernel": g("self_attn.q_a_proj.weight").T,
        "attn.q_norm.scale": g("self_attn.q_a_layernorm.weight"),
        "attn.q_up.kernel": np.concatenate([q_up[..., :k], q_up[..., k:][..., order]], axis=-1),
        "attn.kv_down.kernel": np.concatenate([kv_down[:, :kvl], kv_down[:, kvl:][:, order]], axis=-1),
        "attn.kv_norm.scale": g("self_attn.kv_a_layernorm.weight"),
        "attn.kv_up.kernel": np.stack([kv_up[..., :k], kv_up[..., k:]], axis=1),
        "attn.out.kernel": g("self_attn.o_proj.weight").T.reshape(h, k, d),
        "ln1.scale": g("input_layernorm.weight"),
        "ln2.scale": g("post_attention_layernorm.weight"),
    }


def _experts_in(hf: dict, g) -> dict[str, np.ndarray]:
    out = {"moe.router.kernel": g("mlp.gate.weight").T, "moe.router.bias": g("mlp.gate.e_score_correction_bias")}
    for ours, theirs in MLP.items():  # [E, out, in] -> [E, in, out]
        out[f"moe.{ours}"] = np.stack([g(f"mlp.experts.{j}.{theirs}.weight").T for j in range(hf["n_routed_experts"])])
        if hf.get("n_shared_experts"):
            out[f"moe.shared.{ours}.kernel"] = g(f"mlp.shared_experts.{theirs}.weight").T
    return out


def hf_to_shared(hf_dir: str) -> tuple[dict[str, np.ndarray], dict]:
    """-> (flat shared tensors, model config overrides)."""
    hf, raw = hf_llama.read_dir(hf_dir, check=read_config)
    L, first, order = (
        hf["num_hidden_layers"],
        min(hf.get("first_k_dense_replace", 0), hf["num_hidden_layers"]),
        _rope_order(hf),
    )
    if first < L and f"model.layers.{first}.mlp.experts.0.gate_proj.weight" not in raw:
        raise UserError(
            f"{hf_dir}: no mlp.experts.{{j}}.*_proj tensors (the Hub's names); save it with transformers' "
            "save_pretrained first"
        )
    per_layer = []
    for i in range(L):
        g = lambda name, i=i: raw[f"model.layers.{i}.{name}"]
        ff = {f"mlp.{o}.kernel": g(f"mlp.{t}.weight").T for o, t in MLP.items()} if i < first else _experts_in(hf, g)
        per_layer.append({**_attention_in(hf, g, order), **ff})
    stacks = [("dense_blocks." if first < L else "blocks.", per_layer[:first]), ("blocks.", per_layer[first:])]
    out = {"wte": raw["model.embed_tokens.weight"], "ln_f.scale": raw["model.norm.weight"]}
    if not hf.get("tie_word_embeddings", False):
        out["lm_head"] = raw["lm_head.weight"]
    for prefix, layers in (s for s in stacks if s[1]):
        out.update({prefix + name: np.stack([layer[name] for layer in layers]) for name in layers[0]})
    if "blocks.moe.router.bias" in out and not out["blocks.moe.router.bias"].any():
        del out["blocks.moe.router.bias"]  # HF's always-present bias, all zero: no bias at all
    n_group = hf.get("n_group") or 1
    settings = {
        "max_seq_len": hf.get("max_position_embeddings", 2048),
        "layernorm_eps": EPS,
        "rope_theta": hf["rope_theta"],
        **hf["rope_settings"],
        **(
            {}
            if first >= L
            else {
                "moe_top_k": hf["num_experts_per_tok"],
                "moe_router": "sigmoid",
                "moe_norm_topk": bool(hf.get("norm_topk_prob", True)),
                "moe_routed_scale": float(hf.get("routed_scaling_factor", 1.0)),
                "moe_n_group": n_group,
                "moe_topk_group": hf.get("topk_group") or 1 if n_group > 1 else 1,
            }
        ),
    }
    return {n: np.ascontiguousarray(v, dtype=np.float32) for n, v in out.items()}, model_dims(out, settings)


def _refuse(flat: dict, model: dict) -> None:
    """One line for what DeepseekV3ForCausalLM cannot hold."""
    refused = {
        "model.mtp_depth>0 (multi-token prediction modules: transformers' DeepseekV3ForCausalLM has none)": model.get(
            "mtp_depth", 0
        )
        > 0
        or any(n.startswith("mtp") for n in flat),
        "a model without experts (model.moe_experts=0: DeepSeek-V3 has them)": "blocks.moe.gate" not in flat,
        f"model.layernorm_eps={model.get('layernorm_eps')} (HF's latent norms keep {EPS})": model.get("layernorm_eps")
        != EPS,
        "model.moe_router=softmax (DeepSeek-V3 scores by sigmoid)": model.get("moe_router", "softmax") != "sigmoid",
        "model.moe_capacity_factor>0 (DeepSeek-V3 is dropless)": model.get("moe_capacity_factor", 0.0) > 0,
    }
    for what, bad in refused.items():
        if bad:
            raise UserError(f"these weights have no DeepSeek-V3 form: {what}")


def _attention_out(flat: dict, p: str, i: int, back) -> dict[str, np.ndarray]:
    """Layer i (of the stack `p`, "blocks." or "dense_blocks.") of the attention in HF's names."""
    w = lambda name: flat[p + name][i]
    ql, h, kr = w("attn.q_up.kernel").shape
    kvl, _, _, k = w("attn.kv_up.kernel").shape
    q_up, kv_down, kv_up = w("attn.q_up.kernel"), w("attn.kv_down.kernel"), w("attn.kv_up.kernel")
    q_up = np.concatenate([q_up[..., :k], q_up[..., k:][..., back]], axis=-1)
    kv_down = np.concatenate([kv_down[:, :kvl], kv_down[:, kvl:][:, back]], axis=-1)
    t = lambda a: np.ascontiguousarray(a.T)  # shared [in, out] -> HF [out, in]
    return {
        "self_attn.q_a_proj.weight": t(w("attn.q_down.kernel")),
        "self_attn.q_a_layernorm.weight": w("attn.q_norm.scale"),
        "self_attn.q_b_proj.weight": t(q_up.reshape(ql, h * kr)),
        "self_attn.kv_a_proj_with_mqa.weight": t(kv_down),
        "self_attn.kv_a_layernorm.weight": w("attn.kv_norm.scale"),
        "self_attn.kv_b_proj.weight": t(np.concatenate([kv_up[:, 0], kv_up[:, 1]], axis=-1).reshape(kvl, -1)),
        "self_attn.o_proj.weight": t(w("attn.out.kernel").reshape(h * k, -1)),
        "input_layernorm.weight": w("ln1.scale"),
        "post_attention_layernorm.weight": w("ln2.scale"),
    }


def _feed_forward_out(flat: dict, p: str, i: int) -> dict[str, np.ndarray]:
    t = lambda a: np.ascontiguousarray(a.T)
    if p + "mlp.gate.kernel" in flat:
        return {f"mlp.{theirs}.weight": t(flat[f"{p}mlp.{ours}.kernel"][i]) for ours, theirs in MLP.items()}
    E = flat[p + "moe.gate"].shape[1]
    bias = flat.get(p + "moe.router.bias")
    out = {
        "mlp.gate.weight": t(flat[p + "moe.router.kernel"][i]),
        "mlp.gate.e_score_correction_bias": np.zeros(E, np.float32) if bias is None else bias[i],
    }
    d = flat[p + "moe.gate"].shape[2]
    for ours, theirs in MLP.items():
        out.update({f"mlp.experts.{j}.{theirs}.weight": t(flat[f"{p}moe.{ours}"][i, j]) for j in range(E)})
        shared = flat.get(f"{p}moe.shared.{ours}.kernel")  # none: HF's zero-wide shared MLP (n_shared_experts=0)
        out[f"mlp.shared_experts.{theirs}.weight"] = (
            t(shared[i]) if shared is not None else np.zeros((d, 0) if ours == "down" else (0, d), np.float32)
        )
    return out


def _rope_parameters(dims: dict, theta: float) -> dict:
    """config.json's rope_parameters: Llama's; under YaRN also the cos/sin factor, named, and mscale_all_dim."""
    out = hf_llama.rope_parameters({**dims, "rope_theta": theta})
    if out["rope_type"] == "yarn":
        scale = dims.get("rope_attention_factor") or 0.0
        out["attention_factor"] = float(scale or mscale(out["factor"]))  # named, so that no mscale pair overrides it
        out.update({"mscale_all_dim": float(dims["rope_mscale_all_dim"])} if dims.get("rope_mscale_all_dim") else {})
    return out


def shared_to_hf(flat: dict[str, np.ndarray], out_dir: str, model: dict) -> None:
    """Write an HF DeepSeek-V3 directory (config.json + model.safetensors) from flat shared tensors."""
    _refuse(flat, model)
    dims = model_dims(flat, model)
    L, d, h, first = dims["n_layer"], dims["d_model"], dims["n_head"], dims.get("moe_first_dense", 0)
    r, E = dims["rope_head_dim"], dims["moe_experts"]
    back = np.argsort(np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)]))  # written with rope_interleave
    tensors = {"model.embed_tokens.weight": flat["wte"], "model.norm.weight": flat["ln_f.scale"]}
    if "lm_head" in flat:
        tensors["lm_head.weight"] = flat["lm_head"]
    for layer in range(L):
        p, i = ("dense_blocks.", layer) if layer < first else ("blocks.", layer - first)
        hf_names = {**_attention_out(flat, p, i, back), **_feed_forward_out(flat, p, i)}
        tensors.update({f"model.layers.{layer}.{n}": v for n, v in hf_names.items()})
    theta, k = float(dims.get("rope_theta", 10000.0)), d // h
    n_group = int(dims.get("moe_n_group", 1))
    config = {
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        "vocab_size": dims["vocab_size"],
        "hidden_size": d,
        "intermediate_size": dims.get("d_ff") or dims["moe_d_ff"],
        "moe_intermediate_size": dims["moe_d_ff"],
        "num_hidden_layers": L,
        "num_attention_heads": h,
        "num_key_value_heads": h,
        "n_shared_experts": int(dims.get("moe_shared_experts", 0)),
        "n_routed_experts": E,
        "routed_scaling_factor": float(dims.get("moe_routed_scale", 1.0)),
        "kv_lora_rank": dims["kv_latent_dim"],
        "q_lora_rank": dims["q_latent_dim"],
        "qk_rope_head_dim": r,
        "qk_nope_head_dim": k,
        "v_head_dim": k,
        "head_dim": r,
        "n_group": n_group,
        "topk_group": int(dims.get("moe_topk_group", 1)) if n_group > 1 else 1,
        "num_experts_per_tok": int(dims.get("moe_top_k", 2)),
        "first_k_dense_replace": first,
        "norm_topk_prob": bool(dims.get("moe_norm_topk", True)),
        "hidden_act": "silu",
        "max_position_embeddings": dims["max_seq_len"],
        "rms_norm_eps": EPS,
        "rope_parameters": _rope_parameters(dims, theta),
        "rope_interleave": True,
        "attention_bias": False,
        "tie_word_embeddings": "lm_head" not in flat,
        "num_nextn_predict_layers": 0,
        "torch_dtype": "float32",
    }
    hf_llama.write_dir(out_dir, tensors, config)
