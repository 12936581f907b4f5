"""The output head's logits and their cross-entropy, whole or in sequence chunks (model.loss_chunks).

Whole: the logits [batch, seq, vocab] in float32, then `cross_entropy`. In chunks: `chunked_cross_entropy` takes
the final norm's output and the output table and runs the head and the loss one chunk of positions at a time, so
no more than one chunk's float32 logits ever exist -- at GPT-2's vocabulary they are most of a step's memory
otherwise. Each chunk's gradients are taken in the forward pass, where its logits are at hand (autodiff of the
same per-chunk loss as the whole one), and kept at the size of the head's input and table: the backward pass
only scales them, so nothing is recomputed. Chunk c holds positions c, c + n, c + 2n, ... of every row, which
leaves the batch and sequence axes as sharded as they were (sequence parallelism's shards each give every chunk
their share); the vocabulary stays split over tp, the logsumexp and the target's logit reduced over it by GSPMD.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxpar.context import constrain, current
from jaxpar.sharding import spec_for


def logits(x: jax.Array, table: jax.Array, float32: bool = False) -> jax.Array:
    """float32 logits [batch, seq, vocab] of the normalized hidden states against the output table.

    x [batch, seq, embed] times the output table [vocab, embed], in x's dtype: the product rounded to x's dtype, then
    converted. `float32` (model.float32_logits): the matmul writes its float32 accumulation itself (`_float32_head`).
    """
    table = table.astype(x.dtype)
    if float32 and x.dtype != jnp.float32:
        return constrain(_float32_head(x, table), ("batch", "seq", "vocab"))
    out = jnp.einsum("btd,vd->btv", x, table)
    return constrain(out.astype(jnp.float32), ("batch", "seq", "vocab"))


@jax.custom_vjp
def _float32_head(x: jax.Array, table: jax.Array) -> jax.Array:
    """x [batch, seq, embed] . table [vocab, embed] -> float32, straight from the matmul's accumulation.

    Its backward rounds the logits' gradient to x's dtype and multiplies there, as the rounded head's own backward
    does: autodiff would multiply the float32 gradient by the compute-dtype operands in float32.
    """
    return jnp.einsum("btd,vd->btv", x, table, preferred_element_type=jnp.float32)


def _float32_head_fwd(x, table):
    return _float32_head(x, table), (x, table)


def _float32_head_bwd(saved, g):
    x, table = saved
    g = g.astype(x.dtype)
    return jnp.einsum("btv,vd->btd", g, table), jnp.einsum("btv,btd->vd", g, x)


_float32_head.defvjp(_float32_head_fwd, _float32_head_bwd)


def token_losses(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """The cross-entropy at each position [..., seq], 0 where the target is skipped (negative)."""
    logz = jax.nn.logsumexp(logits, axis=-1)
    # the target's logit by a masked sum, not a gather: fuses with the pass logsumexp makes, splits over
    # tp like it, and a gather along a tp-sharded vocab inside the pipeline's shard_map crashes XLA's partitioner
    vocab = jax.lax.broadcasted_iota(targets.dtype, logits.shape, logits.ndim - 1)
    picked = jnp.sum(jnp.where(vocab == targets[..., None], logits, 0.0), axis=-1)
    return jnp.where(targets >= 0, logz - picked, 0.0)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """The mean over all target positions of the cross-entropy, a skipped (negative) target counting 0.

    Times token_share of the whole batch (jaxpar/loss.py), the mean over the counted targets.
    """
    return jnp.mean(token_losses(logits, targets))


def _chunk_losses(h, table, targets, groups, float32: bool):
    """A chunk's summed cross-entropy per shard of its rows and positions [gb, gs] (reduced once, after the last)."""
    losses = token_losses(logits(h, table, float32), targets)
    return constrain(jnp.sum(_grouped(losses, groups), axis=(1, 3)), ("batch", "seq"))


def _split(a: jax.Array, n: int) -> jax.Array:
    """[batch, seq, ...] -> [n, batch, seq / n, ...]: chunk c holds positions c, c + n, ..."""
    B, T = a.shape[:2]
    return jnp.moveaxis(a.reshape(B, T // n, n, *a.shape[2:]), 2, 0)


def _join(a: jax.Array) -> jax.Array:
    """The inverse of _split."""
    n, B, t = a.shape[:3]
    return jnp.moveaxis(a, 0, 2).reshape(B, t * n, *a.shape[3:])


def _chunks(x, table, targets, n):
    # the table gathered (over fsdp) once, not in every chunk; each chunk's hidden states placed as the whole's
    table = constrain(table.astype(x.dtype), ("vocab", "act_embed"))
    return table, constrain(_split(x, n), (None, "batch", "seq", "act_embed")), _split(targets, n)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def chunked_cross_entropy(
    x: jax.Array, table: jax.Array, targets: jax.Array, chunks: int, float32: bool = False
) -> jax.Array:
    """cross_entropy(logits(x, table, float32), targets), with the logits made one chunk of positions at a time.

    The positions are split into `chunks` chunks (the sequence length a multiple of `chunks`).
    """
    table, xs, ts = _chunks(x, table, targets, chunks)
    groups = _shards(("batch", "seq"), xs.shape[1:3])
    step = lambda s, c: (s + _chunk_losses(c[0], table, c[1], groups, float32), None)
    return jnp.sum(jax.lax.scan(step, _zeros(groups), (xs, ts))[0]) / targets.size


def _forward(x, table, targets, chunks, float32):
    """The loss, and as residuals the gradients of its sum (not yet its mean) towards x and the table."""
    cast, xs, ts = _chunks(x, table, targets, chunks)
    groups = _shards(("batch", "seq"), xs.shape[1:3])
    per_shard = ("batch", "seq", "vocab", "act_embed")

    def chunk(carry, c):
        (total, dtable), (h, t) = carry, c
        losses, vjp = jax.vjp(lambda z: token_losses(z, t), logits(h, cast, float32))
        dz = vjp(jnp.ones_like(losses))[0].astype(h.dtype)  # the logits' gradient, cast back as autodiff does
        dh = jnp.einsum("btv,vd->btd", dz, cast)  # the head's transpose
        # the table's gradient kept per shard of the rows and positions, summed over them once after the last
        # chunk: not reduced over the data axes in every chunk
        dw = jnp.einsum(
            "gbhsv,gbhsd->ghvd", _grouped(dz, groups), _grouped(h, groups), preferred_element_type=jnp.float32
        )
        total = total + constrain(jnp.sum(_grouped(losses, groups), axis=(1, 3)), ("batch", "seq"))
        return (total, dtable + constrain(dw, per_shard)), dh

    zero = (_zeros(groups), _zeros((*groups, *cast.shape), per_shard))
    (total, dtable), dxs = jax.lax.scan(chunk, zero, (xs, ts))
    return jnp.sum(total) / targets.size, (_join(dxs), jnp.sum(dtable, axis=(0, 1)), jnp.zeros((), table.dtype))


def _shards(axes: tuple[str, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    """Into how many pieces the parallel context splits each of these logical axes of an array of `shape`."""
    ctx = current()
    if ctx.mesh is None:
        return (1,) * len(axes)
    spec = spec_for(axes, shape, ctx.mesh, ctx.rules)
    return tuple(math.prod(ctx.mesh.shape[a] for a in ((e,) if isinstance(e, str) else e or ())) for e in spec)


def _zeros(shape, axes=("batch", "seq")) -> jax.Array:
    return constrain(jnp.zeros(shape, jnp.float32), axes)


def _grouped(a: jax.Array, groups: tuple[int, int]) -> jax.Array:
    """[b, t, ...] -> [gb, b / gb, gs, t / gs, ...]: the rows and positions of each of gb x gs shards."""
    (gb, gs), (b, t) = groups, a.shape[:2]
    return a.reshape(gb, b // gb, gs, t // gs, *a.shape[2:])


def _backward(chunks, float32, residuals, g):
    dx, dtable, like = residuals  # `like`: the table's dtype, which its gradient takes
    scale = g / (dx.shape[0] * dx.shape[1])
    return (dx.astype(jnp.float32) * scale).astype(dx.dtype), (dtable * scale).astype(like.dtype), None


chunked_cross_entropy.defvjp(_forward, _backward)
