"""Hand-scheduled pipeline over `pp`.

Runs a schedule table from jaxpar/core/pipeline/schedules.py (1F1B, interleaved, ZB-H1, ZB-V, DualPipeV, or GPipe for
comparison) tick by tick, each stage doing its own forward or backward. It knows no model: the caller passes a
`StageFns` (embedding, a chunk of layers, head and loss).

Inside `jax.shard_map` over `pp` only (dp/fsdp/tp/sp stay with GSPMD inside each stage), every
device reads its row of precomputed tables at each tick and runs one branch of a `lax.switch`:
idle, or F / B / W of (microbatch, chunk) on the first, a middle or the last virtual stage. Virtual
stage v holds layers [v*k, (v+1)*k) and runs on a device's chunk as pipeline_schedules.placement says (round
robin v = chunk * S + device; ZB-V's V: device d holds d and 2S-1-d); the embedding runs on v = 0, head and
loss on the last.

- No hidden recomputation: a forward keeps the residuals of its layers' `jax.vjp` (what the backward
  needs, as `model.remat` decides: everything with `none`, layer inputs with `full`) in a slot of a
  ring of buffers, and the backward applies them to the cotangent that came from the next stage. A
  stage holds as many microbatches' residuals as the schedule keeps in flight: ~S for 1F1B, M for GPipe.
  The last stage differentiates head and loss within its forward (the loss's cotangent is known) and
  keeps the cotangent of its layers' output beside the residuals; the first stage recomputes the
  embedding lookup (a gather) for its gradient.
- ZB-H1 and ZB-V split the backward: B applies the residuals for the stage input's gradient (and every gradient
  but the projections' weights'), W later computes the projections' weight gradients x^T dy and nothing else,
  traced through ops.split_backward. B's pullback hands out each projection's input x and output gradient dy (as
  the cotangents of zero taps), so W recomputes nothing under any model.remat: B recomputes what the policy did not
  keep, as 1F1B's backward does. From B to W a stage keeps every projection's x and dy of the microbatch-chunk
  (in residual buffers B has done with where shapes match, else in "tap" buffers): with remat that is more than
  the layer inputs the residuals were (GPT: 16 activations' worth per layer against 1), the memory ZB pays for W
  without a recomputed forward; the cotangent that arrived is dropped at B.
- DualPipeV places its chunks as ZB-V and adds two ops: BW, a whole backward (B, then W at once from the x and dy
  B hands out, nothing kept), and FB, a forward and another microbatch-chunk's BW in one tick (the forward's output
  and the BW's input gradient both sent at the tick's end). A BW reads its own columns (b_chunk, b_microbatch,
  b_res_slot, b_cot_slot), so one row holds both halves of an FB; its drain splits B and W as ZB's.
- The tables (jaxpar/pipeline/tick_plan.py) say what each device does at each tick and where it keeps what.
- After every tick each device sends its forward output to device d+1 and its input cotangent to
  d-1 (`ppermute`, circular so interleaved chunks wrap from the last device to the first); the
  tables say which slot, if any, keeps what arrives. ZB-V's second chunk runs back up the devices, so
  there both go both ways (twice the bytes of a one-way schedule), and at the V's turn (virtual stage S-1 to
  S, both on the last device) the output stays on its device.
- Gradients of the layers stay on their stage; those of the other parameters (`rest`: used on the
  first and the last stage, e.g. a tied embedding) are summed over `pp`.
- Per-row statistics the layers report beside their output (a mixture of experts': loads, drops, balance loss)
  enter the loss linearly with a weight known up front (`StageFns.stats_cotangent`): a forward sums its chunk's
  over the rows into the device's total (summed over `pp` at the end, as one device sums them over the layers and
  rows), and every backward pulls that weight back beside the output's cotangent.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxpar.core.pipeline.schedules import chunks, virtual_stage
from jaxpar.ops import split_backward, split_microbatches
from jaxpar.pipeline.tick_plan import COL, COLUMNS, SPLIT, TickPlan, tick_plan
from jaxpar.sharding import context_mesh

AXIS = "pp"


@dataclasses.dataclass(frozen=True)
class StageFns:
    """What a stage computes, as functions of (rest, chunk).

    `rest` the parameters outside the layer stack, `chunk` this virtual stage's slice of it.
    """

    # `inputs`: a microbatch's slice of pipeline_value_and_grad's (token ids, or a tuple of per-row arrays)
    embed: Callable  # (rest, chunk, inputs) -> x [rows, seq, width]
    layers: Callable  # (rest, chunk, chunk_consts, x, inputs) -> h; with stats_cotangent (h, stats [rows, n])
    # `targets`: the microbatch's slice of pipeline_value_and_grad's; with `reports`, head_loss returns [1 + reports]
    head_loss: Callable  # (rest, chunk, h, targets) -> the microbatch's loss (a scalar)
    reports: int = 0  # values head_loss reports after the loss (MTP's depths): no gradient, their means returned
    # [n]: the loss's derivative by each per-row statistic the layers report (the loss adds their sum over rows
    # and microbatches times it); None: the layers report none
    stats_cotangent: jax.Array | None = None


def _place_taps(residuals: list, taps: list) -> list[tuple[str, int]]:
    """Where B keeps each tap (a projection's output gradient or input) for W.

    ("res", j), residual buffer j, which has its shape and dtype and which B has done with; ("tap", k), a buffer of
    its own, where no residual matches.
    """
    free, places = [(tuple(r.shape), r.dtype) for r in residuals], []
    for tap in taps:
        if (tuple(tap.shape), tap.dtype) in free:
            j = free.index((tuple(tap.shape), tap.dtype))
            free[j] = None
            places.append(("res", j))
        else:
            places.append(("tap", sum(pool == "tap" for pool, _ in places)))
    return places


class _Stage:
    """One device's side of the executor inside shard_map: its chunks of the model, and the branch each tick code runs.

    A branch takes (acts, cots, stash, own, grads, op) and returns (activation to send, cotangent to send, what to
    keep in each pool of the stash, the loss's own cotangent to keep, grads). The stash's pools, each a list of
    buffers with a slot per microbatch-chunk in flight: "res", the forward's residuals for the backward; with
    `split` (ZB: W as the projections' weight gradients alone) also "tap": B writes each projection's output
    gradient and input for W into a residual buffer of its shape (B's residuals are dead then) or, where there is
    none, into a buffer of "tap".
    """

    def __init__(
        self, fns: StageFns, rest, blocks, consts, inputs, targets, M: int, act_shape, dtype, split: bool, scale
    ):
        self.fns, self.rest, self.blocks, self.consts, self.scale = fns, rest, blocks, consts, scale
        self.inputs, self.targets, self.M, self.dtype, self.split = inputs, targets, M, dtype, split
        self.zeros = jnp.zeros(act_shape, dtype)
        n = 0 if fns.stats_cotangent is None else fns.stats_cotangent.shape[0]
        # every microbatch's statistics get the same cotangent: the loss is linear in them
        self.d_stats = (
            jnp.zeros((act_shape[0], 0), jnp.float32)
            if not n
            else jnp.broadcast_to(jnp.asarray(fns.stats_cotangent, jnp.float32) * scale, (act_shape[0], n))
        )
        self.projections = []  # (input, output) of each projection, stacked over the chunk's layers (split)
        if split:

            def probe(x):
                with split_backward("probe") as traced:
                    self.layers(self.at(self.blocks, 0), self.at(self.consts, 0), x, self.rows(0))
                return traced.recorded

            self.projections = jax.eval_shape(probe, self.zeros)
        # residuals have one structure for every chunk, stage and microbatch: their buffers, and how to rebuild a
        # pullback from a slot of them
        found = {}

        def probe(x):
            _, _, leaves, found["treedef"] = self.layers_vjp(0, 0, x)
            return leaves

        residuals = jax.eval_shape(probe, self.zeros)
        taps = [t for x, y in self.projections for t in (y, x)]  # B's order: (dy, x) of each projection
        self.treedef, self.tap_at = found["treedef"], _place_taps(residuals, taps)
        self.shapes = {"res": residuals, "tap": [t for t, (pool, _) in zip(taps, self.tap_at) if pool == "tap"]}

    @staticmethod
    def at(tree, i):
        return jax.tree.map(lambda w: w[i], tree)

    def rows(self, m):
        """Microbatch m's slice of the inputs."""
        return jax.tree.map(lambda a: a[m], self.inputs)

    def layers(self, chunk, consts, x, rows):
        """(the chunk's output, its per-row statistics: [rows, 0] where the layers report none)."""
        out = self.fns.layers(self.rest, chunk, consts, x, rows)
        return out if self.fns.stats_cotangent is not None else (out, jnp.zeros((x.shape[0], 0), jnp.float32))

    def layers_vjp(self, c, m, x):
        """Chunk c's layers on x (of microbatch m): output, statistics, and their pullback as a flat list of residuals.

        With `split` the pullback gives no projection weight a gradient, and the taps each projection's (output
        gradient, input).
        """
        chunk, consts, rows = self.at(self.blocks, c), self.at(self.consts, c), self.rows(m)
        if not self.split:
            (h, stats), pullback = jax.vjp(lambda b, x: self.layers(b, consts, x, rows), chunk, x)
            return h, stats, jax.tree.leaves(pullback), jax.tree.structure(pullback)

        def tapped(b, x, taps):
            with split_backward("tap", taps):
                return self.layers(b, consts, x, rows)

        taps = [(jnp.zeros(y.shape, y.dtype), jnp.zeros(x.shape, x.dtype)) for x, y in self.projections]
        (h, stats), pullback = jax.vjp(tapped, chunk, x, taps)
        return h, stats, jax.tree.leaves(pullback), jax.tree.structure(pullback)

    def new_stash(self, plan: TickPlan) -> dict:
        slots = {"res": plan.res_slots, "tap": plan.tap_slots}
        return {
            pool: [jnp.zeros((slots[pool],) + s.shape, s.dtype) for s in shapes] for pool, shapes in self.shapes.items()
        }

    def zero_sums(self) -> tuple:
        """The loss's and the statistics' running sums before the first forward."""
        return jnp.zeros((1 + self.fns.reports,), jnp.float32), jnp.zeros(self.d_stats.shape[1:], jnp.float32)

    def nothing_kept(self) -> dict:
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self.shapes)

    def idle(self, acts, cots, stash, own, grads, op):
        return self.zeros, self.zeros, self.nothing_kept(), self.zeros, grads

    def forward(self, first: bool, last: bool):
        def run(acts, cots, stash, own, grads, op):
            c, m = op["chunk"], op["microbatch"]
            x = self.fns.embed(self.rest, self.at(self.blocks, c), self.rows(m)) if first else acts[op["in_slot"]]
            h, stats, residuals, _ = self.layers_vjp(c, m, x)
            g_rest, g_blocks, loss_sum, stats_sum = grads
            stats_sum = stats_sum + jnp.sum(stats, axis=0)
            d_h = self.zeros
            if last:  # head and loss differentiated now: their cotangent is the loss's 1/M (the reports' zero)
                loss, head_pullback = jax.vjp(
                    lambda r, h: jnp.reshape(
                        self.fns.head_loss(r, self.at(self.blocks, c), h, self.at(self.targets, m)) * self.scale,
                        (-1,),
                    ),
                    self.rest,
                    h,
                )
                d_rest, d_h = head_pullback(jnp.zeros(loss.shape, loss.dtype).at[0].set(1.0 / self.M))
                g_rest, loss_sum = jax.tree.map(jnp.add, g_rest, d_rest), loss_sum + loss
            kept = {**self.nothing_kept(), "res": residuals}
            return (
                h.astype(self.dtype),
                self.zeros,
                kept,
                d_h.astype(self.dtype),
                (g_rest, g_blocks, loss_sum, stats_sum),
            )

        return run

    def pullback(self, cots, stash, own, op, last: bool):
        """The cotangents of the chunk's weights and of its input (split: and of its taps) from the kept residuals."""
        pullback = jax.tree.unflatten(self.treedef, [buf[op["res_slot"]] for buf in stash["res"]])
        d_h = own[op["res_slot"]] if last else cots[op["cot_slot"]]
        return pullback((d_h, self.d_stats))

    def add_weights(self, grads, op, first: bool, d_chunk, d_x):
        g_rest, g_blocks, *sums = grads
        g_blocks = jax.tree.map(lambda a, g: a.at[op["chunk"]].add(g), g_blocks, d_chunk)
        if first:  # the embedding's gradient: its lookup recomputed under vjp (a gather)
            _, embed_pullback = jax.vjp(
                lambda r: self.fns.embed(r, self.at(self.blocks, op["chunk"]), self.rows(op["microbatch"])), self.rest
            )
            g_rest = jax.tree.map(jnp.add, g_rest, embed_pullback(d_x.astype(self.dtype))[0])
        return g_rest, g_blocks, *sums

    def backward(self, first: bool, last: bool):
        """The whole backward (1F1B, interleaved), or ZB's B.

        The input gradient and every gradient but the projections' weights', the projections' output gradients
        and inputs kept for W.
        """

        def run(acts, cots, stash, own, grads, op):
            d_chunk, d_x, *d_taps = self.pullback(cots, stash, own, op, last)
            grads = self.add_weights(grads, op, first, d_chunk, d_x)
            kept = self.nothing_kept()
            for tap, (pool, i) in zip([t for pair in d_taps[0] for t in pair] if d_taps else [], self.tap_at):
                kept[pool][i] = tap
            return self.zeros, d_x.astype(self.dtype), kept, self.zeros, grads

        return run

    def weight_grads(self, grads, op, pairs):
        """`grads` plus the projections' weight gradients alone, from the (input, output gradient) pairs in `pairs`.

        Each weight gradient is x^T dy of a projection's pair (ops.split_backward: the layers traced again, everything
        but those products dead).
        """
        c = op["chunk"]

        def surrogate(b):
            with split_backward("weights", pairs) as traced:
                self.layers(b, self.at(self.consts, c), self.zeros, self.rows(op["microbatch"]))
            return sum(jnp.sum(r) for r in traced.recorded)

        return self.add_weights(grads, op, False, jax.grad(surrogate)(self.at(self.blocks, c)), None)

    def weights(self, first: bool, last: bool):
        """ZB's W, from what B kept."""

        def run(acts, cots, stash, own, grads, op):
            kept = [stash[pool][i][op[f"{pool}_slot"]] for pool, i in self.tap_at]
            grads = self.weight_grads(grads, op, [(x, dy) for dy, x in zip(kept[::2], kept[1::2])])
            return self.zeros, self.zeros, self.nothing_kept(), self.zeros, grads

        return run

    def whole_backward(self, first: bool, last: bool):
        """DualPipeV's BW, of the b_ columns' microbatch-chunk: B, then W from the taps B hands out (none kept)."""

        def run(acts, cots, stash, own, grads, op):
            op = {**op, **{k: op[f"b_{k}"] for k in ("chunk", "microbatch", "res_slot", "cot_slot")}}
            d_chunk, d_x, d_taps = self.pullback(cots, stash, own, op, last)
            grads = self.add_weights(grads, op, first, d_chunk, d_x)
            grads = self.weight_grads(grads, op, [(x, dy) for dy, x in d_taps])
            return self.zeros, d_x.astype(self.dtype), self.nothing_kept(), self.zeros, grads

        return run

    def overlapped(self, f_at: tuple[bool, bool], b_at: tuple[bool, bool]):
        """DualPipeV's FB: a forward and another microbatch-chunk's BW in one tick.

        The forward's activation is sent on and its residuals kept; the BW's input gradient is sent back. `f_at`,
        `b_at`: (first, last) of each.
        """
        forward, backward = self.forward(*f_at), self.whole_backward(*b_at)

        def run(acts, cots, stash, own, grads, op):
            send_act, _, kept, d_h, grads = forward(acts, cots, stash, own, grads, op)
            _, send_cot, _, _, grads = backward(acts, cots, stash, own, grads, op)
            return send_act, send_cot, kept, d_h, grads

        return run

    def branches(self, dual: bool) -> list:
        """Indexed by the tick code (CODES, FB_CODES).

        Idle, then F, B, W, BW each as (middle, first, last) stage, then FB as (middle, middle), (first, last),
        (last, first) (idle where the schedule has none: W without `split`, BW and FB without `dual`,
        DualPipeV).
        """
        absent = lambda *_: self.idle
        makers = (
            self.forward,
            self.backward,
            self.weights if self.split else absent,
            self.whole_backward if dual else absent,
        )
        places = ((False, False), (True, False), (False, True))
        fb = [self.overlapped(places[f], places[b]) if dual else self.idle for f, b in ((0, 0), (1, 2), (2, 1))]
        return [self.idle, *(make(first, last) for make in makers for first, last in places), *fb]


def _exchange(used: tuple, S: int, send_act, send_cot) -> dict:
    """Each used receive column's arrival: ppermute to d+1 ("left" of the receiver) and d-1, or kept here."""
    up, down = [(i, (i + 1) % S) for i in range(S)], [(i, (i - 1) % S) for i in range(S)]
    moves = {
        "left": lambda x: jax.lax.ppermute(x, AXIS, up),
        "self": lambda x: x,
        "right": lambda x: jax.lax.ppermute(x, AXIS, down),
    }
    return {name: moves[name.rsplit("_", 1)[1]](send_act if "_act_" in name else send_cot) for name in used}


def pipeline_value_and_grad(
    fns: StageFns,
    rest,
    blocks,
    consts,
    inputs,
    targets,
    *,
    mesh,
    schedule: str,
    S: int,
    M: int,
    V: int,
    width: int,
    dtype,
    scale=1.0,
):
    """Loss, statistics and gradients of a model pipelined over `pp`: S stages, M microbatches, V chunks per stage.

    The loss (and the statistics' cotangent) times `scale`, which enters the shard_map as an argument: a value traced
    inside an enclosing shard_map (DiLoCo's, parallel.grad_compression's) cannot be closed over here.

    Returns (mean loss (with fns.reports: [1 + reports], then the reports' means), the layers' statistics summed over
    rows and microbatches ([0] without fns.stats_cotangent), grads of `rest`, grads of `blocks`).
    blocks (trained) and consts (not) carry a leading layers axis; inputs/targets are [rows, seq] token ids in the
    order the model reads them (inputs may be a tuple of such per-row arrays: the stage functions read each
    microbatch's slice; targets a tuple whose first is the token ids, head_loss reading each's).
    """
    plan, C = tick_plan(schedule, S, M, V), chunks(schedule, V)
    inputs, targets = (jax.tree.map(lambda a: split_microbatches(a, M), t) for t in (inputs, targets))
    L = jax.tree.leaves(blocks)[0].shape[0]
    # [chunk, stage, layer]: the layers of virtual stage virtual_stage(c, d) at [c, d]
    order = np.array([virtual_stage(schedule, S, d, c) for c in range(C) for d in range(S)])
    permute = (lambda x, idx: x[idx]) if np.any(order != np.arange(C * S)) else (lambda x, idx: x)
    staged = lambda w: permute(jnp.asarray(w).reshape(C * S, L // (S * C), *w.shape[1:]), order).reshape(
        C, S, L // (S * C), *w.shape[1:]
    )
    blocks, consts = jax.tree.map(staged, blocks), jax.tree.map(staged, consts)
    act_shape = jax.tree.leaves(targets)[0].shape[1:] + (width,)
    used = tuple(
        name
        for name in COLUMNS[COL["recv_act_left"] :]  # a tuple in COLUMNS' order: every process
        if np.any(plan.tables[..., COL[name]] != (plan.act_slots if "act" in name else plan.cot_slots) - 1)
    )

    def body(rest, blocks, consts, inputs, targets, tables, scale):
        blocks, consts = (jax.tree.map(lambda w: w[:, 0], t) for t in (blocks, consts))  # this device's chunks
        split = schedule in SPLIT
        stage = _Stage(fns, rest, blocks, consts, inputs, targets, M, act_shape, dtype, split=split, scale=scale)
        device, branches = jax.lax.axis_index(AXIS), stage.branches(dual=schedule == "dualpipev")

        def tick(carry, rows):
            acts, cots, stash, own, grads, got = carry
            op = {name: rows[device, i] for name, i in COL.items()}
            for name in used:  # what the neighbours (or this device) sent last tick
                if name.startswith("recv_act"):
                    acts = acts.at[op[name]].set(got[name])
                else:
                    cots = cots.at[op[name]].set(got[name])
            send_act, send_cot, kept, d_h, grads = jax.lax.switch(
                op["code"], branches, acts, cots, stash, own, grads, op
            )
            # a forward's residuals and inputs, a B's output gradients; else written to the scratch slot
            stash = {
                pool: [buf.at[op[f"{pool}_write"]].set(r) for buf, r in zip(stash[pool], kept[pool])] for pool in stash
            }
            own = own.at[op["res_write"]].set(d_h)
            return (acts, cots, stash, own, grads, _exchange(used, S, send_act, send_cot)), None

        grads = (*jax.tree.map(jnp.zeros_like, (rest, blocks)), *stage.zero_sums())
        carry = (
            jnp.zeros((plan.act_slots,) + act_shape, dtype),
            jnp.zeros((plan.cot_slots,) + act_shape, dtype),
            stage.new_stash(plan),
            jnp.zeros((plan.res_slots,) + act_shape, dtype),
            grads,
            {name: stage.zeros for name in used},
        )
        (_, _, _, _, (g_rest, g_blocks, loss_sum, stats), _), _ = jax.lax.scan(tick, carry, tables)
        g_rest, loss_sum, stats = jax.lax.psum((g_rest, loss_sum, stats), AXIS)
        g_blocks = jax.tree.map(lambda g: g[:, None], g_blocks)
        loss = loss_sum / M + jnp.zeros_like(loss_sum).at[0].set(jnp.sum(stats * stage.d_stats[0]))
        return (loss if fns.reports else loss[0]), stats, g_rest, g_blocks

    loss, stats, g_rest, g_blocks = jax.shard_map(
        body,
        mesh=context_mesh(mesh),
        axis_names={AXIS},
        check_vma=False,
        in_specs=(P(), P(None, AXIS), P(None, AXIS), P(), P(), P(), P()),
        out_specs=(P(), P(), P(), P(None, AXIS)),
    )(rest, blocks, consts, inputs, targets, jnp.asarray(plan.tables), jnp.asarray(scale, jnp.float32))
    back = np.argsort(order)  # [chunk, stage] order -> virtual stages in model order
    return (
        loss,
        stats,
        g_rest,
        jax.tree.map(lambda g: permute(g.reshape(C * S, *g.shape[2:]), back).reshape(L, *g.shape[3:]), g_blocks),
    )
