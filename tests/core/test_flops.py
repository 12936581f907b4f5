"""Formula parameter counts equal the parameters the Flax model creates.

Parameter counts by formula (jaxpar/core/model/flops.py, what MFU and the planner use, torch-free) equal the parameters
the Flax model creates, for every variant.
"""

import math

import jax
import pytest

from jaxpar.core.model.flops import count_params, flops_per_token
from jaxpar.models.decoder import abstract_model
from tests.helpers import tiny_config

VARIANTS = {
    "mha": (),
    "mla": ("model.attention=mla", "model.q_latent_dim=16", "model.kv_latent_dim=8", "model.rope_head_dim=4"),
    "dilated": ("model.attention=dilated",),
    "sketched": ("model.linear=sketched", "model.sketch_ratio=0.3"),
    "d_ff": ("model.d_ff=40", "model.vocab_size=300"),
    "llama": ("model.family=llama", "model.n_kv_head=2", "model.tie_embeddings=false", "model.d_ff=40"),
    "llama_tied_rounded": ("model.family=llama", "model.n_kv_head=1", "model.ffn_multiple_of=16"),
    "moe": ("model.moe_experts=6", "model.moe_shared_experts=2", "model.moe_d_ff=24"),
    "mla_moe": (
        *("model.attention=mla", "model.q_latent_dim=16", "model.kv_latent_dim=8", "model.rope_head_dim=4"),
        "model.moe_experts=4",
        "model.family=gpt2",
    ),
    "first_dense": (
        "model.family=llama",
        "model.n_layer=3",
        "model.moe_first_dense=1",
        "model.d_ff=40",
        "model.moe_experts=4",
        "model.moe_d_ff=24",
    ),
    "deepseek_v3": (
        "model.family=llama",
        "model.attention=mla",
        "model.q_latent_dim=16",
        "model.kv_latent_dim=8",
        "model.rope_head_dim=4",
        "model.n_layer=3",
        "model.moe_first_dense=1",
        "model.d_ff=40",
        "model.moe_experts=4",
        "model.moe_d_ff=24",
        "model.moe_shared_experts=1",
        "model.moe_router_bias=true",
        "model.tie_embeddings=false",
    ),
    "mtp": ("model.mtp_depth=2",),
    "qwen3": ("model.family=llama", "model.n_kv_head=2", "model.head_dim=12", "model.qk_norm=true", "model.d_ff=40"),
    "gpt_oss_moe": (
        "model.family=llama",
        "model.moe_experts=4",
        "model.moe_d_ff=24",
        "model.moe_expert_bias=true",
        "model.moe_activation=gpt_oss",
    ),
    "gpt_oss_attention": (
        "model.family=llama",
        "model.n_kv_head=2",
        "model.attention_bias=true",
        "model.attention_sinks=true",
    ),
    "mtp_llama_moe": (
        "model.family=llama",
        "model.n_kv_head=2",
        "model.d_ff=40",
        "model.moe_experts=4",
        "model.moe_d_ff=24",
        "model.mtp_depth=1",
    ),
}


@pytest.mark.parametrize("name", VARIANTS)
def test_formula_counts_the_models_parameters(name):
    cfg = tiny_config(*VARIANTS[name]).model
    _, _, params = abstract_model(cfg)
    total = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    embeddings = sum(math.prod(params[k].shape) for k in ("wte", "wpe", "lm_head") if k in params)
    assert count_params(cfg) == {"total": total, "non_embedding": total - embeddings}


def test_flops_per_token_textbook():
    """GPT-2 small has HF's 124,439,808 parameters.

    6 N (non-embedding + tied head) + 12 L T d at T=1024 is 6 * 123.5M + 12 * 12 * 1024 * 768 = ~0.854 GFLOP per
    token.
    """
    cfg = tiny_config(
        "model.n_layer=12",
        "model.n_head=12",
        "model.d_model=768",
        "model.vocab_size=50257",
        "model.max_seq_len=1024",
        "data.seq_len=1024",
    ).model
    assert count_params(cfg)["total"] == 124_439_808
    assert 0.85e9 < flops_per_token(cfg, 1024) < 0.86e9


def test_llama_3_2_1b_count():
    """configs/llama-1b.yaml has Llama 3.2 1B's shape: Meta's model card and HF count 1,235,814,400 parameters."""
    from jaxpar.core.config.schema import load_config
    from tests.helpers import ROOT

    assert count_params(load_config(f"{ROOT}/configs/llama-1b.yaml").model)["total"] == 1_235_814_400


def test_llama_3b_preset_counts_as_llama_3_2_3b():
    """configs/llama-3b.yaml has Llama 3.2 3B's shape: Meta's model card and HF count 3,212,749,824 parameters."""
    from jaxpar.core.config.schema import load_config
    from tests.helpers import ROOT

    assert count_params(load_config(f"{ROOT}/configs/llama-3b.yaml").model)["total"] == 3_212_749_824


def test_flops_count_the_experts_a_token_runs_through():
    """Top-2 of 8 experts (width 16) and one shared.

    A token's feed-forward runs 3 experts' SwiGLUs (3 x 3 x d x 16) and the router (d x 8), not the 9 experts'
    weights the model holds.
    """
    cfg = tiny_config(
        "model.family=llama",
        "model.moe_experts=8",
        "model.moe_top_k=2",
        "model.moe_shared_experts=1",
        "model.moe_d_ff=16",
    ).model
    d, L = cfg.d_model, cfg.n_layer
    gap = count_params(cfg)["total"] - count_params(cfg, active=True)["total"]
    assert gap == L * 6 * 3 * d * 16  # the 6 experts a token skips, per layer
    dense = tiny_config("model.family=llama", "model.d_ff=48").model  # one SwiGLU as wide as the 3 a token runs
    assert flops_per_token(cfg, 16) - flops_per_token(dense, 16) == 6 * L * d * 8  # the router alone


def test_attention_flops_count_heads_of_their_own_width_and_the_keys_a_window_leaves():
    """Qwen3's heads (4 x 12 = 48 on d_model 32) and a sliding window of 4 on rows of 16: 12 L T (heads x width).

    The same model with heads of d_model / n_head differs by 12 L T x 16 per token; the window by 12 L x 12 x 48, and
    by half of that when every second layer is full (model.full_attention_every=2).
    """
    qwen3 = ("model.family=llama", "model.head_dim=12", "model.d_ff=40")
    wide, plain = tiny_config(*qwen3).model, tiny_config("model.family=llama", "model.d_ff=40").model
    L, T = wide.n_layer, 16
    params = count_params(wide, active=True)["non_embedding"] - count_params(plain, active=True)["non_embedding"]
    assert flops_per_token(wide, T) - flops_per_token(plain, T) == 6 * params + 12 * L * T * (48 - 32)
    windowed = tiny_config(*qwen3, "model.sliding_window=4").model
    assert flops_per_token(wide, T) - flops_per_token(windowed, T) == 12 * L * (T - 4) * 48
    alternating = tiny_config(*qwen3, "model.sliding_window=4", "model.full_attention_every=2").model
    assert flops_per_token(wide, T) - flops_per_token(alternating, T) == 12 * (L // 2) * (T - 4) * 48
