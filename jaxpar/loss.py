"""The training loss: next-token cross-entropy, and how the model reads a row: its token order, and with
data.document_mask each packed document's own positions and segment ids; a layout's model loss, and its
gradients on the hand-scheduled pipeline executor (jaxpar/parallelize.py picks them)."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.core.config import Config
from jaxpar.core.data_order import unmasked
from jaxpar.core.pipeline_schedules import resolve_microbatches
from jaxpar.core.sketches import stacked_sketches
from jaxpar.core.tokens import document_token
from jaxpar.models.decoder import abstract_model
from jaxpar.models.moe import shift_layer_stats, stats_width
from jaxpar.ops import document_positions
from jaxpar.parallel.pipeline_executor import StageFns, pipeline_value_and_grad
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


def token_share(batch: jax.Array) -> jax.Array:
    """Target positions per counted target in the global batch: 1.0 (exactly) unless the data has a loss mask.
    Every microbatch's and data rank's mean is scaled by the same number, so the step's loss is the mean over
    the counted targets of the whole batch, however it is split (a mean per microbatch would weigh a
    microbatch with few response tokens as much as one with many)."""
    targets = batch[:, 1:]
    return targets.size / jnp.maximum(jnp.sum(targets >= 0), 1).astype(jnp.float32)


def loss_fn(model, batch: jax.Array, order=None, eod: int | None = None, balance: bool = True):
    """Next-token cross-entropy of `model` over rows [batch, seq + 1] (models/head.py's cross_entropy, taken in
    model.loss_chunks chunks: times token_share, the mean over the counted targets), read in `order` (None: natural),
    within documents when `eod` is given. With experts (model.moe_experts): (that plus, if `balance`, the weighted
    balance loss; the experts' statistics summed over rows)."""
    rows = split_rows(batch, order, eod)
    loss, stats = model.loss(rows.inputs, rows.targets, rows.positions, rows.segments)
    if stats is None:
        return loss
    m = model.cfg
    return loss + balance * m.moe_aux_loss * jnp.mean(stats[:, -1]) / m.moe_layers, jnp.sum(stats, axis=0)


def model_loss(layout, graphdef, eod, params, batch, scale=1.0, balance=True):
    """The layout's mean loss times `scale` (float16's loss scale; 1.0, a no-op, otherwise); `eod`: document_token's;
    `balance`: with the experts' balance loss (training), or the cross-entropy alone (evaluation)."""
    order = token_order(layout.cfg, layout.mesh, batch.shape[1] - 1)
    out = loss_fn(nnx.merge(graphdef, params), batch, order, eod, balance)
    return (out[0] * scale, out[1]) if isinstance(out, tuple) else out * scale  # with experts: (loss, statistics)


def hand_scheduled(layout, schedule: str):
    """(params, batch, scale) -> (loss, grads) of the loss times `scale`, on the pipeline executor running
    `schedule` over the layout's pp (any schedule: the memory benchmark also runs the GPipe order on it). Trace it in
    the parallel context for the executor (jaxpar/parallelize.py): each stage runs its own layers as a scan. With
    experts, ((loss, their statistics summed over rows), grads), as model_loss under jax.value_and_grad: each stage
    reports its layers' statistics, the balance loss weighed in as loss_fn does."""
    cfg, mesh, p, m = layout.cfg, layout.mesh, layout.cfg.parallel, layout.cfg.model
    graphdef, S, eod = abstract_model(m)[0], mesh.shape["pp"], document_token(cfg)
    # each layer's place in the stack rides beside the sketches (a stage's first expert layer: the balance bias's
    # per-layer loads; checks.py keeps model.moe_first_dense on gpipe, so an expert layer's index is its layer's)
    consts = {"sketches": stacked_sketches(m), **({"layer": np.arange(m.n_layer)} if m.moe_experts else {})}
    model = lambda rest, chunk: nnx.merge(graphdef, {**rest, "blocks": chunk})  # noqa: E731  a stage's view

    def layers(rest, chunk, consts, x, where):
        stage = model(rest, chunk)
        if not m.moe_experts:
            return stage.run_blocks(x, *where, consts["sketches"])
        h, stats = stage.run_blocks(x, *where, consts["sketches"], with_stats=True)
        return h, shift_layer_stats(stats, consts["layer"][0], m)

    def value_and_grad(params, batch, scale=1.0):
        rows = split_rows(batch, token_order(cfg, mesh, batch.shape[1] - 1), eod)
        # each microbatch's (tokens, positions, segments): with documents per row, else the order's for every row
        inputs = (rows.inputs, rows.positions, rows.segments) if rows.segments is not None else (rows.inputs,)
        where = lambda r: r[1:] if len(r) > 1 else (rows.positions, None)  # noqa: E731
        fns = StageFns(
            embed=lambda rest, chunk, r: model(rest, chunk).embed(r[0], where(r)[0]),
            layers=lambda rest, chunk, consts, x, r: layers(rest, chunk, consts, x, where(r)),
            head_loss=lambda rest, chunk, h, targets: model(rest, chunk).head_loss(h, targets) * scale,
            # loss_fn's balance loss: moe_aux_loss x its mean over the batch's rows and the expert layers
            stats_cotangent=None if not m.moe_experts else jnp.zeros((stats_width(m),), jnp.float32).at[-1].set(
                m.moe_aux_loss * jnp.asarray(scale, jnp.float32) / (m.moe_layers * batch.shape[0])))
        rest = {k: v for k, v in params.items() if k != "blocks"}
        loss, stats, g_rest, g_blocks = pipeline_value_and_grad(
            fns, rest, params["blocks"], consts, inputs, rows.targets, mesh=mesh,
            schedule=schedule, S=S, M=resolve_microbatches(S, p.pipeline_microbatches), V=p.pipeline_virtual_stages,
            width=m.d_model, dtype=jnp.dtype(m.compute_dtype),
            weights_apart=m.remat == "none")  # a remat'ed layer recomputes its forward in B: W re-derives
        grads = {**g_rest, "blocks": g_blocks}
        # Pin the executor's gradients to the parameters' layout: left free, ZeRO-2's reduce-scatter layout
        # (the train step's) propagates back into the schedule's per-tick branches, where XLA then places a resharding
        # collective that only the devices taking that branch reach -- a deadlock (docs/fuzz.md, case 91).
        grads = jax.tree.map(jax.lax.with_sharding_constraint, grads, layout.shardings(layout.param_specs))
        return ((loss, stats) if m.moe_experts else loss), grads

    return value_and_grad
