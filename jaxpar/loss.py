"""The training loss: next-token cross-entropy, and the token order the model reads a row in."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.core.config import Config
from jaxpar.parallel.sequence import zigzag_order


def token_order(cfg: Config, mesh, T: int) -> np.ndarray | None:
    """Zig-zag order under sequence parallelism (causal load balance, parallel/sequence.py), else None
    (natural). Dilated attention keeps natural order: its segments are contiguous."""
    if mesh is None or mesh.shape["sp"] == 1 or not cfg.parallel.sequence_zigzag or cfg.model.attention == "dilated":
        return None
    return zigzag_order(T, mesh.shape["sp"])


def split_rows(batch: jax.Array, order=None):
    """rows [batch, seq + 1] -> (inputs, targets), permuted alike by `order` (the mean loss is unchanged)."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    if order is not None:
        inputs, targets = inputs[:, order], targets[:, order]
    return inputs, targets


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    logz = jax.nn.logsumexp(logits, axis=-1)
    # the target's logit by a masked sum, not a gather: fuses with the pass logsumexp makes, splits over
    # tp like it, and a gather along a tp-sharded vocab inside the pipeline's shard_map crashes XLA's partitioner
    vocab = jax.lax.broadcasted_iota(targets.dtype, logits.shape, logits.ndim - 1)
    picked = jnp.sum(jnp.where(vocab == targets[..., None], logits, 0.0), axis=-1)
    return jnp.mean(logz - picked)


def loss_fn(model, batch: jax.Array, order=None) -> jax.Array:
    """Mean next-token cross-entropy of `model` over rows [batch, seq + 1], read in `order` (None: natural)."""
    inputs, targets = split_rows(batch, order)
    return cross_entropy(model(inputs, order), targets)
