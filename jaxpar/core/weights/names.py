"""The shared weight file: safetensors, one tensor per jaxpar parameter path ("blocks.mlp.fc.kernel").

jaxpar's own names and shapes *are* the shared format; `NAMES` below is the one table mapping them to
torchpar's per-layer parameter names (torchpar/weights.py converts by it).
Pure numpy, no jax: both trainers read and write it.
"""

from __future__ import annotations

import json
import os

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from jaxpar.core.config.schema import ModelConfig
from jaxpar.core.errors import UserError


def flatten(tree: dict, prefix: str = "") -> dict:
    """{"blocks": {"mlp": {"fc": {"kernel": x}}}} -> {"blocks.mlp.fc.kernel": x} (leaves untouched)."""
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        out.update(flatten(value, name + ".") if isinstance(value, dict) else {name: value})
    return out


def unflatten(flat: dict[str, np.ndarray]) -> dict:
    tree: dict = {}
    for name, value in flat.items():
        node = tree
        *parents, leaf = name.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


# What the tensors' shapes cannot tell, kept in the file's metadata (json under "model") so that a file
# alone rebuilds its model (the sampling commands, conversion): llama's context length, rotary base, eps.
SETTINGS = (
    "max_seq_len",
    "layernorm_eps",
    "rope_theta",
    "sliding_window",
    "full_attention_every",
    "rope_scaling",
    "rope_factor",
    "rope_original_max_seq_len",
    "rope_beta_fast",
    "rope_beta_slow",
    "rope_truncate",
    "rope_attention_factor",
    "rope_mscale_all_dim",
    "moe_top_k",
    "moe_shared_experts",
    "moe_router",
    "moe_norm_topk",
    "moe_capacity_factor",
    "moe_aux_loss",
    "moe_bias_update",
    "moe_n_group",
    "moe_topk_group",
    "moe_routed_scale",
    "moe_activation",
    "moe_swiglu_limit",
    "moe_swiglu_alpha",
)


def write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """Writes a safetensors file atomically (temp file + rename).

    The file is readable as the umask allows any new file (the library's own files are its owner's alone: weights are
    often shared).
    """
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.tmp{os.getpid()}")
    save_file(tensors, tmp, metadata=metadata)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    os.replace(tmp, path)


def save_weights(path: str, params: dict, model: dict | None = None) -> None:
    """Write float32 weights; `model`: config keys, SETTINGS are kept."""
    flat = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in flatten(params).items()}
    settings = {k: model[k] for k in SETTINGS if k in model} if model else {}
    write_safetensors(path, flat, {"model": json.dumps(settings)})


def read_settings(path: str) -> dict:
    """The SETTINGS a weights file was written with ({} for files from elsewhere)."""
    with safe_open(path, "np") as f:
        return json.loads((f.metadata() or {}).get("model", "{}"))


def read_weights(path: str) -> dict[str, np.ndarray]:
    """Flat {name: array} of a shared weights file, as it is."""
    if not os.path.exists(path):
        raise UserError(f"weights file not found: {path}")
    try:
        return load_file(path)
    except Exception as e:  # noqa: BLE001 - any unreadable file is bad input
        raise UserError(f"weights file {path} is not a readable safetensors file: {e}") from None


def load_weights(path: str, expected_shapes: dict[str, tuple]) -> dict[str, np.ndarray]:
    """Flat {name: array}, checked name-for-name and shape-for-shape against the model."""
    flat = read_weights(path)
    missing = sorted(set(expected_shapes) - set(flat))
    extra = sorted(set(flat) - set(expected_shapes))
    if missing or extra:
        raise UserError(f"weights file {path} does not match the model: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, shape in expected_shapes.items():
        if tuple(flat[name].shape) != tuple(shape):
            raise UserError(
                f"weights file {path}: {name} has shape {tuple(flat[name].shape)}, model expects {tuple(shape)}"
            )
    return flat


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
# model.family=llama (jaxpar/models/llama.py): no biases, no position table, an untied head if asked
LLAMA_NAMES = {
    "lm_head": "lm_head",
    **{f"blocks.attn.{n}.kernel": f"blocks.{{l}}.attn.{n}.weight" for n in ("q", "kv")},
    **{f"blocks.attn.{n}.bias": f"blocks.{{l}}.attn.{n}.bias" for n in ("q", "kv")},  # model.attention_bias
    "blocks.attn.sinks": "blocks.{l}.attn.sinks",  # model.attention_sinks
    **{f"blocks.mlp.{n}.kernel": f"blocks.{{l}}.mlp.{n}.weight" for n in ("gate", "up", "down")},
}
# model variants (jaxpar/models/{mla,sketched}.py, model.qk_norm): their parameters beside or instead of GPT-2's
VARIANT_NAMES = {
    **{f"blocks.attn.{n}.kernel": f"blocks.{{l}}.attn.{n}.weight" for n in ("q_down", "q_up", "kv_down", "kv_up")},
    "blocks.attn.q_norm.scale": "blocks.{l}.attn.q_norm.weight",
    "blocks.attn.kv_norm.scale": "blocks.{l}.attn.kv_norm.weight",
    "blocks.attn.k_norm.scale": "blocks.{l}.attn.k_norm.weight",  # model.qk_norm (its queries': q_norm, as mla's)
    "blocks.mlp.fc.factor": "blocks.{l}.mlp.fc.factor",
    "blocks.mlp.proj.factor": "blocks.{l}.mlp.proj.factor",
}
# a mixture of experts (jaxpar/models/moe.py): the router, each expert's SwiGLU stacked on an experts axis, the shared
MOE_NAMES = {
    "blocks.moe.router.kernel": "blocks.{l}.moe.router.weight",
    "blocks.moe.router.bias": "blocks.{l}.moe.router.bias",
    **{f"blocks.moe.{n}": f"blocks.{{l}}.moe.experts.{n}" for n in ("gate", "up", "down")},
    # model.moe_expert_bias (gpt-oss): each expert's biases and the router's logit bias
    **{f"blocks.moe.{n}_bias": f"blocks.{{l}}.moe.experts.{n}_bias" for n in ("gate", "up", "down")},
    "blocks.moe.router.logit_bias": "blocks.{l}.moe.router.logit_bias",
    **{f"blocks.moe.shared.{n}.kernel": f"blocks.{{l}}.moe.shared.{n}.weight" for n in ("gate", "up", "down")},
}
# multi-token prediction (model.mtp_depth; jaxpar/models/decoder.py MTP): "{l}" is the depth; its dense block is
# named as a layer's
MTP_NAMES = {
    **{
        f"mtp.{n}.{p}": f"mtp.{{l}}.{n}.{t}"
        for n in ("norm_emb", "norm_hidden", "norm_out")
        for p, t in (("scale", "weight"), ("bias", "bias"))
    },
    "mtp.proj.kernel": "mtp.{l}.proj.weight",
    **{
        "mtp.block." + k.removeprefix("blocks."): "mtp.{l}.block." + v.removeprefix("blocks.{l}.")
        for k, v in {**NAMES, **LLAMA_NAMES, **VARIANT_NAMES}.items()
        if k.startswith("blocks.")
    },
}
ALL_NAMES = {**NAMES, **LLAMA_NAMES, **VARIANT_NAMES, **MOE_NAMES, **MTP_NAMES}


def layer_stacks(first_dense: int, n_layer: int) -> list[tuple[str, range]]:
    """The shared format's layer stacks as (name prefix, torch layer indices).

    model.moe_first_dense's dense layers ("dense_blocks.*", named as a dense model's "blocks.*") come before the rest
    ("blocks.*").
    """
    return ([("dense_blocks.", range(first_dense))] if first_dense else []) + [("blocks.", range(first_dense, n_layer))]


def stacks_of(shared: str, first_dense: int, n_layer: int, mtp_depth: int) -> list[tuple[str, range]]:
    """layer_stacks for a per-layer name of ALL_NAMES; multi-token prediction's ("mtp.*") stack its depths."""
    if shared.startswith("mtp."):
        return [("", range(mtp_depth))] if mtp_depth else []
    return layer_stacks(first_dense, n_layer)


def stacked_name(prefix: str, shared: str) -> str:
    """ALL_NAMES' "blocks.mlp.fc.kernel" as the name in the stack of `prefix` (layer_stacks)."""
    return prefix + shared.removeprefix("blocks.")


def shared_name(torch_name: str) -> str:
    """A torch parameter's name to the shared one: "blocks.3.mlp.fc.weight" -> "blocks.mlp.fc.kernel"."""
    parts = torch_name.split(".")
    pattern = ".".join("{l}" if p.isdigit() else p for p in parts)
    for shared, t in ALL_NAMES.items():
        if t == pattern:
            return shared
    raise KeyError(f"no shared name for torch parameter {torch_name!r}")


def model_dims(flat: dict[str, np.ndarray], settings: dict | None = None) -> dict:
    """Model config keys read off the shared tensors, then off `settings`.

    The tensors themselves tell GPT-2 (with MHA/dense layers) or llama and their sizes; `settings` (read_settings) gives
    what shapes cannot tell.
    """
    depth = {"mtp_depth": flat["mtp.proj.kernel"].shape[0]} if "mtp.proj.kernel" in flat else {}
    if "blocks.attn.q.kernel" in flat or ("blocks.attn.q_down.kernel" in flat and "wpe" not in flat):
        dims = {
            "family": "llama",
            **_llama_attention(flat),
            "vocab_size": flat["wte"].shape[0],
            "tie_embeddings": "lm_head" not in flat,
            **depth,
        }
        if "blocks.moe.gate" in flat:  # a mixture of experts (Mixtral, DeepSeek-V3): [L, experts, embed, width]
            _, experts, _, width = flat["blocks.moe.gate"].shape
            dims.update(moe_experts=experts, moe_d_ff=width)
            if "blocks.moe.gate_bias" in flat:  # gpt-oss's
                dims["moe_expert_bias"] = True
        if "blocks.moe.shared.gate.kernel" in flat:  # one SwiGLU as wide as the shared experts
            dims["moe_shared_experts"] = flat["blocks.moe.shared.gate.kernel"].shape[-1] // dims["moe_d_ff"]
        if "dense_blocks.mlp.gate.kernel" in flat:  # model.moe_first_dense's dense layers before the experts'
            first, _, dims["d_ff"] = flat["dense_blocks.mlp.gate.kernel"].shape
            dims.update(moe_first_dense=first, n_layer=dims["n_layer"] + first)
        elif "blocks.mlp.gate.kernel" in flat:
            dims["d_ff"] = flat["blocks.mlp.gate.kernel"].shape[-1]
        dims = {"max_seq_len": ModelConfig.max_seq_len, **dims, **(settings or {})}  # the default, unless kept
        if "blocks.moe.router.bias" in flat and not dims.get("moe_bias_update"):  # a fixed bias (DeepSeek-V3's)
            dims["moe_router_bias"] = True
        return dims
    if "blocks.attn.qkv.kernel" not in flat or "blocks.mlp.fc.kernel" not in flat:
        raise UserError(
            "these weights use a model variant (model.attention=mla, model.linear=sketched or GPT-2 with "
            "experts); conversion supports only GPT-2's parameters (mha attention, dense linear layers)"
        )
    n_layer, d, _, n_head, _ = flat["blocks.attn.qkv.kernel"].shape
    return {
        **(settings or {}),
        "n_layer": n_layer,
        "d_model": d,
        "n_head": n_head,
        "vocab_size": flat["wte"].shape[0],
        "max_seq_len": flat["wpe"].shape[0],
        "d_ff": flat["blocks.mlp.fc.kernel"].shape[-1],
        **depth,
    }


def _llama_attention(flat: dict[str, np.ndarray]) -> dict:
    """The attention's config keys of llama-family tensors: grouped-query, or multi-head latent (DeepSeek-V3)."""
    if "blocks.attn.q.kernel" in flat:
        n_layer, d, n_head, k = flat["blocks.attn.q.kernel"].shape
        return {
            "n_layer": n_layer,
            "d_model": d,
            "n_head": n_head,
            "n_kv_head": flat["blocks.attn.kv.kernel"].shape[3],
            **({"head_dim": k} if k * n_head != d else {}),  # Qwen3's own width
            **({"qk_norm": True} if "blocks.attn.k_norm.scale" in flat else {}),
            **({"attention_bias": True} if "blocks.attn.q.bias" in flat else {}),
            **({"attention_sinks": True} if "blocks.attn.sinks" in flat else {}),
        }
    n_layer, d, q_latent = flat["blocks.attn.q_down.kernel"].shape
    _, kv_latent, _, n_head, k = flat["blocks.attn.kv_up.kernel"].shape
    return {
        "n_layer": n_layer,
        "d_model": d,
        "n_head": n_head,
        "attention": "mla",
        "q_latent_dim": q_latent,
        "kv_latent_dim": kv_latent,
        "rope_head_dim": flat["blocks.attn.q_up.kernel"].shape[-1] - k,
    }
