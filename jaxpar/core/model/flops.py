"""Parameter counts and training FLOPs by formula (no model is built), and datasheet peaks for MFU.

The counts follow the shared weight format of every variant (jaxpar/core/weights/names.py); a test
checks them against the parameters the Flax model actually creates.
"""

from __future__ import annotations

from jaxpar.core.config.schema import ModelConfig
from jaxpar.core.model.layer_rules import sketch_dim
from jaxpar.core.model.windows import mean_keys

# Dense datasheet peaks (FLOP/s per device); float32 matmuls run as TF32 on these GPUs by default.
PEAK_FLOPS = {
    ("H100", "bfloat16"): 989e12,
    ("H100", "float32"): 494.5e12,
    ("H200", "bfloat16"): 989e12,
    ("H200", "float32"): 494.5e12,
    ("A100", "bfloat16"): 312e12,
    ("A100", "float32"): 156e12,
}


def _attention_params(m: ModelConfig) -> int:
    d, hk = m.d_model, m.n_head * m.head_width
    if m.family == "llama" and m.attention != "mla":  # q, grouped k and v, out, the q/k norms, gpt-oss's biases, sinks
        kv = 2 * m.kv_heads * m.head_width
        extras = (2 * m.head_width if m.qk_norm else 0) + ((hk + kv + d) if m.attention_bias else 0)
        return d * hk + d * kv + hk * d + extras + (m.n_head if m.attention_sinks else 0)
    out = hk * d + (d if m.family == "gpt2" else 0)  # llama's mla: no out bias
    if m.attention != "mla":  # mha and dilated share GPT-2's qkv projection
        return d * 3 * hk + 3 * hk + out
    ql, kvl, r = m.q_latent_dim, m.kv_latent_dim, m.rope_head_dim
    return d * ql + ql + ql * m.n_head * (m.head_width + r) + d * (kvl + r) + kvl + kvl * 2 * hk + out


def _mlp_params(m: ModelConfig, active: bool = False) -> int:
    """Every layer's feed-forward parameters.

    With experts, `active`: those one token runs through (its top_k experts, the shared ones and the router), else
    all of them.
    """
    d = m.d_model
    routed = m.moe_top_k if active else m.moe_experts
    experts = 3 * d * m.expert_dim * (routed + m.moe_shared_experts) + d * m.moe_experts  # SwiGLUs and the router
    experts += m.moe_experts if m.router_bias else 0  # the router's balance bias
    experts += (routed * (2 * m.expert_dim + d) + m.moe_experts) if m.moe_expert_bias else 0  # gpt-oss's biases
    return m.moe_layers * experts + (m.n_layer - m.moe_layers) * _dense_mlp_params(m)


def _dense_mlp_params(m: ModelConfig) -> int:
    d, f = m.d_model, m.ff_dim
    if m.family == "llama":  # SwiGLU: gate, up, down; no biases
        return 3 * d * f
    fc_in, proj_in = (sketch_dim(m, d), sketch_dim(m, f)) if m.linear == "sketched" else (d, f)
    return fc_in * f + f + proj_in * d + d


def _mtp_params(m: ModelConfig, norm: int) -> int:
    """Multi-token prediction's modules (model.mtp_depth).

    Per depth three norms, the [2, embed, embed] projection and a dense block.
    """
    return m.mtp_depth * (5 * norm + 2 * m.d_model**2 + _attention_params(m) + _dense_mlp_params(m))


def count_params(m: ModelConfig, active: bool = False) -> dict[str, int]:
    """Total parameters and those outside the token and position embeddings (and an untied head).

    `active`: with experts, those one token runs through (what its FLOPs count).
    """
    norm = m.d_model if m.family == "llama" else 2 * m.d_model  # RMSNorm: scale; LayerNorm: scale and bias
    non_embedding = m.n_layer * (2 * norm + _attention_params(m)) + _mlp_params(m, active) + norm  # + final norm
    non_embedding += _mtp_params(m, norm)
    tables = 1 + (not m.tie_embeddings)  # token embedding, and the output head when untied
    positions = m.max_seq_len if m.family == "gpt2" else 0
    return {"total": non_embedding + (tables * m.vocab_size + positions) * m.d_model, "non_embedding": non_embedding}


def params_phrase(m: ModelConfig, n: int) -> str:
    """The start-up line's "N params"; with experts also the parameters one token runs through."""
    if not m.moe_experts:
        return f"{n:,} params"
    return f"{n:,} params ({count_params(m, active=True)['total']:,} active per token)"


def optimizer_phrase(name: str, held: list[int], holder: str) -> str:
    """The start-up line's optimizer state per device or rank, e.g. "adamw8bit state 1.2 MiB per device".

    `held` the bytes of optimizer state on each device or rank (a range where they differ).
    """
    low, high = min(held) / 2**20, max(held) / 2**20
    return f"{name} state {low:.1f}" + (f"-{high:.1f}" if f"{low:.1f}" != f"{high:.1f}" else "") + f" MiB per {holder}"


def flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 * (non-embedding params + output head) + attention 12*L*T*(heads x head width).

    With experts the parameters a token runs through (its top_k experts, not all), so MFU counts no idle expert;
    with multi-token prediction each depth's block, its attention and its pass through the shared head too; with a
    sliding window, the keys a token reads: T becomes min(T, window), averaged over the layers (mean_keys).
    """
    n = count_params(m, active=True)["non_embedding"] + (1 + m.mtp_depth) * m.vocab_size * m.d_model
    # the main layers' keys, then the prediction modules' (their blocks slide as a layer 0 does)
    keys = m.n_layer * mean_keys(m, seq_len) + m.mtp_depth * min(seq_len, m.sliding_window or seq_len)
    return 6 * n + 12 * keys * m.n_head * m.head_width


def peak_flops(device_kind: str, dtype: str) -> float | None:
    for (kind, dt), peak in PEAK_FLOPS.items():
        if kind in device_kind and dt == dtype:
            return peak
    return None  # unknown (e.g. CPU): MFU is reported as null
