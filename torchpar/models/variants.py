"""torchpar's model variants, one class each, with jaxpar's math and per-layer parameter shapes:
multi-head latent attention (jaxpar/models/mla.py), dilated attention (jaxpar/models/dilated.py)
and sketched linear layers (jaxpar/core/sketches.py, whose `sketch_matrix` builds the very same
sketch here). No parallelism; every parameter is used in the forward of the module that owns it.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from jaxpar.core.config import ModelConfig
from jaxpar.core.sketches import sketch_dim, sketch_matrix
from torchpar.models.layers import Dense, Kernel, RMSNorm, causal_attention, rope

NEG = -1e30


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, h, k = cfg.d_model, cfg.n_head, cfg.head_dim
        ql, kvl, r = cfg.q_latent_dim, cfg.kv_latent_dim, cfg.rope_head_dim
        self.q_down, self.q_norm = Kernel((d, ql)), RMSNorm(ql, cfg.layernorm_eps)
        self.q_up = Kernel((ql, h, k + r))
        self.kv_down, self.kv_norm = Kernel((d, kvl + r)), RMSNorm(kvl, cfg.layernorm_eps)
        self.kv_up = Kernel((kvl, 2, h, k))
        self.out = Dense((h, k, d), (d,))
        self.kvl, self.r, self.theta = kvl, r, cfg.rope_theta

    def forward(self, x, positions=None, mask=None):
        q, latent = self.project_q_latent(x, positions)
        k, v = self.keys_values(latent)
        return self.project_out(causal_attention(q, k, v, mask))

    # the three steps below are also what decoding runs (torchpar/decode.py): it caches the latents
    def project_q_latent(self, x, positions=None):
        """(q [b, heads, t, kv + rope], latent [b, t, kv_latent + rope]: normalised c_kv and the rotated k_r)."""
        q = self.q_up(self.q_norm(self.q_down(x, "btd,dl->btl")), "btl,lhk->bthk")
        q = torch.cat([q[..., : -self.r], rope(q[..., -self.r:], self.theta, positions)], dim=-1)
        ckv = self.kv_down(x, "btd,dl->btl")
        latent = torch.cat([self.kv_norm(ckv[..., : self.kvl]), rope(ckv[..., self.kvl:], self.theta, positions)], -1)
        return q.transpose(1, 2), latent

    def keys_values(self, latent):
        """Keys [b, heads, t, kv + rope] (the rotated k_r shared by every head) and values [b, heads, t, kv]."""
        k_nope, v = self.kv_up(latent[..., : self.kvl], "btl,lchk->cbthk").unbind(0)
        k_r = latent[:, :, None, self.kvl:].expand(*k_nope.shape[:3], self.r)
        return torch.cat([k_nope, k_r], dim=-1).transpose(1, 2), v.transpose(1, 2)

    def project_out(self, y):
        return self.out(y, "bhtk,hkd->btd")


def _segment_attention(q, k, v, w: int, r: int):
    """jaxpar.models.dilated._segment_attention on [B, T, H, D]."""
    B, T, H, D = q.shape
    w = min(w, T)
    S, n = T // w, w // r
    sel = torch.from_numpy(np.arange(r)[:, None] == np.arange(H)[None, :] % r).to(q.device)  # [r, H]
    pick = lambda x: torch.where(sel[:, :, None], x.reshape(B, S, n, r, H, D), 0).sum(3)  # noqa: E731
    qs, ks, vs = pick(q), pick(k), pick(v)
    s = torch.einsum("bsqhd,bskhd->bshqk", qs.float(), ks.float()) / math.sqrt(D)
    s = torch.where(torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), s, NEG)
    lse = torch.logsumexp(s, dim=-1)
    o = torch.einsum("bshqk,bskhd->bsqhd", torch.exp(s - lse[..., None]), vs.float())
    out = torch.where(sel[:, :, None], o[:, :, :, None], 0).reshape(B, T, H, D)
    lse = torch.where(sel, lse.transpose(2, 3)[:, :, :, None], NEG).reshape(B, T, H)
    return out, lse


def dilated_attention(q, k, v, pairs):
    outs, lses = zip(*(_segment_attention(q, k, v, w, r) for w, r in pairs))
    lse = torch.stack(lses)
    weight = torch.exp(lse - lse.max(0).values)
    out = sum(wt[..., None] * o for wt, o in zip(weight, outs)) / weight.sum(0)[..., None]
    return out.to(q.dtype)


def key_counts(q_pos, k_pos, n_head: int, pairs, context: int):
    """jaxpar.models.dilated.key_counts: [heads, q, k], how many pairs let query q_pos[i] attend key k_pos[j]."""
    h, q, k = torch.arange(n_head, device=q_pos.device)[:, None, None], q_pos[None, :, None], k_pos[None, None, :]
    counts = torch.zeros(n_head, len(q_pos), len(k_pos), dtype=torch.int32, device=q_pos.device)
    for w, r in pairs:
        w = min(w, context)
        counts += (q // w == k // w) & (k <= q) & (q % w % r == h % r) & (k % w % r == h % r)
    return counts


def counted_attention(q, k, v, counts):
    """jaxpar.models.dilated.counted_attention on [b, heads, t, d]: decoding's form of dilated_attention."""
    s = torch.einsum("bhqd,bhkd->bhqk", q.float(), k.float()) / math.sqrt(q.shape[-1])
    s = torch.where(counts > 0, s + counts.clamp(min=1).float().log(), NEG)
    return torch.einsum("bhqk,bhkd->bhqd", s.softmax(-1), v.float()).to(q.dtype)


class SketchedLinear(nn.Module):
    """y = (x S) W + b: S a non-persistent buffer (derived, not trained, not saved), W = `factor`."""

    def __init__(self, cfg: ModelConfig, layer: int, name: str, n_in: int, n_out: int):
        super().__init__()
        self.register_buffer("sketch", torch.from_numpy(sketch_matrix(cfg, layer, name)), persistent=False)
        self.factor = nn.Parameter(torch.empty(sketch_dim(cfg, n_in), n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x, equation: str = ""):
        return (x @ self.sketch.to(x.dtype)) @ self.factor.to(x.dtype) + self.bias.to(x.dtype)
