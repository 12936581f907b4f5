"""Autoregressive decoding with a KV cache (the same algorithm as jaxpar/decode.py): the prompt fills
the cache in one pass, then one token per step attends over the cache, masked by position. The model's
own modules do everything but attention. GPT-2 with MHA attention, and llama (the cache holds its n_kv_head
heads); the commands check it first: jaxpar.core.sampling_cli.check_decodable."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from torchpar.llama import repeat_kv
from torchpar.model import GPT, output_head


def _forward(model: GPT, tokens, start: int, cache):
    cfg = model.cfg
    positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
    x = model.wte[tokens] if model.wpe is None else model.wte[tokens] + model.wpe[positions]
    x = x.to(model.compute_dtype)
    mask = positions[:, None] >= torch.arange(cache[0][0].shape[2], device=tokens.device)[None, :]
    for block, (k_cache, v_cache) in zip(model.blocks, cache):
        q, k, v = block.attn.project_qkv(block.ln1(x), positions)
        k_cache[:, :, start:start + tokens.shape[1]] = k
        v_cache[:, :, start:start + tokens.shape[1]] = v
        k, v = repeat_kv(k_cache, cfg.n_head), repeat_kv(v_cache, cfg.n_head)
        x = x + block.attn.project_out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
        x = x + block.mlp(block.ln2(x))
    return output_head(model.ln_f, model.output_table, x)


def sample(logits, generator, temperature: float, top_k: int, top_p: float):
    """One token per row of logits [B, vocab]: greedy at temperature 0, else from the tempered softmax
    restricted to the top_k tokens (0: all) and to the smallest set holding top_p of the mass."""
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
def generate(model: GPT, prompt: torch.Tensor, new_tokens: int, seed: int = 0, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """prompt [B, P] int64 -> the next `new_tokens` tokens [B, new_tokens]."""
    cfg = model.cfg
    B, P = prompt.shape
    shape = (B, cfg.kv_heads, P + new_tokens, cfg.head_dim)
    cache = [(prompt.new_zeros(shape, dtype=model.compute_dtype), prompt.new_zeros(shape, dtype=model.compute_dtype))
             for _ in model.blocks]
    generator = torch.Generator(prompt.device).manual_seed(seed)
    logits, out = _forward(model, prompt, 0, cache), []
    for i in range(new_tokens):
        out.append(sample(logits[:, -1], generator, temperature, top_k, top_p))
        if i + 1 < new_tokens:
            logits = _forward(model, out[-1][:, None], P + i, cache)
    return torch.stack(out, 1)
