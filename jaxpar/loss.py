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
    mtp: tuple[jax.Array, jax.Array] | None = None  # model.mtp_depth: mtp_rows' (tokens, targets) [depth, batch, seq]


def split_rows(batch: jax.Array, order=None, eod: int | None = None, mtp_depth: int = 0) -> Rows:
    """rows [batch, seq + 1] -> Rows, permuted alike by `order` (the mean loss is unchanged); `eod`: the
    document token (jaxpar/core/tokens.py: document_token) when attention stays within documents. A target
    the loss skips stays negative (data_order.Samples); the inputs are the tokens. `mtp_depth`: the prediction
    modules' rows too (mtp_rows), shifted in token order before the permutation."""
    inputs, targets = unmasked(batch[:, :-1]), batch[:, 1:]
    positions, segments = (None, None) if eod is None else document_positions(inputs, eod)
    mtp = mtp_rows(inputs, targets, segments, mtp_depth) if mtp_depth else None
    if order is not None:
        inputs, targets = inputs[:, order], targets[:, order]
        positions, segments = ((order, None) if eod is None
                               else (positions[:, order], segments[:, order]))
        mtp = None if mtp is None else (mtp[0][:, :, order], mtp[1][:, :, order])
    return Rows(inputs, targets, positions, segments, mtp)


def mtp_rows(inputs: jax.Array, targets: jax.Array, segments, depth: int) -> tuple[jax.Array, jax.Array]:
    """Multi-token prediction's (tokens, targets) [depth, batch, seq]: at position t, depth d reads token t+d and
    predicts token t+1+d, i.e. the main row's input and target d positions later. A target exists where the main
    target at t+d is counted (the loss mask) and, with documents, token t+d is in t's document: the chain from t
    stays where t's attention does, and its last step may predict the next document's first token as the main
    loss does; none past the row's end (-1, skipped; the token 0 there is never read by a counted target)."""
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
    Every microbatch's and data rank's mean is scaled by the same number, so the step's loss is the mean over
    the counted targets of the whole batch, however it is split (a mean per microbatch would weigh a
    microbatch with few response tokens as much as one with many)."""
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
    """Next-token cross-entropy of `model` over rows [batch, seq + 1] (models/head.py's cross_entropy, taken in
    model.loss_chunks chunks: times token_share, the mean over the counted targets), read in `order` (None: natural),
    within documents when `eod` is given. With experts (model.moe_experts): (that plus, if `balance`, the weighted
    balance loss; the experts' statistics summed over rows). With multi-token prediction (model.mtp_depth) and
    `balance` (training): plus model.mtp_loss_weight x the mean of the prediction depths' cross-entropies (each taken
    as the main one: over the batch's positions, times token_share, as DeepSeek-V3 divides by the row length), with
    aux {"mtp_losses": each depth's, "expert_stats": the statistics when there are experts}."""
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
    """The layout's mean loss times `scale` (float16's loss scale; 1.0, a no-op, otherwise); `eod`: document_token's;
    `balance`: with the experts' balance loss and the prediction depths' (training), or the cross-entropy alone
    (evaluation). With loss_fn's aux, (loss, aux), the depths' losses scaled as the loss is."""
    order = token_order(layout.cfg, layout.mesh, batch.shape[1] - 1)
    out = loss_fn(nnx.merge(graphdef, params), batch, order, eod, balance)
    if not isinstance(out, tuple):
        return out * scale
    loss, aux = out  # the experts' statistics, or with multi-token prediction a dict
    return loss * scale, ({**aux, "mtp_losses": aux["mtp_losses"] * scale} if isinstance(aux, dict) else aux)


def hand_scheduled(layout, schedule: str):
    """(params, batch, scale) -> (loss, grads) of the loss times `scale`, on the pipeline executor running
    `schedule` over the layout's pp (any schedule: the memory benchmark also runs the GPipe order on it). Trace it in
    the parallel context for the executor (jaxpar/parallelize.py): each stage runs its own layers as a scan. With
    experts, ((loss, their statistics summed over rows), grads), as model_loss under jax.value_and_grad: each stage
    reports its layers' statistics, the balance loss weighed in as loss_fn does. With multi-token prediction,
    ((loss, loss_fn's aux dict), grads): the last stage runs the modules after the head (_last_stage_loss)."""
    cfg, mesh, p, m = layout.cfg, layout.mesh, layout.cfg.parallel, layout.cfg.model
    graphdef, S, eod = abstract_model(m)[0], mesh.shape["pp"], document_token(cfg)
    # each layer's place in the `blocks` stack rides beside the sketches (a stage's first expert layer: the balance
    # bias's per-layer loads, counted over the expert layers as one device counts them)
    consts = {"sketches": stacked_sketches(m), **({"layer": np.arange(m.moe_layers)} if m.moe_experts else {})}
    model = lambda rest, chunk: nnx.merge(graphdef, {**rest, "blocks": chunk})  # noqa: E731  a stage's view

    def embed(rest, chunk, tokens, positions, segments):
        """The first stage's input: the embedding, then model.moe_first_dense's dense stack whole (it is in `rest`,
        so its gradient comes with the embedding's, from the first stage's recomputed lookup)."""
        stage = model(rest, chunk)
        x = stage.embed(tokens, positions)
        dense = stage.stacks()[:-1]
        return stage.run_blocks(x, positions, segments, stacks=dense) if dense else x

    def layers(rest, chunk, consts, x, where):
        stage = model(rest, chunk)
        if not m.moe_experts:
            return stage.run_blocks(x, *where, consts["sketches"], stacks=[stage.blocks])
        h, stats = stage.run_blocks(x, *where, consts["sketches"], with_stats=True, stacks=[stage.blocks])
        return h, shift_layer_stats(stats, consts["layer"][0], m)

    def value_and_grad(params, batch, scale=1.0):
        rows = split_rows(batch, token_order(cfg, mesh, batch.shape[1] - 1), eod, m.mtp_depth)
        # each microbatch's (tokens, positions, segments): with documents per row, else the order's for every row
        inputs = (rows.inputs, rows.positions, rows.segments) if rows.segments is not None else (rows.inputs,)
        where = lambda r: r[1:] if len(r) > 1 else (rows.positions, None)  # noqa: E731
        targets = _last_stage_targets(rows, inputs, m.mtp_depth)
        fns = StageFns(
            embed=lambda rest, chunk, r: embed(rest, chunk, r[0], *where(r)),
            layers=lambda rest, chunk, consts, x, r: layers(rest, chunk, consts, x, where(r)),
            head_loss=lambda rest, chunk, h, t: _last_stage_loss(model(rest, chunk), h, t, rows.positions) * scale,
            reports=m.mtp_depth,
            # loss_fn's balance loss: moe_aux_loss x its mean over the batch's rows and the expert layers
            stats_cotangent=None if not m.moe_experts else jnp.zeros((stats_width(m),), jnp.float32).at[-1].set(
                m.moe_aux_loss * jnp.asarray(scale, jnp.float32) / (m.moe_layers * batch.shape[0])))
        rest = {k: v for k, v in params.items() if k != "blocks"}
        loss, stats, g_rest, g_blocks = pipeline_value_and_grad(
            fns, rest, params["blocks"], consts, inputs, targets, mesh=mesh,
            schedule=schedule, S=S, M=resolve_microbatches(S, p.pipeline_microbatches), V=p.pipeline_virtual_stages,
            width=m.d_model, dtype=jnp.dtype(m.compute_dtype))
        grads = {**g_rest, "blocks": g_blocks}
        # Pin the executor's gradients to the parameters' layout: left free, ZeRO-2's reduce-scatter layout
        # (the train step's) propagates back into the schedule's per-tick branches, where XLA then places a resharding
        # collective that only the devices taking that branch reach -- a deadlock (docs/fuzz.md, case 91).
        grads = jax.tree.map(jax.lax.with_sharding_constraint, grads, layout.shardings(layout.param_specs))
        if m.mtp_depth:  # loss_fn's aux: each depth's loss (scaled as the loss), the experts' statistics
            return (loss[0], {"mtp_losses": loss[1:], **({"expert_stats": stats} if m.moe_experts else {})}), grads
        return ((loss, stats) if m.moe_experts else loss), grads

    return value_and_grad


def _last_stage_targets(rows: Rows, inputs: tuple, depth: int):
    """hand_scheduled's targets for the executor: the main ones; with multi-token prediction a tuple of them,
    mtp_rows' tokens and targets [rows, depth, seq] (split into microbatches by row, as the targets) and, with
    documents, the rows' positions and segments (inputs[1:])."""
    if not depth:
        return rows.targets
    return (rows.targets, *(jnp.swapaxes(a, 0, 1) for a in rows.mtp), *inputs[1:])


def _last_stage_loss(stage, h: jax.Array, targets, positions) -> jax.Array:
    """hand_scheduled's last stage: the head's loss on the last layers' output h; with multi-token prediction
    (targets: _last_stage_targets'; `positions` the order's where rows carry none) [the main loss plus
    mtp_loss_weight x the depths' mean, then each depth's] (StageFns.reports), as loss_fn. The modules are in the
    executor's `rest`: their gradient, and the shared table's from their lookups, come from this stage's head
    pullback, summed over pp with the first stage's embedding gradient as a tied head's is. They run outside the
    layer stack, so ZB-H1/ZB-V's B/W split leaves them whole: their weight gradients are taken in this stage's F,
    as the head's."""
    m = stage.cfg
    if not m.mtp_depth:
        return stage.head_loss(h, targets)
    (main, tokens, depth_targets), where = targets[:3], targets[3:] or (positions, None)
    depths = stage.mtp_losses(h, jnp.swapaxes(tokens, 0, 1), jnp.swapaxes(depth_targets, 0, 1), *where)
    return jnp.concatenate([(stage.head_loss(h, main) + m.mtp_loss_weight * jnp.mean(depths))[None], depths])
