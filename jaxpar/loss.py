"""The training loss: next-token cross-entropy, and how the model reads a row.

A row's token order and, with data.document_mask, each packed document's own positions and segment ids; a
layout's model loss (its gradients on the hand-scheduled pipeline executor: jaxpar/pipeline/gradients.py).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.core.config.schema import Config
from jaxpar.core.data.order import unmasked
from jaxpar.models.moe import stats_width
from jaxpar.ops import document_positions
from jaxpar.parallel.sequence import zigzag_order


def token_order(cfg: Config, mesh, T: int) -> np.ndarray | None:
    """Zig-zag order under sequence parallelism (causal load balance, parallel/sequence.py), else None (natural).

    Dilated attention keeps natural order: its segments are contiguous.
    """
    if mesh is None or mesh.shape["sp"] == 1 or not cfg.parallel.sequence_zigzag or cfg.model.attention == "dilated":
        return None
    return zigzag_order(T, mesh.shape["sp"])


class Rows(NamedTuple):
    """Rows as the model reads them, every array in the same (possibly permuted) token order."""

    inputs: jax.Array  # [batch, seq] token ids
    targets: jax.Array  # [batch, seq]
    positions: jax.Array | None  # None: natural order; [seq] the order's positions; with documents [batch, seq]
    segments: jax.Array | None  # with documents: [batch, seq] segment ids (ops.document_positions), else None
    mtp: tuple[jax.Array, jax.Array] | None = None  # model.mtp_depth: mtp_rows' (tokens, targets) [depth, batch, seq]


def split_rows(batch: jax.Array, order=None, eod: int | None = None, mtp_depth: int = 0) -> Rows:
    """rows [batch, seq + 1] -> Rows, permuted alike by `order` (the mean loss is unchanged).

    `eod`: the document token (jaxpar/core/data/tokens.py: document_token) when attention stays within documents. A
    target the loss skips stays negative (data_order.Samples); the inputs are the tokens. `mtp_depth`: the
    prediction modules' rows too (mtp_rows), shifted in token order before the permutation.
    """
    inputs, targets = unmasked(batch[:, :-1]), batch[:, 1:]
    positions, segments = (None, None) if eod is None else document_positions(inputs, eod)
    mtp = mtp_rows(inputs, targets, segments, mtp_depth) if mtp_depth else None
    if order is not None:
        inputs, targets = inputs[:, order], targets[:, order]
        positions, segments = (order, None) if eod is None else (positions[:, order], segments[:, order])
        mtp = None if mtp is None else (mtp[0][:, :, order], mtp[1][:, :, order])
    return Rows(inputs, targets, positions, segments, mtp)


def mtp_rows(inputs: jax.Array, targets: jax.Array, segments, depth: int) -> tuple[jax.Array, jax.Array]:
    """Multi-token prediction's (tokens, targets) [depth, batch, seq].

    At position t, depth d reads token t+d and predicts token t+1+d, i.e. the main row's input and target d
    positions later. A target exists where the main target at t+d is counted (the loss mask) and, with documents,
    token t+d is in t's document: the chain from t stays where t's attention does, and its last step may predict the
    next document's first token as the main loss does; none past the row's end (-1, skipped; the token 0 there is
    never read by a counted target).
    """

    def ahead(a, d, fill):
        return jnp.concatenate([a[:, d:], jnp.full((a.shape[0], d), fill, a.dtype)], axis=1)

    tokens, later = [], []
    for d in range(1, depth + 1):
        t = ahead(targets, d, -1)
        if segments is not None:
            t = jnp.where(ahead(segments, d, -1) == segments, t, -1)
        tokens.append(ahead(inputs, d, 0))
        later.append(t)
    return jnp.stack(tokens), jnp.stack(later)


def token_share(batch: jax.Array) -> jax.Array:
    """Target positions per counted target in the global batch: 1.0 (exactly) unless the data has a loss mask.

    Every microbatch's and data rank's mean is scaled by the same number, so the step's loss is the mean over the
    counted targets of the whole batch, however it is split (a mean per microbatch would weigh a microbatch with few
    response tokens as much as one with many).
    """
    targets = batch[:, 1:]
    return targets.size / jnp.maximum(jnp.sum(targets >= 0), 1).astype(jnp.float32)


def has_aux(m) -> bool:
    """Whether the model's loss comes with loss_fn's aux: experts' statistics or multi-token prediction's losses."""
    return m.moe_experts > 0 or m.mtp_depth > 0


def aux_zeros(m):
    """Zeros shaped as loss_fn's aux (the sum over microbatches starts from them)."""
    stats = jnp.zeros((stats_width(m),), jnp.float32)
    if not m.mtp_depth:
        return stats
    return {**({"expert_stats": stats} if m.moe_experts else {}), "mtp_losses": jnp.zeros((m.mtp_depth,), jnp.float32)}


def loss_fn(model, batch: jax.Array, order=None, eod: int | None = None, balance: bool = True):
    """Next-token cross-entropy of `model` over rows [batch, seq + 1], with the experts' and MTP's extra terms.

    The cross-entropy is models/head.py's cross_entropy, taken in model.loss_chunks chunks (times token_share, the mean
    over the counted targets), read in `order` (None: natural), within documents when `eod` is given. With experts
    (model.moe_experts): (that plus, if `balance`, the weighted balance loss; the experts' statistics summed over rows).
    With multi-token prediction (model.mtp_depth) and `balance` (training): plus model.mtp_loss_weight x the mean of the
    prediction depths' cross-entropies (each taken as the main one: over the batch's positions, times token_share, as
    DeepSeek-V3 divides by the row length), with aux {"mtp_losses": each depth's, "expert_stats": the statistics when
    there are experts}.
    """
    m = model.cfg
    rows = split_rows(batch, order, eod, m.mtp_depth if balance else 0)  # evaluation: the main loss alone
    loss, stats, *depths = model.loss(rows.inputs, rows.targets, rows.positions, rows.segments, rows.mtp)
    aux = {}
    if stats is not None:
        loss = loss + balance * m.moe_aux_loss * jnp.mean(stats[:, -1]) / m.moe_layers
        aux["expert_stats"] = jnp.sum(stats, axis=0)
    if depths:
        loss = loss + m.mtp_loss_weight * jnp.mean(depths[0])
        aux["mtp_losses"] = depths[0]
    if not aux:
        return loss
    return loss, (aux if depths else aux["expert_stats"])


def model_loss(layout, graphdef, eod, params, batch, scale=1.0, balance=True):
    """The layout's mean loss times `scale` (float16's loss scale; 1.0, a no-op, otherwise); `eod`.

    document_token's; `balance`: with the experts' balance loss and the prediction depths' (training), or the
    cross-entropy alone (evaluation). With loss_fn's aux, (loss, aux), the depths' losses scaled as the loss is.
    """
    order = token_order(layout.cfg, layout.mesh, batch.shape[1] - 1)
    out = loss_fn(nnx.merge(graphdef, params), batch, order, eod, balance)
    if not isinstance(out, tuple):
        return out * scale
    loss, aux = out  # the experts' statistics, or with multi-token prediction a dict
    return loss * scale, ({**aux, "mtp_losses": aux["mtp_losses"] * scale} if isinstance(aux, dict) else aux)
