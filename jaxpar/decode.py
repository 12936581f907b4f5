"""Autoregressive decoding with a KV cache, in one jitted function: the prompt fills the cache in one
pass, then a scan emits one token per step, attending over the cache (masked by position, so the
unused tail of the cache is never seen). The model's own modules do everything but attention, so a
decoded token is the one the training forward pass would predict; run it inside a parallel context
(`jaxpar.context.use`) and the same code decodes on a tp or fsdp mesh.

GPT-2 with MHA attention (dense or sketched MLPs) and llama (the cache holds its n_kv_head heads, rotary
positions are the tokens' own); MLA and dilated attention have other caches and are refused by
`jaxpar.core.sampling_cli.check_decodable`.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.core.sketches import stacked_sketches
from jaxpar.models.llama import repeat_kv
from jaxpar.ops import causal_attention


def _forward(model, tokens, start, cache):
    """Logits of `tokens` [B, T] at positions start.. and the cache (k, v: [layers, B, S, kv heads, kv])
    with their keys and values written in."""
    cfg, dtype = model.cfg, jnp.dtype(model.cfg.compute_dtype)
    positions = start + jnp.arange(tokens.shape[1])
    k_positions = jnp.arange(cache[0].shape[2])
    graphdef, stacked = nnx.split(model.blocks)

    def layer(h, xs):
        layer_state, sketches, k_cache, v_cache = xs
        block = nnx.merge(graphdef, layer_state)
        q, k, v = block.attn.project_qkv(block.ln1(h), dtype, positions)
        k_cache = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, start, 0, 0))
        v_cache = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), (0, start, 0, 0))
        k, v = repeat_kv(k_cache, cfg.n_head), repeat_kv(v_cache, cfg.n_head)
        h = h + block.attn.project_out(causal_attention(q, k, v, positions, k_positions), dtype)
        h = h + block.mlp(block.ln2(h), dtype, sketches)
        return h, (k_cache, v_cache)

    h, cache = jax.lax.scan(layer, model.embed(tokens, positions), (stacked, stacked_sketches(cfg), *cache))
    return model.head(h), cache


def sample(logits, key, temperature: float, top_k: int, top_p: float):
    """One token per row of logits [B, vocab]: greedy at temperature 0, else from the tempered softmax
    restricted to the top_k tokens (0: all) and to the smallest set holding top_p of the mass."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1)
    logits = logits / temperature
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        mass_before = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1) - jax.nn.softmax(sorted_logits, -1)
        cut = jnp.where(mass_before >= top_p, -jnp.inf, sorted_logits)  # the first token always stays
        logits = jnp.full_like(logits, -jnp.inf).at[jnp.arange(logits.shape[0])[:, None], order].set(cut)
    return jax.random.categorical(key, logits, axis=-1)


def make_generate(graphdef):
    """The jitted decoder of a model's graphdef: generate(params, prompt [B, P] int32, key, new_tokens,
    temperature=0, top_k=0, top_p=1) -> the next `new_tokens` tokens [B, new_tokens]."""

    @partial(jax.jit, static_argnames=("new_tokens", "temperature", "top_k", "top_p"))
    def generate(params, prompt, key, new_tokens: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0):
        model = nnx.merge(graphdef, params)
        cfg = model.cfg
        B, P = prompt.shape
        shape = (cfg.n_layer, B, P + new_tokens, cfg.kv_heads, cfg.head_dim)
        cache = (jnp.zeros(shape, cfg.compute_dtype), jnp.zeros(shape, cfg.compute_dtype))
        draw = partial(sample, temperature=temperature, top_k=top_k, top_p=top_p)
        logits, cache = _forward(model, prompt, 0, cache)
        first = draw(logits[:, -1], jax.random.fold_in(key, 0))

        def step(carry, i):
            token, cache = carry
            logits, cache = _forward(model, token[:, None], P + i, cache)
            nxt = draw(logits[:, -1], jax.random.fold_in(key, i + 1))
            return (nxt, cache), token

        (last, _), tokens = jax.lax.scan(step, (first, cache), jnp.arange(new_tokens - 1))
        return jnp.concatenate([tokens.T, last[:, None]], axis=1)

    return generate
