"""The mixture-of-experts feed-forward block (model.moe_experts > 0), logical axes only.

Per token x [embed] of a row of T tokens, with E experts, the k best of them and float32 routing:
  scores  = softmax(x W_r) or sigmoid(x W_r)             [E]      (model.moe_router; router.kernel [embed, E])
  choices = the k highest scores (ties: the lower id)     weights = their scores, divided by their sum when
            model.moe_norm_topk, times model.moe_routed_scale
            with model.moe_n_group G > 1 (DeepSeek-V3's group-limited routing): the E experts in G groups of E/G
            (consecutive ids), each group scored by the sum of its two highest scores, and the k chosen among the
            experts of the model.moe_topk_group best groups alone
  capacity (model.moe_capacity_factor c > 0): expert e takes at most ceil(c k T / E) of a row's choices, first
            choices before second ones, earlier tokens first; the rest skip it (the token keeps its other
            choices and the residual). c = 0: dropless. Fixed by the row alone, so every layout drops alike.
  y       = sum over kept choices of weight x SwiGLU_e(x)  + SwiGLU_shared(x) with moe_shared_experts > 0
The experts run where the parallel context puts them (`current().experts`: jaxpar/parallel/expert_dispatch.py on one
device, jaxpar/parallel/expert_parallel.py across `ep`).

Each layer also reports per row: the choices each expert received (before any drop), the choices dropped and
the sequence-wise balance loss sum_e f_e P_e (DeepSeek-V3, eq. 17-19: f_e = E/(kT) x the row's choices of e,
P_e = the row's mean normalised score of e; 1.0 when balanced). loss.py adds model.moe_aux_loss x its mean.

Shared weight format (blocks.moe.*; L: the expert layers): router.kernel [L, embed, E]  router.bias [L, E]
  (model.moe_bias_update or model.moe_router_bias)  gate, up [L, E, embed, moe_d_ff]  down [L, E, moe_d_ff, embed]
  shared.{gate,up}.kernel [L, embed, S x moe_d_ff]  shared.down.kernel [L, S x moe_d_ff, embed] (S =
  moe_shared_experts, one SwiGLU as wide as S experts, as DeepSeek's).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.context import constrain, current
from jaxpar.core.config.schema import ModelConfig
from jaxpar.core.model.experts import row_capacity
from jaxpar.models.llama import SwiGLU
from jaxpar.models.layers import normal, param


def stats_width(cfg: ModelConfig) -> int:
    """Per-row statistics the layers report together.

    Choices per expert (summed over the layers, or each expert layer's with model.moe_bias_update, whose update
    needs them), dropped choices, the balance loss (a layer reports [E + 2]: add_layer_stats places it).
    """
    return (cfg.moe_layers if cfg.moe_bias_update else 1) * cfg.moe_experts + 2


def add_layer_stats(total, stats, layer, cfg: ModelConfig):
    """Add an expert layer's per-row statistics [B, E + 2] to the running total [B, stats_width].

    `layer` [B]: its index among the expert layers (per row: it rides the layer scan's carry, through GPipe's stages
    too), None where the layers are summed.
    """
    if not cfg.moe_bias_update:
        return total + stats
    E = cfg.moe_experts
    received = jax.nn.one_hot(layer, cfg.moe_layers, dtype=jnp.float32)[:, :, None] * stats[:, None, :E]
    return total + jnp.concatenate([received.reshape(stats.shape[0], -1), stats[:, E:]], axis=-1)


def shift_layer_stats(stats, first, cfg: ModelConfig):
    """Move a run of expert layers' per-layer choices to the places of their expert layers in the whole model.

    `stats` [B, stats_width] of a run of expert layers counted from 0 (a pipeline stage's slice of the stack): each
    layer's choices moved to the place of its expert layer `first` + i (model.moe_bias_update; the places after the
    run are zero, so a roll moves them); as they are where the layers are summed.
    """
    if not cfg.moe_bias_update:
        return stats
    loads = jnp.roll(stats[:, : cfg.moe_layers * cfg.moe_experts], first * cfg.moe_experts, axis=1)
    return jnp.concatenate([loads, stats[:, cfg.moe_layers * cfg.moe_experts :]], axis=-1)


def limit_to_groups(choice, cfg: ModelConfig):
    """The choice's scores [..., E] with every expert outside the moe_topk_group best of moe_n_group groups at -inf.

    As DeepSeek-V3: a group's score is the sum of its best two; ties go to the lower group.
    """
    G = cfg.moe_n_group
    grouped = choice.reshape(*choice.shape[:-1], G, cfg.moe_experts // G)
    _, best = jax.lax.top_k(jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1), cfg.moe_topk_group)
    kept = jnp.any(jax.nn.one_hot(best, G, dtype=jnp.bool_), axis=-2)  # [..., G]
    return jnp.where(kept[..., None], grouped, -jnp.inf).reshape(choice.shape)


def route(logits, cfg: ModelConfig, index=None, bias=None):
    """Router logits [B, T, E] float32 -> (ids, weights, kept [B, T, k], stats [B, E + 2]).

    `index` [T]: each token's place in its row when the tokens are not in natural order (zig-zag sequence
    parallelism); `bias` [E]: added to the scores for the choice alone (model.moe_bias_update,
    core/model/experts.py).
    """
    E, k = cfg.moe_experts, cfg.moe_top_k
    scores = jax.nn.softmax(logits, axis=-1) if cfg.moe_router == "softmax" else jax.nn.sigmoid(logits)
    choice = scores if bias is None else scores + bias
    choice = choice if cfg.moe_n_group == 1 else limit_to_groups(choice, cfg)
    top, ids = jax.lax.top_k(choice, k)
    top = top if choice is scores else jnp.take_along_axis(scores, ids, axis=-1)  # the weights never see the bias
    weights = top / jnp.sum(top, axis=-1, keepdims=True) if cfg.moe_norm_topk else top
    weights = weights if cfg.moe_routed_scale == 1.0 else weights * cfg.moe_routed_scale
    chosen = jax.nn.one_hot(ids, E, dtype=jnp.int32)  # [B, T, k, E]
    capacity = row_capacity(cfg, logits.shape[1])
    if capacity:  # the order a row's choices claim their expert's places in: choice rank, then position
        B, T = ids.shape[:2]
        natural = jnp.arange(T) if index is None else jnp.argsort(index)  # slot of the token at each position
        ordered = chosen[:, natural].transpose(0, 2, 1, 3).reshape(B, k * T, E)
        place = (jnp.cumsum(ordered, axis=1) - 1).reshape(B, k, T, E).transpose(0, 2, 1, 3)
        place = place if index is None else place[:, jnp.argsort(natural)]  # back to the tokens' own order
        kept = jnp.sum(jnp.where(chosen > 0, place, 0), axis=-1) < capacity
    else:
        kept = jnp.ones(ids.shape, bool)
    received = jnp.sum(chosen, axis=(1, 2)).astype(jnp.float32)  # [B, E]
    share = scores / jnp.sum(scores, axis=-1, keepdims=True)
    balance = jnp.sum(received * E / (k * logits.shape[1]) * jnp.mean(share, axis=1), axis=-1)
    dropped = jnp.sum(~kept, axis=(1, 2)).astype(jnp.float32)
    return ids, weights, kept, jnp.concatenate([received, dropped[:, None], balance[:, None]], axis=-1)


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, stack: tuple[int, ...]):
        L, d, E, f, lead = stack, cfg.d_model, cfg.moe_experts, cfg.expert_dim, ("layers",) * len(stack)
        down_std = cfg.init_std / math.sqrt(2 * cfg.n_layer)
        self.router = nnx.Dict(kernel=param(normal(rngs, L + (d, E), cfg.init_std), lead + ("embed", "expert_scores")))
        # the choice's balance bias (core/model/experts.py): a Param without gradient that the step moves by
        # model.moe_bias_update, or that stays as loaded (model.moe_router_bias: DeepSeek-V3's e_score_correction_bias)
        if cfg.router_bias:
            self.router["bias"] = param(jnp.zeros(L + (E,)), lead + ("expert_scores",))
        self.gate = param(normal(rngs, L + (E, d, f), cfg.init_std), lead + ("experts", "embed", "mlp"))
        self.up = param(normal(rngs, L + (E, d, f), cfg.init_std), lead + ("experts", "embed", "mlp"))
        self.down = param(normal(rngs, L + (E, f, d), down_std), lead + ("experts", "mlp", "embed"))
        if cfg.moe_expert_bias:  # gpt-oss: each expert's biases and a learned bias on the router's logits
            self.router["logit_bias"] = param(jnp.zeros(L + (E,)), lead + ("expert_scores",))
            self.gate_bias = param(jnp.zeros(L + (E, f)), lead + ("experts", "mlp"))
            self.up_bias = param(jnp.zeros(L + (E, f)), lead + ("experts", "mlp"))
            self.down_bias = param(jnp.zeros(L + (E, d)), lead + ("experts", "act_embed"))
        self.shared = SwiGLU(cfg, rngs, stack, cfg.moe_shared_experts * f) if cfg.moe_shared_experts else None
        self.cfg = cfg

    def __call__(self, x, dtype, positions=None):
        """x [B, T, embed] -> (y [B, T, embed], stats [B, E + 2]).

        `positions` [T]: the tokens' places in the row when they are permuted (zig-zag), which the capacity's
        order follows; per row (packed documents) they restart per document and the tokens are in natural order
        (checks.py refuses the two together).
        """
        logits = jnp.einsum("btd,de->bte", x.astype(jnp.float32), self.router["kernel"][...].astype(jnp.float32))
        if "logit_bias" in self.router:  # gpt-oss's router bias: it weighs as well as chooses
            logits = logits + self.router["logit_bias"][...].astype(jnp.float32)
        index = positions if positions is not None and positions.ndim == 1 else None
        bias = jax.lax.stop_gradient(self.router["bias"][...]) if "bias" in self.router else None
        ids, weights, kept, stats = route(logits, self.cfg, index, bias)
        names = ("gate", "up", "down") + (("gate_bias", "up_bias", "down_bias") if self.cfg.moe_expert_bias else ())
        w = {n: getattr(self, n)[...].astype(dtype) for n in names}
        m = self.cfg
        y = current().experts(
            x,
            ids,
            weights,
            kept,
            w,
            row_capacity(m, x.shape[1]),
            (m.moe_activation, m.moe_swiglu_limit, m.moe_swiglu_alpha),
        )
        y = constrain(y, ("batch", "seq", "act_embed"))
        return (y if self.shared is None else y + self.shared(x, dtype)), stats


def update_router_bias(params: dict, stats, cfg: ModelConfig) -> dict:
    """`params` with each expert layer's balance bias moved by the step's choices.

    `stats`: the step's statistics summed over its rows (stats_width); the rule: core/model/experts.py. Without
    model.moe_bias_update the params come back as they are.
    """
    if not cfg.moe_bias_update:
        return params
    L, E = cfg.moe_layers, cfg.moe_experts
    loads = stats[: L * E].reshape(L, E)
    moe = params["blocks"]["moe"]
    bias = moe["router"]["bias"] + cfg.moe_bias_update * jnp.sign(jnp.mean(loads, -1, keepdims=True) - loads)
    return {**params, "blocks": {**params["blocks"], "moe": {**moe, "router": {**moe["router"], "bias": bias}}}}
