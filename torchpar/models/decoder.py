"""The decoder in PyTorch with jaxpar's math.

model.family=gpt2: GPT-2 (learned positions, pre-LN, tanh GELU, tied embeddings); model.family=llama: llama.py's blocks
(RMSNorm, grouped-query rotary attention, SwiGLU), no position table, an untied head (`lm_head`) if asked.

Per-layer parameters keep the shapes of one slice of jaxpar's stacked weight format (qkv [embed, 3,
heads, kv], out [heads, kv, embed], ...) and are applied with einsum, so converting weights
(torchpar/weights.py) is pure stack/unstack. No parallelism and no recomputation here: torchpar/parallelize.py
applies both from outside. Every parameter is used inside the forward of the module that owns it (DeepSpeed
ZeRO-3 gathers parameters per module), which is why wte/wpe sit on the root module.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from jaxpar.core.config.schema import ModelConfig
from jaxpar.core.data.order import unmasked
from jaxpar.core.model.layer_rules import loss_chunks
from jaxpar.core.model.layer_rules import block_sparsity
from jaxpar.core.model.windows import layer_window
from torchpar.models.dilated import dilated_attention
from torchpar.models.head import chunk_loss, chunked_cross_entropy, cross_entropy, logits
from torchpar.models.layers import Dense, Kernel, LayerNorm, RMSNorm, SketchedLinear
from torchpar.models.llama import GQAttention, SwiGLU
from torchpar.models.mla import MLAttention
from torchpar.models.moe import MoE, layer_stats
from torchpar.ops import causal_attention, document_mask, document_positions


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, h, k = cfg.d_model, cfg.n_head, cfg.head_width
        self.qkv = Dense((d, 3, h, k), (3, h, k))
        self.out = Dense((h, k, d), (d,))
        self.pairs = cfg.dilation_pairs if cfg.attention == "dilated" else None  # torchpar/models/dilated.py
        self.sparsity = block_sparsity(cfg)  # block-sparse dilated attention's pattern, or None
        self.window = cfg.sliding_window

    def forward(self, x, positions=None, mask=None):
        if self.pairs is not None:
            q, k, v = self.qkv(x, "btd,dchk->btchk").unbind(2)  # each [b, t, h, k]
            return self.out(dilated_attention(q, k, v, self.pairs, self.sparsity), "bthk,hkd->btd")
        q, k, v = self.project_qkv(x)
        return self.project_out(causal_attention(q, k, v, mask, self.window))

    # the two projections are also what decoding with a KV cache runs around its own attention (decode.py)
    def project_qkv(self, x, positions=None):  # positions: for rotary attention (llama.py); unused here
        return self.qkv(x, "btd,dchk->btchk").permute(2, 0, 3, 1, 4).unbind(0)  # each [b, h, t, k]

    def project_out(self, y):
        return self.out(y, "bhtk,hkd->btd")


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        d, f = cfg.d_model, cfg.ff_dim
        if cfg.linear == "sketched":  # fixed sketch buffer + trained factor (torchpar/models/layers.py)
            self.fc, self.proj = SketchedLinear(cfg, layer, "fc", d, f), SketchedLinear(cfg, layer, "proj", f, d)
        else:
            self.fc, self.proj = Dense((d, f), (f,)), Dense((f, d), (d,))

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x, "btd,df->btf"), approximate="tanh"), "btf,fd->btd")


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        llama = cfg.family == "llama"
        norm = RMSNorm if llama else LayerNorm
        attn = MLAttention(cfg) if cfg.attention == "mla" else GQAttention(cfg) if llama else Attention(cfg)
        attn.window = layer_window(cfg, layer)  # model.full_attention_every: this layer's (core/model/windows.py)
        self.ln1, self.attn = norm(cfg.d_model, cfg.layernorm_eps), attn
        self.ln2 = norm(cfg.d_model, cfg.layernorm_eps)
        if cfg.moe_experts and layer >= cfg.moe_first_dense:  # experts instead of the MLP (torchpar/models/moe.py)
            self.moe = MoE(cfg)
        else:
            self.mlp = SwiGLU(cfg) if llama else MLP(cfg, layer)

    def feed_forward(self, x):
        return self.moe(x) if hasattr(self, "moe") else (self.mlp(x), None)

    def forward(self, x, positions=None, mask=None):
        """positions, mask: packed documents' (Decoder.forward), else None (one sequence, plain causal).

        -> (x, the experts' per-row statistics [batch, E + 2]; None with a dense MLP).
        """
        x = x + self.attn(self.ln1(x), positions, mask)
        y, stats = self.feed_forward(self.ln2(x))
        return x + y, stats


class MTP(nn.Module):
    """One of DeepSeek-V3's multi-token prediction modules (model.mtp_depth; jaxpar/models/decoder.py MTP).

    The embedding of the token d positions ahead and depth d-1's hidden state, each normed, projected to one vector
    (the embedding first), then a dense block and a final norm before the main model's output head.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        norm = RMSNorm if cfg.family == "llama" else LayerNorm
        d, eps = cfg.d_model, cfg.layernorm_eps
        self.norm_emb, self.norm_hidden, self.norm_out = norm(d, eps), norm(d, eps), norm(d, eps)
        self.proj = Kernel((2, d, d))  # [(embedding, hidden), embed in, embed out] as jaxpar's kernel slice
        self.block = Block(dataclasses.replace(cfg, moe_experts=0))

    def forward(self, e, h, positions=None, mask=None):
        both = torch.stack([self.norm_emb(e), self.norm_hidden(h)], dim=2)
        return self.block(self.proj(both, "btcd,cde->bte"), positions, mask)[0]


def mtp_rows(inputs, targets, segments, depth: int):
    """jaxpar/loss.py's mtp_rows in torch.

    [(tokens, targets)] of each depth, depth d reading the main row's input and target d positions later; a target
    kept where the main one is counted and, with documents (`segments`), token t+d is in t's document; -1 (skipped)
    past the row's end.
    """

    def ahead(a, d, fill):
        return torch.cat([a[:, d:], a.new_full((a.shape[0], d), fill)], dim=1)

    out = []
    for d in range(1, depth + 1):
        t = ahead(targets, d, -1)
        if segments is not None:
            t = torch.where(ahead(segments, d, -1) == segments, t, -1)
        out.append((ahead(inputs, d, 0), t))
    return out


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, eod: int | None = None):
        """Build the decoder's parameters from `cfg`.

        eod: the token that starts each packed document, attention staying within documents
        (data.document_mask: jaxpar/core/data/tokens.py document_token); None reads a row as one sequence.
        """
        super().__init__()
        self.cfg, self.eod = cfg, eod
        self.compute_dtype = getattr(torch, cfg.compute_dtype)  # DeepSpeed fp16 may override it
        self.wte = nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model))
        self.wpe = nn.Parameter(torch.empty(cfg.max_seq_len, cfg.d_model)) if cfg.family == "gpt2" else None
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.ln_f = (RMSNorm if cfg.family == "llama" else LayerNorm)(cfg.d_model, cfg.layernorm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model))
        self.mtp = nn.ModuleList(MTP(cfg) for _ in range(cfg.mtp_depth))  # multi-token prediction (model.mtp_depth)
        self.mtp_losses = None  # with it: each depth's cross-entropy of the last forward, detached
        self.expert_stats = None  # with experts: their per-row statistics of the last forward (moe.layer_stats)
        self.loss_chunk = chunk_loss  # the chunked loss's step (head.py), compiled by train.compile (parallelize.py)
        if cfg.float8:  # model.float8: every projection jaxpar's `project` runs; the router stays float32, as there
            for name, m in self.named_modules():
                if isinstance(m, (Dense, Kernel, SketchedLinear)) and not name.endswith(".router"):
                    m.float8 = True

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """jaxpar's distribution.

        N(0, init_std), residual projections N(0, init_std/sqrt(2L)), biases 0, scales 1. Drawn per block in
        parameter order (for GPT-2: qkv, out, fc, proj), every variant and family alike.
        """
        gen = torch.Generator().manual_seed(seed)
        std, proj_std = self.cfg.init_std, self.cfg.init_std / math.sqrt(2 * self.cfg.n_layer)
        for p in (p for p in (self.wte, self.wpe, self.lm_head) if p is not None):
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        for block in [*self.blocks, *(m.block for m in self.mtp)]:
            for name, p in block.named_parameters():
                if name.endswith("bias"):
                    p.zero_()
                elif name.startswith("ln") or "norm" in name:
                    p.fill_(1.0)
                else:
                    s = (
                        proj_std
                        if name.startswith(
                            ("attn.out.", "mlp.proj.", "mlp.down.", "moe.experts.down", "moe.shared.down.")
                        )
                        else std
                    )
                    p.copy_(torch.randn(p.shape, generator=gen) * s)
        for m in self.mtp:
            m.proj.weight.copy_(torch.randn(m.proj.weight.shape, generator=gen) * std)
        for norm in (m for m in self.modules() if isinstance(m, (LayerNorm, RMSNorm))):
            norm.weight.fill_(1.0)
            if isinstance(norm, LayerNorm):
                norm.bias.zero_()

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [batch, seq] int64 -> logits [batch, seq, vocab] float32.

        With `targets` [batch, seq] their mean cross-entropy instead (head_loss: in model.loss_chunks chunks,
        never the whole logits at once).
        """
        positions = mask = segments = None
        if self.eod is not None:  # each document its own positions, attending within itself
            positions, segments = document_positions(tokens, self.eod)
            mask = document_mask(positions, segments)
        x = embed(self.wte, self.wpe, tokens, self.compute_dtype, positions)
        per_layer = []
        for block in self.blocks:
            x, stats = block(x, positions, mask)
            if stats is not None:  # a mixture-of-experts layer (not one of model.moe_first_dense's dense ones)
                per_layer.append(stats)
        # the loss reads them (moe.balance_loss): the wrappers return the logits alone
        self.expert_stats = layer_stats(per_layer, self.cfg) if per_layer else None
        if targets is None:  # sampling and decoding: the main head alone (the prediction modules unused)
            return output_head(self.ln_f, self.output_table, x)
        loss = head_loss(self.ln_f, self.output_table, x, targets, self.cfg, self.loss_chunk)
        if not self.mtp or not self.training:  # evaluation: the main loss alone, as jaxpar's
            return loss
        table = self.output_table
        depths = mtp_losses(
            self.mtp,
            self.wte,
            x,
            (tokens, targets, segments),
            self.compute_dtype,
            lambda norm, h, t: head_loss(norm, table, h, t, self.cfg, self.loss_chunk),
            positions,
            mask,
        )
        self.mtp_losses = depths.detach()
        return loss + self.cfg.mtp_loss_weight * depths.mean()

    @property
    def output_table(self) -> nn.Parameter:
        return self.wte if self.lm_head is None else self.lm_head


# The two ends of the model as functions of their parameters: Decoder.forward and the first / last
# pipeline stage (torchpar/backends/pipeline.py) call them with the same tensors.
def embed(
    wte: nn.Parameter,
    wpe: nn.Parameter | None,
    tokens: torch.Tensor,
    dtype: torch.dtype,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    x = wte[tokens]
    if wpe is not None:  # llama: no position table
        x = x + (wpe[: tokens.shape[1]] if positions is None else wpe[positions])
    return x.to(dtype)


def mtp_losses(
    mtp: nn.ModuleList,
    wte: nn.Parameter,
    h: torch.Tensor,
    rows: tuple,
    dtype: torch.dtype,
    loss,
    positions=None,
    mask=None,
) -> torch.Tensor:
    """Each multi-token prediction depth's cross-entropy [depth], as jaxpar's Decoder.mtp_losses.

    From the main model's last state h (before its final norm) and rows = (tokens, targets, segments or None): depth
    d's module reads the token d positions ahead and depth d-1's state; `loss(norm, h, targets)` is the caller's head
    loss.
    """
    losses = []
    for module, (ahead, later) in zip(mtp, mtp_rows(*rows, len(mtp))):
        h = module(wte[ahead].to(dtype), h, positions, mask)
        losses.append(loss(module.norm_out, h, later))
    return torch.stack(losses)


def output_head(ln_f: nn.Module, table: nn.Parameter, x: torch.Tensor) -> torch.Tensor:
    """Final norm, then logits against `table`: wte when tied (not a view: FSDP2 hooks it), else lm_head."""
    return logits(ln_f(x), table)


def head_loss(
    ln_f: nn.Module, table: nn.Parameter, x: torch.Tensor, targets: torch.Tensor, cfg: ModelConfig, step=chunk_loss
) -> torch.Tensor:
    """The cross-entropy of the output head's logits against `targets`.

    next_token_loss(output_head(ln_f, table, x), targets), in model.loss_chunks chunks of positions (head.py, each
    by `step`) unless that is one.
    """
    n = loss_chunks(cfg, targets.shape[1])
    if n == 1:
        return cross_entropy(output_head(ln_f, table, x), targets)
    return chunked_cross_entropy(ln_f(x), table, targets, n, step)


def inputs_and_targets(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [batch, seq + 1] -> (inputs, targets).

    A target the loss skips stays negative (as jaxpar's loss.split_rows), the inputs are the tokens.
    """
    return unmasked(batch[:, :-1]), batch[:, 1:]


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The whole logits' loss.

    head.py's cross_entropy, the mean over all target positions of the cross-entropy, a skipped (negative) target
    counting 0 (times the batch's token share, the mean over the counted targets).
    """
    return cross_entropy(logits, targets)
