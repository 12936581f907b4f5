"""The pipeline's gradients on the hand-scheduled executor: the layout's model loss cut into stages.

jaxpar/parallelize.py picks this for the schedules the executor runs (jaxpar/pipeline/executor.py); the executor's
tick programs come from jaxpar/pipeline/tick_plan.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.core.data.tokens import document_token
from jaxpar.core.model.layer_rules import stacked_sketches
from jaxpar.core.pipeline.schedules import resolve_microbatches
from jaxpar.loss import Rows, split_rows, token_order
from jaxpar.models.decoder import abstract_model
from jaxpar.models.moe import shift_layer_stats, stats_width
from jaxpar.pipeline.executor import StageFns, pipeline_value_and_grad


def balance_cotangent(m, rows: int) -> np.ndarray:
    """The experts' statistics' weight in the loss: the balance loss's moe_aux_loss over rows and expert layers."""
    cotangent = np.zeros((stats_width(m),), np.float32)
    cotangent[-1] = m.moe_aux_loss / (m.moe_layers * rows)
    return cotangent


def hand_scheduled(layout, schedule: str):
    """(params, batch, scale) -> (loss, grads) of the loss times `scale`, on the pipeline executor.

    The executor runs `schedule` over the layout's pp (any schedule: the memory benchmark also runs the GPipe order on
    it). Trace it in
    the parallel context for the executor (jaxpar/parallelize.py): each stage runs its own layers as a scan. With
    experts, ((loss, their statistics summed over rows), grads), as model_loss under jax.value_and_grad: each stage
    reports its layers' statistics, the balance loss weighed in as loss_fn does. With multi-token prediction,
    ((loss, loss_fn's aux dict), grads): the last stage runs the modules after the head (_last_stage_loss).
    """
    cfg, mesh, p, m = layout.cfg, layout.mesh, layout.cfg.parallel, layout.cfg.model
    graphdef, S, eod = abstract_model(m)[0], mesh.shape["pp"], document_token(cfg)
    # each layer's place in the `blocks` stack rides beside the sketches (a stage's first expert layer: the balance
    # bias's per-layer loads, counted over the expert layers as one device counts them)
    consts = {"sketches": stacked_sketches(m), **({"layer": np.arange(m.moe_layers)} if m.moe_experts else {})}
    model = lambda rest, chunk: nnx.merge(graphdef, {**rest, "blocks": chunk})  # a stage's view

    def embed(rest, chunk, tokens, positions, segments):
        """The first stage's input.

        The embedding, then model.moe_first_dense's dense stack whole (it is in `rest`, so its gradient comes
        with the embedding's, from the first stage's recomputed lookup).
        """
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
        where = lambda r: r[1:] if len(r) > 1 else (rows.positions, None)
        targets = _last_stage_targets(rows, inputs, m.mtp_depth)
        fns = StageFns(
            embed=lambda rest, chunk, r: embed(rest, chunk, r[0], *where(r)),
            layers=lambda rest, chunk, consts, x, r: layers(rest, chunk, consts, x, where(r)),
            head_loss=lambda rest, chunk, h, t: _last_stage_loss(model(rest, chunk), h, t, rows.positions),
            reports=m.mtp_depth,
            # loss_fn's balance loss: moe_aux_loss x its mean over the batch's rows and the expert layers
            # a constant (numpy): the executor's shard_map cannot close over a value traced in an enclosing one
            stats_cotangent=None if not m.moe_experts else balance_cotangent(m, batch.shape[0]),
        )
        rest = {k: v for k, v in params.items() if k != "blocks"}
        loss, stats, g_rest, g_blocks = pipeline_value_and_grad(
            fns,
            rest,
            params["blocks"],
            consts,
            inputs,
            targets,
            mesh=mesh,
            schedule=schedule,
            S=S,
            M=resolve_microbatches(S, p.pipeline_microbatches),
            V=p.pipeline_virtual_stages,
            width=m.d_model,
            dtype=jnp.dtype(m.compute_dtype),
            scale=scale,
        )
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
    """hand_scheduled's targets for the executor: the main ones.

    With multi-token prediction a tuple of them, mtp_rows' tokens and targets [rows, depth, seq] (split into
    microbatches by row, as the targets) and, with documents, the rows' positions and segments (inputs[1:]).
    """
    if not depth:
        return rows.targets
    return (rows.targets, *(jnp.swapaxes(a, 0, 1) for a in rows.mtp), *inputs[1:])


def _last_stage_loss(stage, h: jax.Array, targets, positions) -> jax.Array:
    """hand_scheduled's last stage: the head's loss on the last layers' output h.

    With multi-token prediction (targets: _last_stage_targets'; `positions` the order's where rows carry none) [the
    main loss plus mtp_loss_weight x the depths' mean, then each depth's] (StageFns.reports), as loss_fn. The
    modules are in the executor's `rest`: their gradient, and the shared table's from their lookups, come from this
    stage's head pullback, summed over pp with the first stage's embedding gradient as a tied head's is. They run
    outside the layer stack, so ZB-H1/ZB-V's B/W split leaves them whole: their weight gradients are taken in this
    stage's F, as the head's.
    """
    m = stage.cfg
    if not m.mtp_depth:
        return stage.head_loss(h, targets)
    (main, tokens, depth_targets), where = targets[:3], targets[3:] or (positions, None)
    depths = stage.mtp_losses(h, jnp.swapaxes(tokens, 0, 1), jnp.swapaxes(depth_targets, 0, 1), *where)
    return jnp.concatenate([(stage.head_loss(h, main) + m.mtp_loss_weight * jnp.mean(depths))[None], depths])
