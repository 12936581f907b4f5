"""Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434 section 2.1), logical axes only.

Per token x [embed]:
  c_q  = RMSNorm(x W_dq)                  [q_latent]         (q_down, q_norm)
  q    = c_q W_uq  -> [heads, kv + rope]  the last rope_head_dim features get RoPE   (q_up)
  [c_kv, k_r] = x W_dkv                   [kv_latent + rope] (kv_down); c_kv -> RMSNorm (kv_norm)
  k    = [c_kv W_uk, RoPE(k_r) shared by every head]   v = c_kv W_uv    (kv_up [kv_latent, 2, heads, kv])
  out  = softmax(q k^T / sqrt(kv + rope)) v W_o + b    (out, as GPT-2's)
So the per-token key/value cache is kv_latent_dim + rope_head_dim wide (`kv_cache_width`).
Heads are split over `tp` (q_up, kv_up, out); the latent down-projections follow the rules
table ("q_latent", "kv_latent": replicated). The core is the same fused attention as MHA
(the parallel context's `attention`); V is zero-padded to the query/key width it needs.

Shared weight format (blocks.attn.*): q_down.kernel [L, embed, q_latent]  q_norm.scale [L, q_latent]
  q_up.kernel [L, q_latent, heads, kv + rope]  kv_down.kernel [L, embed, kv_latent + rope]
  kv_norm.scale [L, kv_latent]  kv_up.kernel [L, kv_latent, 2, heads, kv]  out.kernel/bias as MHA (model.family=llama:
  out.kernel alone, no bias: DeepSeek-V3's attention, jaxpar/formats/hf_deepseek_v3.py).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx

from jaxpar.context import constrain, current
from jaxpar.core.config.schema import ModelConfig
from jaxpar.core.model.rotary import score_scale, yarn
from jaxpar.models.layers import normal, param, rms_norm, rope
from jaxpar.ops import project


def kv_cache_width(cfg: ModelConfig) -> int:
    """Values cached per token per layer for decoding.

    MHA: keys and values of every head; llama's GQA: of its n_kv_head heads.
    """
    return cfg.kv_latent_dim + cfg.rope_head_dim if cfg.attention == "mla" else 2 * cfg.kv_heads * cfg.head_width


class MLAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, stack: tuple[int, ...]):
        L, d, h, k = stack, cfg.d_model, cfg.n_head, cfg.head_width
        ql, kvl, r = cfg.q_latent_dim, cfg.kv_latent_dim, cfg.rope_head_dim
        lead, std, proj_std = ("layers",) * len(stack), cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layer)
        self.q_down = nnx.Dict(kernel=param(normal(rngs, L + (d, ql), std), lead + ("embed", "q_latent")))
        self.q_norm = nnx.Dict(scale=param(jnp.ones(L + (ql,)), lead + ("q_latent",)))
        self.q_up = nnx.Dict(kernel=param(normal(rngs, L + (ql, h, k + r), std), lead + ("q_latent", "heads", "kv")))
        self.kv_down = nnx.Dict(kernel=param(normal(rngs, L + (d, kvl + r), std), lead + ("embed", "kv_latent")))
        self.kv_norm = nnx.Dict(scale=param(jnp.ones(L + (kvl,)), lead + ("kv_latent",)))
        self.kv_up = nnx.Dict(
            kernel=param(normal(rngs, L + (kvl, 2, h, k), std), lead + ("kv_latent", "qkv", "heads", "kv"))
        )
        self.out = nnx.Dict(kernel=param(normal(rngs, L + (h, k, d), proj_std), lead + ("heads", "kv", "embed")))
        if cfg.family == "gpt2":  # llama's projections have no biases (DeepSeek-V3's o_proj neither)
            self.out["bias"] = param(jnp.zeros(L + (d,)), lead + ("embed",))
        self.eps, self.theta, self.kvl, self.r = cfg.layernorm_eps, cfg.rope_theta, kvl, r
        self.window = cfg.sliding_window
        self.scaled, self.score_scale = yarn(cfg, r), score_scale(cfg)  # model.rope_scaling on the rotary part

    def __call__(self, x, dtype, positions=None, segments=None, window=None):
        """`window`: this layer's (core/model/windows.py); None: model.sliding_window."""
        q, latent = self.project_q_latent(x, dtype, positions)
        k, v = self.keys_values(latent, dtype)
        window = self.window if window is None else window
        return self.project_out(current().attention(q, k, v, positions, segments, window=window), dtype)

    # The three steps below are also what decoding runs (jaxpar/decode.py): it caches the latent, the
    # kv_cache_width values per token, and expands the cached latents to keys and values at every step.
    def project_q_latent(self, x, dtype, positions=None):
        """(q [b, t, heads, kv + rope], latent [b, t, kv_latent + rope]: normalised c_kv and the rotated k_r)."""
        pos = jnp.arange(x.shape[1]) if positions is None else positions
        w = lambda p: p["kernel"][...].astype(dtype)
        c_q = rms_norm(project(x, w(self.q_down)), self.q_norm["scale"][...], self.eps)
        q = project(c_q, w(self.q_up))
        q = jnp.concatenate([q[..., : -self.r], rope(q[..., -self.r :], pos, self.theta, self.scaled)], axis=-1)
        if self.score_scale != 1.0:  # DeepSeek-V3's YaRN scales the scores: through the queries
            q = q * jnp.asarray(self.score_scale, q.dtype)
        ckv = project(x, w(self.kv_down))
        c_kv = rms_norm(ckv[..., : self.kvl], self.kv_norm["scale"][...], self.eps)
        latent = jnp.concatenate([c_kv, rope(ckv[..., self.kvl :], pos, self.theta, self.scaled)], axis=-1)
        return constrain(q, ("batch", "seq", "heads", "kv")), latent

    def keys_values(self, latent, dtype):
        """Keys and values [b, t, heads, kv + rope] of latents.

        v zero-padded to the query/key width, which the fused core wants for all three.
        """
        kv = project(latent[..., : self.kvl], self.kv_up["kernel"][...].astype(dtype))  # [b, t, 2, h, k]
        k_nope, v = kv[:, :, 0], kv[:, :, 1]
        k_r = jnp.broadcast_to(latent[:, :, None, self.kvl :], k_nope.shape[:3] + (self.r,))  # one for every head
        k, v = jnp.concatenate([k_nope, k_r], axis=-1), jnp.pad(v, ((0, 0),) * 3 + ((0, self.r),))
        return tuple(constrain(t, ("batch", "seq", "heads", "kv")) for t in (k, v))

    def project_out(self, y, dtype):
        """Drop the padded value features (the core's scale was 1/sqrt(kv + rope): the default for that width)."""
        y = constrain(y[..., : -self.r], ("batch", "seq", "heads", "kv"))
        out = project(y, self.out["kernel"][...].astype(dtype), n_in=2)
        return out + self.out["bias"][...].astype(dtype) if "bias" in self.out else out
