"""Multi-head latent attention (model.attention=mla) in PyTorch.

It has jaxpar's math and per-layer parameter shapes (jaxpar/models/mla.py). No parallelism; every parameter is used
in the forward of the module that owns it.
"""

from __future__ import annotations

import torch
from torch import nn

from jaxpar.core.config.schema import ModelConfig
from jaxpar.core.model.rotary import score_scale, yarn
from torchpar.models.layers import Dense, Kernel, RMSNorm, rope
from torchpar.ops import causal_attention


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, h, k = cfg.d_model, cfg.n_head, cfg.head_width
        ql, kvl, r = cfg.q_latent_dim, cfg.kv_latent_dim, cfg.rope_head_dim
        self.q_down, self.q_norm = Kernel((d, ql)), RMSNorm(ql, cfg.layernorm_eps)
        self.q_up = Kernel((ql, h, k + r))
        self.kv_down, self.kv_norm = Kernel((d, kvl + r)), RMSNorm(kvl, cfg.layernorm_eps)
        self.kv_up = Kernel((kvl, 2, h, k))
        self.out = Dense((h, k, d), (d,)) if cfg.family == "gpt2" else Kernel((h, k, d))  # llama: no biases
        self.kvl, self.r, self.theta, self.window = kvl, r, cfg.rope_theta, cfg.sliding_window
        self.scaled, self.score_scale = yarn(cfg, r), score_scale(cfg)  # model.rope_scaling on the rotary part

    def forward(self, x, positions=None, mask=None):
        q, latent = self.project_q_latent(x, positions)
        k, v = self.keys_values(latent)
        return self.project_out(causal_attention(q, k, v, mask, self.window))

    # the three steps below are also what decoding runs (torchpar/decode.py): it caches the latents
    def project_q_latent(self, x, positions=None):
        """(q [b, heads, t, kv + rope], latent [b, t, kv_latent + rope]: normalised c_kv and the rotated k_r)."""
        q = self.q_up(self.q_norm(self.q_down(x, "btd,dl->btl")), "btl,lhk->bthk")
        q = torch.cat([q[..., : -self.r], rope(q[..., -self.r :], self.theta, positions, self.scaled)], dim=-1)
        if self.score_scale != 1.0:  # DeepSeek-V3's YaRN scales the scores: through the queries (jaxpar's)
            q = q * self.score_scale
        ckv = self.kv_down(x, "btd,dl->btl")
        k_r = rope(ckv[..., self.kvl :], self.theta, positions, self.scaled)
        latent = torch.cat([self.kv_norm(ckv[..., : self.kvl]), k_r], -1)
        return q.transpose(1, 2), latent

    def keys_values(self, latent):
        """Keys [b, heads, t, kv + rope] (the rotated k_r shared by every head) and values [b, heads, t, kv]."""
        k_nope, v = self.kv_up(latent[..., : self.kvl], "btl,lchk->cbthk").unbind(0)
        k_r = latent[:, :, None, self.kvl :].expand(*k_nope.shape[:3], self.r)
        return torch.cat([k_nope, k_r], dim=-1).transpose(1, 2), v.transpose(1, 2)

    def project_out(self, y):
        return self.out(y, "bhtk,hkd->btd")
