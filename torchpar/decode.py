"""Autoregressive decoding with a KV cache (the same algorithm as jaxpar/decode.py).

The prompt fills the cache in one pass, then one token per step attends over the cache, masked by position. The model's
own modules do everything but attention. Every family and variant: llama's cache holds its n_kv_head heads,
model.attention=mla caches each token's latent (torchpar/models/mla.py), model.attention=dilated attends over its keys
and values with its pairs' pattern (dilated.key_counts: the segments of a max_seq_len row). A model reading packed
documents (Decoder.eod) keeps each cache slot's document and position: a token attends within its own document,
positions restarting at each end-of-document token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchpar.models.llama import repeat_kv
from torchpar.models.decoder import Decoder, output_head
from jaxpar.core.model.layer_rules import block_sparsity
from torchpar.models.dilated import counted_attention, key_counts
from torchpar.ops import attention_with_sinks, document_mask, document_positions, sliding_band


def _empty_cache(model: Decoder, prompt: torch.Tensor, length: int) -> list[tuple[torch.Tensor, ...]]:
    """An empty KV cache for `length` positions, per layer.

    Per layer: MLA the latents [B, length, kv_latent + rope], the others keys and values [B, kv heads, length, kv].
    """
    cfg, B = model.cfg, prompt.shape[0]
    if cfg.attention == "mla":
        shapes = [(B, length, cfg.kv_latent_dim + cfg.rope_head_dim)]
    else:
        shapes = [(B, cfg.kv_heads, length, cfg.head_width)] * 2
    return [tuple(prompt.new_zeros(shape, dtype=model.compute_dtype) for shape in shapes) for _ in model.blocks]


def _attend(attn, cfg, x, positions, start: int, cache, mask=None):
    """One layer's attention of x (the tokens at `positions`) over its cache, x's own entries written in first.

    `mask` [B, 1, T, length] for packed documents (_where), else by position.
    """
    at = slice(start, start + x.shape[1])
    if cfg.attention == "mla":
        q, latent = attn.project_q_latent(x, positions)
        cache[0][:, at] = latent
        k, v = attn.keys_values(cache[0])
    else:
        q, k, v = attn.project_qkv(x, positions)
        cache[0][:, :, at], cache[1][:, :, at] = k, v
        k, v = repeat_kv(cache[0], cfg.n_head), repeat_kv(cache[1], cfg.n_head)
    k_positions = torch.arange(k.shape[2], device=x.device)
    if cfg.attention == "dilated":
        return attn.project_out(
            counted_attention(
                q,
                k,
                v,
                key_counts(
                    positions, k_positions, cfg.n_head, cfg.dilation_pairs, cfg.max_seq_len, block_sparsity(cfg)
                ),
            )
        )
    mask = positions[:, None] >= k_positions if mask is None else mask
    if attn.window:  # the layer's band by cache slot: the row's own distance, within a document too
        mask = mask & sliding_band(torch.arange(start, start + x.shape[1], device=x.device), k_positions, attn.window)
    sinks = getattr(attn, "sinks", None)  # model.attention_sinks
    if sinks is not None:
        return attn.project_out(attention_with_sinks(q, k, v, mask, sinks))
    return attn.project_out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def _where(model: Decoder, tokens, start: int, slots):
    """(positions, attention mask or None) of tokens written at cache slot `start`.

    With packed documents the slots ([B, length] positions and segments, an empty slot's segment -1) get theirs,
    continuing slot start-1's.
    """
    if model.eod is None:
        return torch.arange(start, start + tokens.shape[1], device=tokens.device), None
    at = slice(start, start + tokens.shape[1])
    segment = slots[1][:, start - 1 : start] if start else 0
    position = slots[0][:, start - 1 : start] + 1 if start else 0
    slots[0][:, at], slots[1][:, at] = document_positions(tokens, model.eod, segment, position)
    return slots[0][:, at], document_mask(slots[0][:, at], slots[1][:, at], *slots)


def _forward(model: Decoder, tokens, start: int, cache, slots):
    positions, mask = _where(model, tokens, start, slots)
    x = model.wte[tokens] if model.wpe is None else model.wte[tokens] + model.wpe[positions]
    x = x.to(model.compute_dtype)
    for block, layer_cache in zip(model.blocks, cache):
        x = x + _attend(block.attn, model.cfg, block.ln1(x), positions, start, layer_cache, mask)
        x = x + block.feed_forward(block.ln2(x))[0]
    return output_head(model.ln_f, model.output_table, x)


def sample(logits, generator, temperature: float, top_k: int, top_p: float):
    """One token per row of logits [B, vocab].

    Greedy at temperature 0, else from the tempered softmax restricted to the top_k tokens (0: all) and to the
    smallest set holding top_p of the mass.
    """
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k:
        logits = logits.masked_fill(logits < torch.topk(logits, top_k).values[:, -1:], -torch.inf)
    if top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        cut = sorted_logits.masked_fill(probs.cumsum(-1) - probs >= top_p, -torch.inf)  # the first token stays
        logits = torch.full_like(logits, -torch.inf).scatter(-1, order, cut)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


@torch.no_grad()
def generate(
    model: Decoder,
    prompt: torch.Tensor,
    new_tokens: int,
    seed: int = 0,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:
    """prompt [B, P] int64 -> the next `new_tokens` tokens [B, new_tokens]."""
    P = prompt.shape[1]
    cache = _empty_cache(model, prompt, P + new_tokens)
    shape = (prompt.shape[0], P + new_tokens)  # packed documents: each slot's position and segment (_where)
    slots = None if model.eod is None else (prompt.new_zeros(shape), prompt.new_full(shape, -1))
    generator = torch.Generator(prompt.device).manual_seed(seed)
    logits, out = _forward(model, prompt, 0, cache, slots), []
    for i in range(new_tokens):
        out.append(sample(logits[:, -1], generator, temperature, top_k, top_p))
        if i + 1 < new_tokens:
            logits = _forward(model, out[-1][:, None], P + i, cache, slots)
    return torch.stack(out, 1)
