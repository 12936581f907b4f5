"""Autoregressive decoding with a KV cache, in one jitted function.

The prompt fills the cache in one pass, then a scan emits one token per step, attending over the cache (masked by
position, so the unused tail of the cache is never seen). The model's own modules do everything but attention, so a
decoded token is the one the training forward pass would predict; run it inside a parallel context
(`jaxpar.context.use`) and the same code decodes on a tp or fsdp mesh.

Every family and variant: GPT-2 and llama (the cache holds the n_kv_head heads' keys and values, rotary
positions are the tokens' own), dense or sketched MLPs; model.attention=mla caches each token's latent
(kv_latent_dim + rope_head_dim values, models/mla.py) and expands the cache to keys and values at every step;
model.attention=dilated caches keys and values as MHA does and attends with its pairs' pattern in the union
form (models/dilated.py `key_counts`): the segments of a row of max_seq_len tokens.

With data.document_mask (`eod`: the token that starts a document) every cache slot also keeps its token's
document and position (ops.document_positions), so a token attends only to its own document and positions restart at
each end-of-document token, in the prompt or decoded: what the model was trained to read.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.core.config.schema import ModelConfig
from jaxpar.core.model.layer_rules import stacked_sketches
from jaxpar.core.model.layer_rules import block_sparsity
from jaxpar.core.model.windows import window_cycle
from jaxpar.models.decoder import cycle_member, in_cycles
from jaxpar.models.dilated import counted_attention, key_counts
from jaxpar.models.llama import repeat_kv
from jaxpar.models.mla import kv_cache_width
from jaxpar.ops import causal_attention, document_positions


def _empty_cache(cfg: ModelConfig, batch: int, length: int) -> tuple[jax.Array, ...]:
    """Per layer and token: MLA its latent, the others keys and values ([layers, batch, length, ...])."""
    lead = (cfg.n_layer, batch, length)
    shapes = [lead + (kv_cache_width(cfg),)] if cfg.attention == "mla" else [lead + (cfg.kv_heads, cfg.head_width)] * 2
    return tuple(jnp.zeros(shape, cfg.compute_dtype) for shape in shapes)


def _attend(attn, cfg: ModelConfig, x, dtype, where, start, cache, window: int):
    """One layer's attention of x over its cache, x's own entries written in first.

    Where: (positions, cache slots' positions, segments, cache slots' segments) of _where; `window`: the layer's
    (core/model/windows.py).
    """
    positions, k_positions, segments, k_segments = where

    def write(c, new):
        return jax.lax.dynamic_update_slice(c, new.astype(c.dtype), (0, start) + (0,) * (c.ndim - 2))

    if cfg.attention == "mla":
        q, latent = attn.project_q_latent(x, dtype, positions)
        cache = (write(cache[0], latent),)
        k, v = attn.keys_values(cache[0], dtype)
    else:
        q, k, v = attn.project_qkv(x, dtype, positions)
        cache = (write(cache[0], k), write(cache[1], v))
        k, v = (repeat_kv(c, cfg.n_head) for c in cache)
    if cfg.attention == "dilated":
        y = counted_attention(
            q,
            k,
            v,
            key_counts(positions, k_positions, cfg.n_head, cfg.dilation_pairs, cfg.max_seq_len, block_sparsity(cfg)),
        )
    else:
        sinks = attn.head_sinks() if cfg.attention == "mha" and cfg.family == "llama" else None
        y = causal_attention(q, k, v, positions, k_positions, segments, k_segments, window, sinks)
    return attn.project_out(y, dtype), cache


def _where(tokens, start, slots, eod, length: int):
    """Where `tokens` go in the cache: their positions and segments, and the cache slots' own, with the slots updated.

    Returns (positions, cache slots' positions, segments, cache slots' segments) of `tokens` [B, T] written at slot
    `start` of a cache of `length`, and the slots updated. One document (eod None): positions start.., no slots.
    Documents: slots (positions, segments) [B, length], the tokens continuing the document of slot start-1 (an
    empty slot's segment is -1: never anyone's).
    """
    if eod is None:
        return (start + jnp.arange(tokens.shape[1]), jnp.arange(length), None, None), None
    last = [
        jnp.where(start > 0, jax.lax.dynamic_index_in_dim(s, jnp.maximum(start - 1, 0), 1, False), 0) for s in slots
    ]  # slot start-1's position and segment (none before the first)
    positions, segments = document_positions(tokens, eod, last[1], last[0] + jnp.where(start > 0, 1, 0))
    slots = tuple(jax.lax.dynamic_update_slice(s, new, (0, start)) for s, new in zip(slots, (positions, segments)))
    return (positions, slots[0], segments, slots[1]), slots


def _forward(model, tokens, start, cache, slots, eod=None):
    """Run `tokens` [B, T] through the model at cache slot `start`, returning logits and the updated cache and slots.

    The cache is per layer and token (see _empty_cache) and the slots as _where keeps them; both come back with
    their entries written in.
    """
    cfg, dtype = model.cfg, jnp.dtype(model.cfg.compute_dtype)
    where, slots = _where(tokens, start, slots, eod, cache[0].shape[2])
    h, offset, caches, windows = model.embed(tokens, where[0]), 0, [], window_cycle(cfg)
    N = len(windows)  # the layers of one cycle, each with its own window, per step of the scan (decoder.py _run_stack)
    for blocks in model.stacks():  # model.moe_first_dense: the dense stack's layers own the cache's first entries
        graphdef, stacked = nnx.split(blocks)
        n = jax.tree.leaves(stacked)[0].shape[0]

        def layer(h, xs, graphdef=graphdef):
            layer_caches = []
            for j, window in enumerate(windows):
                layer_state, sketches, *layer_cache = cycle_member(xs, j, N)
                block = nnx.merge(graphdef, layer_state)
                y, layer_cache = _attend(block.attn, cfg, block.ln1(h), dtype, where, start, layer_cache, window)
                h = h + y
                h = h + block.feed_forward(block.ln2(h), dtype, sketches)[0]
                layer_caches.append(layer_cache)
            return h, layer_caches[0] if N == 1 else jax.tree.map(lambda *c: jnp.stack(c), *layer_caches)

        xs = (stacked, stacked_sketches(cfg), *(c[offset : offset + n] for c in cache))
        h, part = jax.lax.scan(layer, h, in_cycles(xs, N))
        part = jax.tree.map(lambda a: a.reshape(n, *a.shape[2:]), part) if N > 1 else part
        offset, caches = offset + n, caches + [part]
    cache = tuple(jnp.concatenate(parts) for parts in zip(*caches))
    return model.head(h), cache, slots


def sample(logits, key, temperature: float, top_k: int, top_p: float):
    """One token per row of logits [B, vocab].

    Greedy at temperature 0, else from the tempered softmax restricted to the top_k tokens (0: all) and to the
    smallest set holding top_p of the mass.
    """
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


def make_generate(graphdef, eod: int | None = None):
    """The jitted decoder of a model's graphdef.

    Generate(params, prompt [B, P] int32, key, new_tokens, temperature=0, top_k=0, top_p=1) -> the next `new_tokens`
    tokens [B, new_tokens]. `eod`: attention within documents, each starting at that token (data.document_mask;
    jaxpar.core.data.tokens.document_token).
    """

    @partial(jax.jit, static_argnames=("new_tokens", "temperature", "top_k", "top_p"))
    def generate(params, prompt, key, new_tokens: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0):
        model = nnx.merge(graphdef, params)
        cfg = model.cfg
        B, P = prompt.shape
        cache = _empty_cache(cfg, B, P + new_tokens)
        slots = (
            None
            if eod is None
            else (jnp.zeros((B, P + new_tokens), jnp.int32), jnp.full((B, P + new_tokens), -1, jnp.int32))
        )
        draw = partial(sample, temperature=temperature, top_k=top_k, top_p=top_p)
        logits, cache, slots = _forward(model, prompt, 0, cache, slots, eod)
        first = draw(logits[:, -1], jax.random.fold_in(key, 0))

        def step(carry, i):
            token, cache, slots = carry
            logits, cache, slots = _forward(model, token[:, None], P + i, cache, slots, eod)
            nxt = draw(logits[:, -1], jax.random.fold_in(key, i + 1))
            return (nxt, cache, slots), token

        (last, *_), tokens = jax.lax.scan(step, (first, cache, slots), jnp.arange(new_tokens - 1))
        return jnp.concatenate([tokens.T, last[:, None]], axis=1)

    return generate


def make_generate_ragged(graphdef, eod: int | None = None):
    """The jitted decoder of prompts of different lengths in one batch (lm-eval's generation requests).

    Generate(params, prompt [B, P] int32 padded on the right, lengths [B], key, prefill, new_tokens, temperature=0,
    top_k=0, top_p=1) -> each row's next `new_tokens` tokens after its own length [B, new_tokens]. The first `prefill`
    tokens (at most the shortest prompt) fill the cache in one pass; then one token a step, each row reading its prompt
    until its length and its own predictions after, so one program serves every length up to P (compiled per P and
    prefill).
    """

    @partial(jax.jit, static_argnames=("prefill", "new_tokens", "temperature", "top_k", "top_p"))
    def generate(
        params,
        prompt,
        lengths,
        key,
        prefill: int,
        new_tokens: int,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
    ):
        model = nnx.merge(graphdef, params)
        B, P = prompt.shape
        total = P + new_tokens
        cache = _empty_cache(model.cfg, B, total)
        slots = None if eod is None else (jnp.zeros((B, total), jnp.int32), jnp.full((B, total), -1, jnp.int32))
        padded = jnp.concatenate([prompt, jnp.zeros((B, new_tokens), prompt.dtype)], axis=1)
        draw = partial(sample, temperature=temperature, top_k=top_k, top_p=top_p)
        logits, cache, slots = _forward(model, prompt[:, :prefill], 0, cache, slots, eod)
        first = draw(logits[:, -1], jax.random.fold_in(key, prefill))

        def step(carry, i):  # carry: the model's token for slot i (its prediction after slot i - 1)
            predicted, cache, slots = carry
            token = jnp.where(i < lengths, padded[:, i], predicted)
            logits, cache, slots = _forward(model, token[:, None], i, cache, slots, eod)
            return (draw(logits[:, -1], jax.random.fold_in(key, i + 1)), cache, slots), token

        (last, *_), tokens = jax.lax.scan(step, (first, cache, slots), jnp.arange(prefill, total - 1))
        row = jnp.concatenate([prompt[:, :prefill], tokens.T, last[:, None]], axis=1)  # every slot's token [B, total]
        return jax.vmap(lambda r, n: jax.lax.dynamic_slice(r, (n,), (new_tokens,)))(row, lengths)

    return generate
