"""The decoder in Flax NNX.

model.family=gpt2: GPT-2 (learned positions, pre-LayerNorm, GELU MLP, tied embeddings). model.family=llama: the same
stacked pre-norm decoder with llama.py's blocks (grouped-query attention with rotary positions, SwiGLU) and layers.py's
RMSNorm, no position table, an untied head if asked.

Transformer blocks are one module whose parameters carry a leading `layers` axis; the forward
pass scans over it, so compile time is flat in depth. Every parameter records its logical axes
in `logical_axes` metadata; no mesh appears here: parallelism reaches the model only through
the parallel context (jaxpar/context.py): constraints, attention and the layer runner, which also recomputes
the layers (model.remat) when jaxpar/parallelize.py says so.

Parameter names and shapes are the shared weight format (jaxpar/core/weights/names.py maps them to torch names):
  wte [vocab, embed]  wpe [pos, embed]  ln_f.{scale,bias} [embed]
  blocks.ln1/ln2.{scale,bias} [layers, embed]
  blocks.attn.qkv.kernel [layers, embed, 3, heads, kv]   .bias [layers, 3, heads, kv]
  blocks.attn.out.kernel [layers, heads, kv, embed]      .bias [layers, embed]
  blocks.mlp.fc.kernel [layers, embed, mlp] .bias [layers, mlp]
  blocks.mlp.proj.kernel [layers, mlp, embed] .bias [layers, embed]
Llama's parameter names: llama.py. Variants (`model.attention`, `model.linear`; one file each) swap in
their own parameters:
mla.py (blocks.attn.*), dilated.py (MHA's parameters, another attention core), core/model/layer_rules.py
(blocks.mlp.{fc,proj}.factor instead of .kernel); model.moe_experts puts moe.py's experts (blocks.moe.*) in place
of the MLP, whose per-row statistics ride the layer scan's carry beside the activations; the first
model.moe_first_dense layers keep the dense MLP in a stack of their own before them (dense_blocks.*, the same
names as a dense model's blocks.*). model.mtp_depth adds multi-token prediction's modules (MTP, stacked on the depth):
mtp.norm_{emb,hidden,out}.* [depth, embed], mtp.proj.kernel [depth, 2, embed, embed], mtp.block.* (a dense block's
names); the forward pass, decoding and sampling leave them out, the training loss (loss) adds their losses.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.context import constrain, current
from jaxpar.core.config.schema import ModelConfig
from jaxpar.core.model.layer_rules import loss_chunks
from jaxpar.core.model.layer_rules import sketch_dim, stacked_sketches
from jaxpar.core.model.layer_rules import block_sparsity
from jaxpar.core.model.windows import window_cycle
from jaxpar.models.dilated import dilated_attention
from jaxpar.models.head import chunked_cross_entropy, cross_entropy, logits
from jaxpar.models.layers import LayerNorm, RMSNorm, normal, param
from jaxpar.models.llama import GQAttention, SwiGLU
from jaxpar.models.mla import MLAttention
from jaxpar.models.moe import MoE, add_layer_stats, stats_width
from jaxpar.ops import project


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, stack: tuple[int, ...]):
        L, d, h, k = stack, cfg.d_model, cfg.n_head, cfg.head_width
        lead = ("layers",) * len(stack)
        proj_std = cfg.init_std / math.sqrt(2 * cfg.n_layer)  # GPT-2: residual projections scaled
        self.qkv = nnx.Dict(
            kernel=param(normal(rngs, L + (d, 3, h, k), cfg.init_std), lead + ("embed", "qkv", "heads", "kv")),
            bias=param(jnp.zeros(L + (3, h, k)), lead + ("qkv", "heads", "kv")),
        )
        self.out = nnx.Dict(
            kernel=param(normal(rngs, L + (h, k, d), proj_std), lead + ("heads", "kv", "embed")),
            bias=param(jnp.zeros(L + (d,)), lead + ("embed",)),
        )
        self.pairs = cfg.dilation_pairs if cfg.attention == "dilated" else None
        self.sparsity = block_sparsity(cfg)  # block-sparse dilated attention's pattern, or None
        self.window = cfg.sliding_window

    def __call__(self, x, dtype, positions=None, segments=None, window=None):
        """`window`: this layer's (core/model/windows.py); None: model.sliding_window."""
        q, k, v = self.project_qkv(x, dtype, positions)
        # the context's attention: local (cuDNN flash on GPU where it applies), or across `sp` shards
        y = (
            current().attention(q, k, v, positions, segments, window=self.window if window is None else window)
            if self.pairs is None
            else dilated_attention(q, k, v, self.pairs, self.sparsity)
        )
        return self.project_out(y, dtype)

    # the two projections are also what decoding with a KV cache runs around its own attention (decode.py)
    def project_qkv(self, x, dtype, positions=None):  # positions: for rotary attention (llama.py); unused here
        w, b = self.qkv["kernel"][...].astype(dtype), self.qkv["bias"][...].astype(dtype)
        qkv = project(x, w) + b  # [b, t, 3, h, k]
        return tuple(constrain(qkv[:, :, i], ("batch", "seq", "heads", "kv")) for i in range(3))

    def project_out(self, y, dtype):
        y = constrain(y, ("batch", "seq", "heads", "kv"))
        out = project(y, self.out["kernel"][...].astype(dtype), n_in=2)
        return out + self.out["bias"][...].astype(dtype)


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, stack: tuple[int, ...]):
        L, d, f = stack, cfg.d_model, cfg.ff_dim
        lead = ("layers",) * len(stack)
        proj_std = cfg.init_std / math.sqrt(2 * cfg.n_layer)
        # core/model/layer_rules.py: a trained factor [m, out] after a fixed sketch [in, m]
        sketched = cfg.linear == "sketched"
        fc_in, fc_axis = (sketch_dim(cfg, d), "sketch") if sketched else (d, "embed")
        proj_in, proj_axis = (sketch_dim(cfg, f), "sketch") if sketched else (f, "mlp")
        name = "factor" if sketched else "kernel"
        self.fc = nnx.Dict(
            {
                name: param(normal(rngs, L + (fc_in, f), cfg.init_std), lead + (fc_axis, "mlp")),
                "bias": param(jnp.zeros(L + (f,)), lead + ("mlp",)),
            }
        )
        self.proj = nnx.Dict(
            {
                name: param(normal(rngs, L + (proj_in, d), proj_std), lead + (proj_axis, "embed")),
                "bias": param(jnp.zeros(L + (d,)), lead + ("embed",)),
            }
        )

    def __call__(self, x, dtype, sketches=None):
        def linear(p, x, name):
            if sketches:
                x, w = x @ jnp.asarray(sketches[name], dtype), p["factor"][...]
            else:
                w = p["kernel"][...]
            return project(x, w.astype(dtype)) + p["bias"][...].astype(dtype)

        h = constrain(jax.nn.gelu(linear(self.fc, x, "fc"), approximate=True), ("batch", "seq", "mlp"))  # tanh GELU
        return linear(self.proj, h, "proj")


class Block(nnx.Module):
    """One pre-LN transformer block; constructed stacked (leading `layers` axis), called per layer."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, stack: tuple[int, ...] = ()):
        llama = cfg.family == "llama"
        norm = RMSNorm if llama else LayerNorm
        self.ln1 = norm(cfg, stack)
        self.attn = (MLAttention if cfg.attention == "mla" else GQAttention if llama else Attention)(cfg, rngs, stack)
        self.ln2 = norm(cfg, stack)
        if cfg.moe_experts:  # a mixture of experts instead of the MLP (moe.py)
            self.moe = MoE(cfg, rngs, stack)
        else:
            self.mlp = (SwiGLU if llama else MLP)(cfg, rngs, stack)

    def __call__(self, x, dtype, positions=None, segments=None, sketches=None, window=None):
        """-> (x, the experts' per-row statistics [batch, E + 2]; None with a dense MLP).

        `window`: this layer's attention window (core/model/windows.py); None: model.sliding_window.
        """
        x = x + self.attn(self.ln1(x), dtype, positions, segments, window)
        y, stats = self.feed_forward(self.ln2(x), dtype, sketches, positions)
        return constrain(x + y, ("batch", "seq", "act_embed")), stats

    def feed_forward(self, x, dtype, sketches=None, positions=None):
        return self.moe(x, dtype, positions) if hasattr(self, "moe") else (self.mlp(x, dtype, sketches), None)


class MTP(nnx.Module):
    """DeepSeek-V3's multi-token prediction modules, model.mtp_depth of them stacked on a leading `layers` axis.

    Depth d reads depth d-1's hidden state h (the main model's last, before its final norm, for d=1) and the
    embedding e of the token d positions ahead: h_d = Block_d(proj_d([norm_emb_d(e); norm_hidden_d(h)])) -- the
    embedding first, as DeepSeek-V3's released weights (eh_proj) concatenate them -- and predicts the token d+1
    ahead through its own final norm and the main model's output head. Its blocks are dense (a mixture of experts
    would add statistics the main model's balance rules do not count) and run whole, outside the layer runner: a
    pipeline's stages hold the main stack alone. Decoding ignores the modules (decode.py).
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        D, d = (cfg.mtp_depth,), cfg.d_model
        norm = RMSNorm if cfg.family == "llama" else LayerNorm
        self.norm_emb, self.norm_hidden, self.norm_out = norm(cfg, D), norm(cfg, D), norm(cfg, D)
        # [depth, (embedding, hidden), embed in, embed out]: one axis named "embed" (fsdp), the other replicated
        self.proj = nnx.Dict(
            kernel=param(normal(rngs, D + (2, d, d), cfg.init_std), ("layers", None, "embed", "act_embed"))
        )
        self.block = Block(dataclasses.replace(cfg, moe_experts=0), rngs, stack=D)

    def depth(self, d: int):
        """Depth d's (1-based) parameters as modules of their own.

        (norm_emb, norm_hidden, proj kernel, block, norm_out).
        """
        pick = lambda module: nnx.merge(*_sliced(nnx.split(module), d - 1))
        return (
            pick(self.norm_emb),
            pick(self.norm_hidden),
            self.proj["kernel"][d - 1],
            pick(self.block),
            pick(self.norm_out),
        )


def _sliced(split, i: int):
    graphdef, state = split
    return graphdef, jax.tree.map(lambda a: a[i], state)


class Decoder(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.wte = param(normal(rngs, (cfg.vocab_size, cfg.d_model), cfg.init_std), ("vocab", "embed"))
        if cfg.family == "gpt2":  # llama's positions are rotary, inside attention
            self.wpe = param(normal(rngs, (cfg.max_seq_len, cfg.d_model), cfg.init_std), ("pos", "embed"))
        if cfg.moe_experts and cfg.moe_first_dense:  # DeepSeek's dense first layers: a stack of their own
            self.dense_blocks = Block(dataclasses.replace(cfg, moe_experts=0), rngs, stack=(cfg.moe_first_dense,))
        self.blocks = Block(cfg, rngs, stack=(cfg.n_layer - (cfg.moe_first_dense if cfg.moe_experts else 0),))
        self.ln_f = (RMSNorm if cfg.family == "llama" else LayerNorm)(cfg)
        if not cfg.tie_embeddings:
            self.lm_head = param(normal(rngs, (cfg.vocab_size, cfg.d_model), cfg.init_std), ("vocab", "embed"))
        # multi-token prediction (model.mtp_depth): after the head, so the main draws stay as they were
        if cfg.mtp_depth:
            self.mtp = MTP(cfg, rngs)

    def __call__(self, tokens: jax.Array, positions=None, segments=None) -> jax.Array:
        """tokens [batch, seq] int -> logits [batch, seq, vocab] float32.

        `positions` [seq]: the tokens' positions when they are not in natural order (zig-zag sequence
        parallelism); with `segments` [batch, seq] (packed documents, data.document_mask) both per row, each
        document's own (ops.document_positions).
        """
        return self.forward(tokens, positions, segments)[0]

    def forward(self, tokens: jax.Array, positions=None, segments=None):
        """(logits, the experts' per-row statistics summed over the layers [batch, E + 2]; None when dense)."""
        x, stats = self.run_blocks(self.embed(tokens, positions), positions, segments, with_stats=True)
        return self.head(x), stats

    def loss(self, tokens: jax.Array, targets: jax.Array, positions=None, segments=None, mtp=None):
        """forward's, with the head's cross-entropy against `targets` [batch, seq] (head_loss) for the logits.

        `mtp` (model.mtp_depth): (tokens, targets) [depth, batch, seq] of the prediction modules (jaxpar/loss.py
        mtp_rows); then (loss, statistics, each depth's cross-entropy [depth]).
        """
        x, stats = self.run_blocks(self.embed(tokens, positions), positions, segments, with_stats=True)
        if mtp is None:
            return self.head_loss(x, targets), stats
        return self.head_loss(x, targets), stats, self.mtp_losses(x, *mtp, positions, segments)

    def mtp_losses(self, h: jax.Array, tokens: jax.Array, targets: jax.Array, positions=None, segments=None):
        """Each prediction module's cross-entropy [depth] (MTP), as head_loss takes the main one.

        Depth d reads tokens[d-1] (the tokens d positions ahead) beside depth d-1's hidden state h and predicts
        targets[d-1].
        """
        dtype, losses = jnp.dtype(self.cfg.compute_dtype), []
        for d in range(1, self.cfg.mtp_depth + 1):
            norm_emb, norm_hidden, kernel, block, norm_out = self.mtp.depth(d)
            e = constrain(self.token_embedding(tokens[d - 1]).astype(dtype), ("batch", "seq", "act_embed"))
            both = jnp.stack([norm_emb(e), norm_hidden(h)], axis=2)  # [batch, seq, 2, embed]
            h = constrain(project(both, kernel.astype(dtype), n_in=2), ("batch", "seq", "act_embed"))
            h = block(h, dtype, positions, segments)[0]
            losses.append(self.head_loss(h, targets[d - 1], norm_out))
        return jnp.stack(losses)

    # The three pieces below are also what pipeline stages run (jaxpar/step.py for the executor):
    # embed on the first stage, a slice of the blocks on each, head and loss on the last.
    def embed(self, tokens: jax.Array, positions=None) -> jax.Array:
        dtype = jnp.dtype(self.cfg.compute_dtype)
        x = self.token_embedding(tokens)
        if self.cfg.family == "gpt2":
            T = tokens.shape[1]
            # the natural order's rows sliced replicated: left to GSPMD, the slice of the sp-sharded sequence was a
            # collective-permute, inside the pipeline executor's first-stage branches a deadlock (docs/architecture.md);
            # gathered by positions from the table's fsdp shards gathered first, as token_embedding's (per-row
            # positions from a table sharded over data axes crashed XLA's partitioner in the executor)
            x = x + (
                constrain(self.wpe[...][:T], (None, "act_embed"))
                if positions is None
                else jnp.take(constrain(self.wpe[...], (None, "act_embed")), positions, axis=0)
            )
        return constrain(x.astype(dtype), ("batch", "seq", "act_embed"))

    def token_embedding(self, tokens: jax.Array) -> jax.Array:
        # Gather the table's fsdp shards before the lookup: a gather from a table split on both
        # vocab (tp) and embed (fsdp) makes GSPMD replicate its output the slow way.
        return jnp.take(constrain(self.wte[...], ("vocab", "act_embed")), tokens, axis=0)

    def stacks(self) -> list:
        """The layer stacks in order: `dense_blocks` (model.moe_first_dense) when there is one, then `blocks`."""
        return [self.dense_blocks, self.blocks] if hasattr(self, "dense_blocks") else [self.blocks]

    def run_blocks(self, x: jax.Array, positions=None, segments=None, sketches=None, with_stats=False, stacks=None):
        """Run `x` through every layer of every stack in order, or through `stacks` alone.

        The stacks may have any leading lengths. `stacks`: the pipeline executor runs the dense stack on its first
        stage, a slice of `blocks` on each; `sketches` default to the whole model's (model.linear=sketched), a pipeline
        stage passes its own slice. `with_stats`: (x, the experts' per-row statistics summed over the layers, None when
        dense).
        """
        stats = None
        for stack in self.stacks() if stacks is None else stacks:
            moe = hasattr(stack, "moe")
            # with experts the carry holds their statistics so far (and, for the balance bias's per-layer counts, each
            # row's index of the next expert layer)
            B = x.shape[0]
            index = (jnp.zeros((B,), jnp.int32),) if moe and self.cfg.moe_bias_update else ()
            carry = (x, jnp.zeros((B, stats_width(self.cfg)), jnp.float32), *index) if moe else x
            out = self._run_stack(stack, carry, positions, segments, sketches, moe)
            x, stats = out[:2] if moe else (out, stats)
        return (x, stats) if with_stats else x

    def _run_stack(self, blocks, carry, positions, segments, sketches, moe: bool):
        dtype = jnp.dtype(self.cfg.compute_dtype)
        graphdef, stacked = nnx.split(blocks)
        # packed documents' positions and segment ids are per row: the runner gets them beside the carry, so that one
        # that splits the rows into microbatches (GPipe) splits them alike; a shared order's positions stay here
        rows = (positions, segments) if segments is not None else ()
        # model.full_attention_every: the runner steps through whole cycles of layers, each layer of a cycle with its
        # own static window (every stack and pipeline chunk starts a cycle: jaxpar/checks.py check_window_cycle)
        windows = window_cycle(self.cfg)
        xs = (stacked, stacked_sketches(self.cfg) if sketches is None else sketches)

        def layer(carry, xs, *per_row):  # the carry: x, with experts (x, statistics so far[, expert layer index])
            h, total, *index = carry if moe else (carry, None)
            for j, window in enumerate(windows):
                layer_state, layer_sketches = cycle_member(xs, j, len(windows))
                block = nnx.merge(graphdef, layer_state)
                h, stats = block(h, dtype, *(per_row or (positions, segments)), layer_sketches, window)
                if moe:
                    total = add_layer_stats(total, stats, index[0] if index else None, self.cfg)
                    index = [i + 1 for i in index]
            return (h, total, *index) if moe else h

        # the context's layer runner (a scan, or GPipe stages over `pp`; with model.remat each layer recomputed in the
        # backward pass); fixed sketches ride along with the parameters (a sketched model is dense: one stack)
        return current().run_layers(layer, in_cycles(xs, len(windows)), carry, rows)

    def head(self, x: jax.Array) -> jax.Array:
        """The final norm and the output head: float32 logits [batch, seq, vocab]."""
        return logits(self.ln_f(x), self.output_table(), self.cfg.float32_logits)

    def head_loss(self, x: jax.Array, targets: jax.Array, norm=None) -> jax.Array:
        """cross_entropy(self.head(x), targets), computed in chunks of positions.

        In model.loss_chunks chunks (models/head.py) unless that is one, so the whole float32 logits are never held at
        once. `norm`: another final norm than ln_f (MTP's).
        """
        n, norm = loss_chunks(self.cfg, targets.shape[1]), norm or self.ln_f
        if n == 1:
            return cross_entropy(logits(norm(x), self.output_table(), self.cfg.float32_logits), targets)
        return chunked_cross_entropy(norm(x), self.output_table(), targets, n, self.cfg.float32_logits)

    def output_table(self) -> jax.Array:
        """The output head's weights [vocab, embed]: the token embedding when tied, else lm_head."""
        return (self.wte if self.cfg.tie_embeddings else self.lm_head)[...]


def in_cycles(tree, n: int):
    """A layer stack's pytree [L, ...] as cycles of n layers, [L / n, n, ...] (model.full_attention_every)."""
    return tree if n == 1 else jax.tree.map(lambda a: a.reshape(a.shape[0] // n, n, *a.shape[1:]), tree)


def cycle_member(tree, j: int, n: int):
    """Layer j of one cycle's slice of an in_cycles tree (the slice itself when n = 1)."""
    return tree if n == 1 else jax.tree.map(lambda a: a[j], tree)


def abstract_model(cfg: ModelConfig):
    """(graphdef, {path: logical axes}, abstract params) without allocating anything."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))), nnx.Param)
    axes = {tuple(path): var.get_metadata()["logical_axes"] for path, var in nnx.to_flat_state(state)}
    return graphdef, axes, state.to_pure_dict()
