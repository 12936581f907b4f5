"""Llama's block components (model.family=llama) in Flax NNX, logical axes only.

Grouped-query attention with rotary positions, the SwiGLU MLP. jaxpar/models/decoder.py assembles them, with layers.py's
RMSNorm, into the same stacked decoder as GPT-2 (embedding without positions, untied head when
model.tie_embeddings=false).

Grouped-query attention: n_kv_head key/value heads, each shared by n_head / n_kv_head consecutive
query heads (query head i reads kv head i // group, Hugging Face's `repeat_kv`). Keys and values are
projected at n_kv_head width (the parameters and the decoding cache are that small) and repeated to
n_head before the attention core, so every core (local, ring, all-gather, Ulysses, dilated) runs as
for MHA. Over tp, kv heads are split when n_kv_head divides by tp and replicated otherwise (the rules
table's "kv_heads" axis; jaxpar/sharding.py replicates any indivisible dimension).

Rotary pairs are (i, i + head_dim/2), Hugging Face's layout, so HF Llama weights load unpermuted. A head's width is
model.head_dim (Qwen3: heads x head_dim need not be d_model), and with model.qk_norm each query and key head is
RMS-normalised over its width before the rotation (Qwen3's q_norm / k_norm, one scale per layer shared by the heads).

Shared weight format (biases: none):
  blocks.attn.q.kernel [layers, embed, heads, kv]   blocks.attn.kv.kernel [layers, embed, 2, kv_heads, kv]
  blocks.attn.out.kernel [layers, heads, kv, embed]
  (model.qk_norm) blocks.attn.q_norm.scale / .k_norm.scale [layers, kv]
  blocks.mlp.gate.kernel / .up.kernel [layers, embed, mlp]   blocks.mlp.down.kernel [layers, mlp, embed]
  blocks.ln1.scale / .ln2.scale [layers, embed]   ln_f.scale [embed]   lm_head [vocab, embed] (untied)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.context import constrain, current
from jaxpar.core.config.schema import ModelConfig
from jaxpar.core.model.layer_rules import block_sparsity
from jaxpar.core.model.rotary import yarn
from jaxpar.models.dilated import dilated_attention
from jaxpar.models.layers import normal, param, rms_norm, rope
from jaxpar.ops import project


def repeat_kv(t, n_head: int):
    """[batch, seq, kv_heads, kv] -> [batch, seq, n_head, kv]: each kv head serves a group of query heads."""
    return jnp.repeat(t, n_head // t.shape[2], axis=2)


class GQAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, stack: tuple[int, ...]):
        L, d, h, g, k = stack, cfg.d_model, cfg.n_head, cfg.kv_heads, cfg.head_width
        lead = ("layers",) * len(stack)
        self.q = nnx.Dict(kernel=param(normal(rngs, L + (d, h, k), cfg.init_std), lead + ("embed", "heads", "kv")))
        self.kv = nnx.Dict(
            kernel=param(normal(rngs, L + (d, 2, g, k), cfg.init_std), lead + ("embed", "qkv", "kv_heads", "kv"))
        )
        self.out = nnx.Dict(
            kernel=param(
                normal(rngs, L + (h, k, d), cfg.init_std / math.sqrt(2 * cfg.n_layer)), lead + ("heads", "kv", "embed")
            )
        )
        if cfg.attention_bias:  # gpt-oss: biases on every projection
            self.q["bias"] = param(jnp.zeros(L + (h, k)), lead + ("heads", "kv"))
            self.kv["bias"] = param(jnp.zeros(L + (2, g, k)), lead + ("qkv", "kv_heads", "kv"))
            self.out["bias"] = param(jnp.zeros(L + (d,)), lead + ("embed",))
        if cfg.attention_sinks:  # gpt-oss: a logit per head beside the scores (jaxpar/ops.py causal_attention)
            self.sinks = param(normal(rngs, L + (h,), cfg.init_std), lead + ("heads",))
        if cfg.qk_norm:
            self.q_norm = nnx.Dict(scale=param(jnp.ones(L + (k,)), lead + ("kv",)))
            self.k_norm = nnx.Dict(scale=param(jnp.ones(L + (k,)), lead + ("kv",)))
        self.theta, self.n_head, self.eps, self.window = cfg.rope_theta, h, cfg.layernorm_eps, cfg.sliding_window
        self.scaled = yarn(cfg, k)  # model.rope_scaling's frequencies, or None
        self.pairs = cfg.dilation_pairs if cfg.attention == "dilated" else None
        self.sparsity = block_sparsity(cfg)  # block-sparse dilated attention's pattern, or None

    def __call__(self, x, dtype, positions=None, segments=None, window=None):
        """`window`: this layer's (core/model/windows.py); None: model.sliding_window."""
        window = self.window if window is None else window
        q, k, v = self.project_qkv(x, dtype, positions)
        k, v = (constrain(repeat_kv(t, self.n_head), ("batch", "seq", "heads", "kv")) for t in (k, v))
        y = (
            current().attention(q, k, v, positions, segments, window=window, sinks=self.head_sinks())
            if self.pairs is None
            else dilated_attention(q, k, v, self.pairs, self.sparsity)
        )
        return self.project_out(y, dtype)

    def head_sinks(self):
        """model.attention_sinks' logits [heads], or None."""
        return self.sinks[...] if hasattr(self, "sinks") else None

    # the two projections are also what decoding with a KV cache runs (decode.py): it caches k, v at kv_heads width
    def project_qkv(self, x, dtype, positions=None):
        pos = jnp.arange(x.shape[1]) if positions is None else positions
        q = _linear(self.q, x, dtype)
        kv = _linear(self.kv, x, dtype)  # [b, t, 2, kv_heads, k]
        k, v = kv[:, :, 0], kv[:, :, 1]
        if hasattr(self, "q_norm"):  # model.qk_norm: each head normalised over its width, before the rotation
            q, k = (rms_norm(t, n["scale"][...], self.eps) for t, n in ((q, self.q_norm), (k, self.k_norm)))
        q, k = rope(q, pos, self.theta, self.scaled), rope(k, pos, self.theta, self.scaled)
        return (
            constrain(q, ("batch", "seq", "heads", "kv")),
            *(constrain(t, ("batch", "seq", "kv_heads", "kv")) for t in (k, v)),
        )

    def project_out(self, y, dtype):
        y = constrain(y, ("batch", "seq", "heads", "kv"))
        return _linear(self.out, y, dtype, n_in=2)


def _linear(p, x, dtype, n_in: int = 1):
    """x times p's kernel, plus its bias where it has one (model.attention_bias)."""
    y = project(x, p["kernel"][...].astype(dtype), n_in=n_in)
    return y + p["bias"][...].astype(dtype) if "bias" in p else y


class SwiGLU(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, stack: tuple[int, ...], width: int = 0):
        """width: the hidden width (0: model.d_ff's; a mixture of experts' shared experts: theirs)."""
        L, d, f, lead = stack, cfg.d_model, width or cfg.ff_dim, ("layers",) * len(stack)
        self.gate = nnx.Dict(kernel=param(normal(rngs, L + (d, f), cfg.init_std), lead + ("embed", "mlp")))
        self.up = nnx.Dict(kernel=param(normal(rngs, L + (d, f), cfg.init_std), lead + ("embed", "mlp")))
        self.down = nnx.Dict(
            kernel=param(normal(rngs, L + (f, d), cfg.init_std / math.sqrt(2 * cfg.n_layer)), lead + ("mlp", "embed"))
        )

    def __call__(self, x, dtype, sketches=None):
        w = lambda p: p["kernel"][...].astype(dtype)
        h = constrain(jax.nn.silu(project(x, w(self.gate))) * project(x, w(self.up)), ("batch", "seq", "mlp"))
        return project(h, w(self.down))
