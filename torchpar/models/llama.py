"""Llama's block components (model.family=llama) in PyTorch.

They have jaxpar's math and per-layer parameter shapes (jaxpar/models/llama.py): grouped-query attention with rotary
positions, SwiGLU. torchpar/models/decoder.py assembles them (with layers.RMSNorm) into the same decoder as GPT-2.
No parallelism here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from jaxpar.core.config.schema import ModelConfig
from jaxpar.core.model.layer_rules import block_sparsity
from jaxpar.core.model.rotary import yarn
from torchpar.models.dilated import dilated_attention
from torchpar.models.layers import Dense, Kernel, RMSNorm, rope
from torchpar.ops import causal_attention


def repeat_kv(t, n_head: int):
    """[batch, kv_heads, seq, kv] -> [batch, n_head, seq, kv]: query head i reads kv head i // group."""
    return t.repeat_interleave(n_head // t.shape[1], dim=1)


class GQAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, h, g, k = cfg.d_model, cfg.n_head, cfg.kv_heads, cfg.head_width
        if cfg.attention_bias:  # gpt-oss: biases on every projection
            self.q, self.kv, self.out = Dense((d, h, k), (h, k)), Dense((d, 2, g, k), (2, g, k)), Dense((h, k, d), (d,))
        else:
            self.q, self.kv, self.out = Kernel((d, h, k)), Kernel((d, 2, g, k)), Kernel((h, k, d))
        # gpt-oss: a logit per head beside the scores (torchpar/ops.py causal_attention)
        self.sinks = nn.Parameter(torch.zeros(h)) if cfg.attention_sinks else None
        if cfg.qk_norm:  # Qwen3: each query and key head RMS-normalised over its width before the rotation
            self.q_norm, self.k_norm = RMSNorm(k, cfg.layernorm_eps), RMSNorm(k, cfg.layernorm_eps)
        self.theta, self.n_head, self.window = cfg.rope_theta, h, cfg.sliding_window
        self.scaled = yarn(cfg, k)  # model.rope_scaling's frequencies, or None
        self.pairs = cfg.dilation_pairs if cfg.attention == "dilated" else None
        self.sparsity = block_sparsity(cfg)  # block-sparse dilated attention's pattern, or None

    def forward(self, x, positions=None, mask=None):
        q, k, v = self.project_qkv(x, positions)
        k, v = repeat_kv(k, self.n_head), repeat_kv(v, self.n_head)
        if self.pairs is not None:  # dilated_attention works on [b, t, h, k]
            y = dilated_attention(*(t.transpose(1, 2) for t in (q, k, v)), self.pairs, self.sparsity).transpose(1, 2)
        else:
            y = causal_attention(q, k, v, mask, self.window, self.sinks)
        return self.project_out(y)

    # the two projections are also what decoding with a KV cache runs (decode.py): k, v at kv_heads width
    def project_qkv(self, x, positions=None):
        q = self.q(x, "btd,dhk->bthk")
        k, v = self.kv(x, "btd,dcgk->btcgk").unbind(2)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q, self.theta, positions, self.scaled), rope(k, self.theta, positions, self.scaled)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [b, h, t, k]

    def project_out(self, y):
        return self.out(y, "bhtk,hkd->btd")


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig, width: int = 0):
        super().__init__()
        d, f = cfg.d_model, width or cfg.ff_dim  # width: a mixture of experts' shared experts
        self.gate, self.up, self.down = Kernel((d, f)), Kernel((d, f)), Kernel((f, d))

    def forward(self, x):
        return self.down(F.silu(self.gate(x, "btd,df->btf")) * self.up(x, "btd,df->btf"), "btf,fd->btd")
