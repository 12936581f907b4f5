"""Hugging Face Llama (`LlamaForCausalLM`: config.json + safetensors) <-> the shared weight format. numpy only.

HF keeps nn.Linear weights [out, in] with heads flattened on `out`; the shared format keeps [in, ...heads]
(jaxpar/models/llama.py). Every conversion is a transpose and a reshape, so round trips are bit-exact.
The rotary permutation: HF's Llama checkpoints already pair feature i with i + head_dim/2 (`rotate_half`),
which is jaxpar's and torchpar's rotary layout, so q and k need no permutation in either direction (Meta's
original checkpoints interleave the pairs; HF's own conversion script permutes them once, on the way in).
Sharded HF checkpoints (model-0000x-of-0000y.safetensors) are read whole.
"""

from __future__ import annotations

import glob
import json
import os

import numpy as np

from jaxpar.core.errors import UserError
from jaxpar.core.model.windows import window_at
from jaxpar.core.weights.names import model_dims, write_safetensors
from jaxpar.formats.hub_files import read_safetensors

PREFIX = "model.layers.{i}."
# shared per-layer name -> HF per-layer name (under model.layers.{i}.); MLP weights are transposed
NORMS = {"ln1.scale": "input_layernorm.weight", "ln2.scale": "post_attention_layernorm.weight"}
MLP = {
    "mlp.gate.kernel": "mlp.gate_proj.weight",
    "mlp.up.kernel": "mlp.up_proj.weight",
    "mlp.down.kernel": "mlp.down_proj.weight",
}


def read_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    with open(path) as f:
        hf = json.load(f)
    # transformers >= 5 keeps the rotary settings in rope_parameters, earlier versions in rope_theta/rope_scaling
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    refused = {
        "rope type": kind not in ("default", "yarn") and rope,
        "yarn's mscale (DeepSeek's softmax scale)": kind == "yarn"
        and (rope.get("mscale") or rope.get("mscale_all_dim")),
        "partial_rotary_factor": rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0,
        "attention_bias": hf.get("attention_bias"),
        "mlp_bias": hf.get("mlp_bias"),
    }
    for key, value in refused.items():
        if value:
            raise UserError(f"{path}: {key} {value!r} is not supported (plain or YaRN rotary positions, no biases)")
    hf["rope_theta"] = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    hf["rope_settings"] = yarn_settings(rope, hf) if kind == "yarn" else {}
    if hf.get("hidden_act", "silu") != "silu":
        raise UserError(f"{path}: hidden_act {hf['hidden_act']!r} is not Llama's silu")
    d, h = hf["hidden_size"], hf["num_attention_heads"]
    if not hf.get("head_dim") and d % h:
        raise UserError(f"{path}: hidden_size={d} is not divisible by num_attention_heads={h} and no head_dim is set")
    return hf


def yarn_settings(rope: dict, hf: dict) -> dict:
    """model.rope_* of Hugging Face's rope_parameters with rope_type yarn (jaxpar/core/model/rotary.py)."""
    original = (
        rope.get("original_max_position_embeddings")
        or hf.get("original_max_position_embeddings")
        or hf.get("max_position_embeddings", 2048)
    )
    return {
        "rope_scaling": "yarn",
        "rope_factor": float(rope.get("factor") or hf.get("max_position_embeddings", 2048) / original),
        "rope_original_max_seq_len": int(original),
        "rope_beta_fast": float(rope.get("beta_fast") or 32.0),
        "rope_beta_slow": float(rope.get("beta_slow") or 1.0),
        "rope_truncate": bool(rope.get("truncate", True)),
        "rope_attention_factor": float(rope.get("attention_factor") or 0.0),
    }


def rope_parameters(dims: dict) -> dict:
    """config.json's rope_parameters of model config keys: default, or yarn (yarn_settings' inverse)."""
    theta = float(dims.get("rope_theta", 10000.0))
    if dims.get("rope_scaling", "none") != "yarn":
        return {"rope_type": "default", "rope_theta": theta}
    out = {
        "rope_type": "yarn",
        "rope_theta": theta,
        "factor": float(dims["rope_factor"]),
        "original_max_position_embeddings": int(dims.get("rope_original_max_seq_len") or dims["max_seq_len"]),
        "beta_fast": float(dims.get("rope_beta_fast", 32.0)),
        "beta_slow": float(dims.get("rope_beta_slow", 1.0)),
        "truncate": bool(dims.get("rope_truncate", True)),
    }
    return {**out, **({"attention_factor": dims["rope_attention_factor"]} if dims.get("rope_attention_factor") else {})}


def window_settings(kinds: list[str], window: int, where: str) -> dict:
    """Hugging Face's layer_types (with its sliding_window) as model.sliding_window and model.full_attention_every.

    {} when no layer slides; every layer sliding, or every N-th full (gpt-oss's alternation: N=2), is ours; any other
    mix is refused in one line naming `where`.
    """
    slides = [kind == "sliding_attention" for kind in kinds]
    if set(kinds) - {"sliding_attention", "full_attention"}:
        raise UserError(
            f"{where}: layer types {sorted(set(kinds))}: only sliding_attention and full_attention exist here"
        )
    if not any(slides) or not window:
        return {}
    every = 0 if all(slides) else slides.index(False) + 1
    if every == 1 or slides != [not every or (i + 1) % every != 0 for i in range(len(kinds))]:
        raise UserError(
            f"{where}: layer types {kinds}: jaxpar's layers slide except every N-th, which attends to the whole "
            "context (model.full_attention_every), and this mix is not of that form"
        )
    return {"sliding_window": window, **({"full_attention_every": every} if every else {})}


def layer_types(model: dict, L: int) -> list[str]:
    """Hugging Face's layer_types of a model config dict's sliding_window and full_attention_every."""
    window, every = int(model.get("sliding_window") or 0), int(model.get("full_attention_every") or 0)
    return ["sliding_attention" if window_at(i, window, every) else "full_attention" for i in range(L)]


def read_dir(hf_dir: str, check=read_config) -> tuple[dict, dict[str, np.ndarray]]:
    """(config.json checked by `check`, every tensor) of an HF Llama-like directory (sharded files read whole)."""
    hf = check(hf_dir)
    files = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
    if not files:
        raise UserError(f"not a Hugging Face {hf.get('model_type', 'llama')} directory: no *.safetensors in {hf_dir}")
    return hf, {k: v for f in files for k, v in read_safetensors(f).items()}


def layers(raw: dict, L: int, name: str) -> np.ndarray:
    """A per-layer HF tensor stacked over the L layers."""
    return np.stack([raw[PREFIX.format(i=i) + name] for i in range(L)])


def hf_to_shared(hf_dir: str, mlp=None, check=read_config, first_dense: int = 0) -> tuple[dict[str, np.ndarray], dict]:
    """Read an HF Llama directory -> (flat shared tensors, model config overrides).

    `mlp(hf, raw)`: the shared feed-forward tensors of another layout of it (Mixtral's experts: hf_mixtral.py), else
    Llama's MLP; `check`: its config.json's reader. `first_dense`: the first layers whose feed-forward is dense when
    the others' are experts (Qwen3-MoE's mlp_only_layers): their attention and norms go to the dense_blocks stack,
    where `mlp` puts their MLP. The attention's q_norm / k_norm (Qwen3's) are read where the checkpoint has them.
    """
    hf, raw = read_dir(hf_dir, check)
    L, d, h = hf["num_hidden_layers"], hf["hidden_size"], hf["num_attention_heads"]
    g, k = hf.get("num_key_value_heads") or h, hf.get("head_dim") or d // h
    tied = hf.get("tie_word_embeddings", False)
    out = {"wte": raw["model.embed_tokens.weight"], "ln_f.scale": raw["model.norm.weight"]}
    if not tied:
        out["lm_head"] = raw["lm_head.weight"]
    out.update({f"blocks.{ours}": layers(raw, L, theirs) for ours, theirs in NORMS.items()})
    if mlp is None:
        out.update({f"blocks.{ours}": layers(raw, L, theirs).transpose(0, 2, 1) for ours, theirs in MLP.items()})
    else:
        out.update(mlp(hf, raw))
    out["blocks.attn.q.kernel"] = layers(raw, L, "self_attn.q_proj.weight").transpose(0, 2, 1).reshape(L, d, h, k)
    kv = [layers(raw, L, f"self_attn.{n}_proj.weight").transpose(0, 2, 1).reshape(L, d, g, k) for n in "kv"]
    out["blocks.attn.kv.kernel"] = np.stack(kv, axis=2)
    out["blocks.attn.out.kernel"] = layers(raw, L, "self_attn.o_proj.weight").transpose(0, 2, 1).reshape(L, h, k, d)
    if PREFIX.format(i=0) + "self_attn.q_norm.weight" in raw:  # Qwen3's per-head query and key norms
        out.update({f"blocks.attn.{n}_norm.scale": layers(raw, L, f"self_attn.{n}_norm.weight") for n in "qk"})
    if PREFIX.format(i=0) + "self_attn.q_proj.bias" in raw:  # gpt-oss's projection biases
        out["blocks.attn.q.bias"] = layers(raw, L, "self_attn.q_proj.bias").reshape(L, h, k)
        out["blocks.attn.kv.bias"] = np.stack(
            [layers(raw, L, f"self_attn.{n}_proj.bias").reshape(L, g, k) for n in "kv"], 1
        )
        out["blocks.attn.out.bias"] = layers(raw, L, "self_attn.o_proj.bias")
    if PREFIX.format(i=0) + "self_attn.sinks" in raw:  # gpt-oss's attention sinks
        out["blocks.attn.sinks"] = layers(raw, L, "self_attn.sinks")
    if first_dense:  # the dense first layers' attention and norms: a stack of their own (names.layer_stacks)
        for name in [n for n in out if n.startswith(("blocks.attn.", "blocks.ln"))]:
            stacked = out.pop(name)
            out["dense_" + name], out[name] = stacked[:first_dense], stacked[first_dense:]
    settings = {
        "max_seq_len": hf.get("max_position_embeddings", 2048),
        "layernorm_eps": hf.get("rms_norm_eps", 1e-6),
        "rope_theta": hf["rope_theta"],
        **hf["rope_settings"],
    }
    return {n: np.ascontiguousarray(v, dtype=np.float32) for n, v in out.items()}, model_dims(out, settings)


def shared_to_hf(flat: dict[str, np.ndarray], out_dir: str, model: dict, mlp=None, config=None) -> None:
    """Write an HF Llama directory (config.json + model.safetensors) from flat shared tensors.

    `mlp(flat, i)`: layer i's HF feed-forward tensors and `config`: config.json entries of another layout of it
    (hf_mixtral.py).
    """
    dims = model_dims(flat, model)
    L, d, h, g = dims["n_layer"], dims["d_model"], dims["n_head"], dims["n_kv_head"]
    theta = float(dims.get("rope_theta", 10000.0))
    t = lambda a: np.ascontiguousarray(a.T)  # shared [in, out] -> HF [out, in]
    tensors = {"model.embed_tokens.weight": flat["wte"], "model.norm.weight": flat["ln_f.scale"]}
    if "lm_head" in flat:
        tensors["lm_head.weight"] = flat["lm_head"]
    every = whole_depth(flat)
    for i in range(L):
        p = PREFIX.format(i=i)
        tensors.update({p + theirs: every[f"blocks.{ours}"][i] for ours, theirs in NORMS.items()})
        if mlp is None:
            tensors.update({p + theirs: t(flat[f"blocks.{ours}"][i]) for ours, theirs in MLP.items()})
        else:
            tensors.update({p + theirs: value for theirs, value in mlp(flat, i).items()})
        tensors[p + "self_attn.q_proj.weight"] = t(every["blocks.attn.q.kernel"][i].reshape(d, -1))
        for j, n in enumerate("kv"):
            tensors[p + f"self_attn.{n}_proj.weight"] = t(every["blocks.attn.kv.kernel"][i, :, j].reshape(d, -1))
        tensors[p + "self_attn.o_proj.weight"] = t(every["blocks.attn.out.kernel"][i].reshape(-1, d))
        if "blocks.attn.k_norm.scale" in every:  # model.qk_norm (Qwen3's)
            tensors.update({p + f"self_attn.{n}_norm.weight": every[f"blocks.attn.{n}_norm.scale"][i] for n in "qk"})
        if "blocks.attn.q.bias" in every:  # model.attention_bias (gpt-oss's)
            tensors[p + "self_attn.q_proj.bias"] = every["blocks.attn.q.bias"][i].reshape(-1)
            for j, n in enumerate("kv"):
                tensors[p + f"self_attn.{n}_proj.bias"] = every["blocks.attn.kv.bias"][i, j].reshape(-1)
            tensors[p + "self_attn.o_proj.bias"] = every["blocks.attn.out.bias"][i]
        if "blocks.attn.sinks" in every:  # model.attention_sinks (gpt-oss's)
            tensors[p + "self_attn.sinks"] = every["blocks.attn.sinks"][i]
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": dims["vocab_size"],
        "hidden_size": d,
        "intermediate_size": dims.get("d_ff"),
        "num_hidden_layers": L,
        "num_attention_heads": h,
        "num_key_value_heads": g,
        "head_dim": flat["blocks.attn.q.kernel"].shape[-1],
        "hidden_act": "silu",
        "max_position_embeddings": dims["max_seq_len"],
        "rms_norm_eps": dims.get("layernorm_eps", 1e-5),
        "rope_theta": theta,
        "rope_parameters": rope_parameters(dims),
        "tie_word_embeddings": "lm_head" not in flat,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        **(config or {}),
    }
    write_dir(out_dir, tensors, config)


def whole_depth(flat: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The attention's and norms' "blocks.*" tensors over every layer: dense_blocks' (moe_first_dense) joined first."""
    names = [n for n in flat if n.startswith(("blocks.attn.", "blocks.ln"))]
    if "dense_blocks.ln1.scale" not in flat:
        return {n: flat[n] for n in names}
    return {n: np.concatenate([flat["dense_" + n], flat[n]]) for n in names}


def write_dir(out_dir: str, tensors: dict[str, np.ndarray], config: dict) -> None:
    """config.json and model.safetensors (float32, written atomically) into out_dir."""
    write_safetensors(
        os.path.join(out_dir, "model.safetensors"),
        {n: np.ascontiguousarray(v, dtype=np.float32) for n, v in tensors.items()},
        {"format": "pt"},
    )
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
