"""The training loss: next-token cross-entropy, and how the model reads a row: its token order, and with
data.document_mask each packed document's own positions and segment ids."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.core.config import Config
from jaxpar.core.data_order import unmasked
from jaxpar.ops import document_positions
from jaxpar.parallel.sequence import zigzag_order


def token_order(cfg: Config, mesh, T: int) -> np.ndarray | None:
    """Zig-zag order under sequence parallelism (causal load balance, parallel/sequence.py), else None
    (natural). Dilated attention keeps natural order: its segments are contiguous."""
    if mesh is None or mesh.shape["sp"] == 1 or not cfg.parallel.sequence_zigzag or cfg.model.attention == "dilated":
        return None
    return zigzag_order(T, mesh.shape["sp"])


class Rows(NamedTuple):
    """Rows as the model reads them, every array in the same (possibly permuted) token order."""
    inputs: jax.Array  # [batch, seq] token ids
    targets: jax.Array  # [batch, seq]
    positions: jax.Array | None  # None: natural order; [seq] the order's positions; with documents [batch, seq]
    segments: jax.Array | None  # with documents: [batch, seq] segment ids (ops.document_positions), else None


def split_rows(batch: jax.Array, order=None, eod: int | None = None) -> Rows:
    """rows [batch, seq + 1] -> Rows, permuted alike by `order` (the mean loss is unchanged); `eod`: the
    document token (jaxpar/core/tokens.py: document_token) when attention stays within documents. A target
    the loss skips stays negative (data_order.Samples); the inputs are the tokens."""
    inputs, targets = unmasked(batch[:, :-1]), batch[:, 1:]
    positions, segments = (None, None) if eod is None else document_positions(inputs, eod)
    if order is not None:
        inputs, targets = inputs[:, order], targets[:, order]
        positions, segments = ((order, None) if eod is None
                               else (positions[:, order], segments[:, order]))
    return Rows(inputs, targets, positions, segments)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """The mean over all target positions of the cross-entropy, a skipped (negative) target counting 0: times
    token_share of the whole batch, the mean over the counted targets."""
    logz = jax.nn.logsumexp(logits, axis=-1)
    # the target's logit by a masked sum, not a gather: fuses with the pass logsumexp makes, splits over
    # tp like it, and a gather along a tp-sharded vocab inside the pipeline's shard_map crashes XLA's partitioner
    vocab = jax.lax.broadcasted_iota(targets.dtype, logits.shape, logits.ndim - 1)
    picked = jnp.sum(jnp.where(vocab == targets[..., None], logits, 0.0), axis=-1)
    return jnp.mean(jnp.where(targets >= 0, logz - picked, 0.0))


def token_share(batch: jax.Array) -> jax.Array:
    """Target positions per counted target in the global batch: 1.0 (exactly) unless the data has a loss mask.
    Every microbatch's and data rank's mean is scaled by the same number, so the step's loss is the mean over
    the counted targets of the whole batch, however it is split (a mean per microbatch would weigh a
    microbatch with few response tokens as much as one with many)."""
    targets = batch[:, 1:]
    return targets.size / jnp.maximum(jnp.sum(targets >= 0), 1).astype(jnp.float32)


def loss_fn(model, batch: jax.Array, order=None, eod: int | None = None, balance: bool = True):
    """Next-token cross-entropy of `model` over rows [batch, seq + 1] (as cross_entropy: times token_share, the
    mean over the counted targets), read in `order` (None: natural), within documents when `eod` is given.
    With experts (model.moe_experts): (that plus, if `balance`, the weighted balance loss; the experts' statistics
    summed over rows)."""
    rows = split_rows(batch, order, eod)
    logits, stats = model.forward(rows.inputs, rows.positions, rows.segments)
    loss = cross_entropy(logits, rows.targets)
    if stats is None:
        return loss
    m = model.cfg
    return loss + balance * m.moe_aux_loss * jnp.mean(stats[:, -1]) / m.moe_layers, jnp.sum(stats, axis=0)
