"""Hand-scheduled pipeline over `pp`: runs a schedule table from jaxpar/core/pipeline_schedules.py
(1F1B, interleaved, ZB-H1, or GPipe for comparison) tick by tick, each stage doing its own forward or
backward. It knows no model: the caller passes a `StageFns` (embedding, a chunk of layers, head and loss).

Inside `jax.shard_map` over `pp` only (dp/fsdp/tp/sp stay with GSPMD inside each stage), every
device reads its row of precomputed tables at each tick and runs one branch of a `lax.switch`:
idle, or F / B / W of (microbatch, chunk) on the first, a middle or the last virtual stage. Virtual
stage v = chunk * S + device holds layers [v*k, (v+1)*k); the embedding runs on v = 0, head and loss
on v = S*V - 1.

- No hidden recomputation: a forward keeps the residuals of its layers' `jax.vjp` (what the backward
  needs, as `model.remat` decides: everything with `none`, layer inputs with `full`) in a slot of a
  ring of buffers, and the backward applies them to the cotangent that came from the next stage. A
  stage holds as many microbatches' residuals as the schedule keeps in flight: ~S for 1F1B, M for GPipe.
  The last stage differentiates head and loss within its forward (the loss's cotangent is known) and
  keeps the cotangent of its layers' output beside the residuals; the first stage recomputes the
  embedding lookup (a gather) for its gradient.
- ZB-H1 splits the backward: B applies the residuals for the stage input's gradient only, W later for
  the weights' only (XLA drops the unused half of each); residuals and cotangents are kept until W.
- After every tick each device sends its forward output to device d+1 and its input cotangent to
  d-1 (`ppermute`, circular so interleaved chunks wrap from the last device to the first); the
  tables say which slot, if any, keeps what arrives.
- Gradients of the layers stay on their stage; those of the other parameters (`rest`: used on the
  first and the last stage, e.g. a tied embedding) are summed over `pp`.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxpar.core.pipeline_schedules import simulate
from jaxpar.ops import split_microbatches

AXIS = "pp"
HAND_SCHEDULED = ("1f1b", "interleaved", "zb_h1")  # GPipe trains through gpipe.py (jax.grad through its ticks)
# branch index of a tick: what one device does
IDLE, F_MID, F_FIRST, F_LAST, B_MID, B_FIRST, B_LAST, W_MID, W_FIRST, W_LAST = range(10)
BRANCHES = W_LAST + 1  # lax.switch branches of a tick
CODES = {"F": (F_FIRST, F_MID, F_LAST), "B": (B_FIRST, B_MID, B_LAST), "W": (W_FIRST, W_MID, W_LAST)}
# one row per (tick, device): the branch, its chunk and microbatch, the slots it reads its stage input,
# cotangent and residuals from, the residual slot its forward fills, and the slots where this tick's
# arrivals from the neighbours are kept
COLUMNS = ("code", "chunk", "microbatch", "in_slot", "cot_slot", "res_slot", "res_write", "recv_act", "recv_cot")
COL = {name: i for i, name in enumerate(COLUMNS)}


@dataclasses.dataclass(frozen=True)
class StageFns:
    """What a stage computes, as functions of (rest, chunk): `rest` the parameters outside the layer stack,
    `chunk` this virtual stage's slice of it."""
    embed: Callable  # (rest, chunk, tokens) -> x [rows, seq, width]
    layers: Callable  # (rest, chunk, chunk_consts, x) -> h
    head_loss: Callable  # (rest, chunk, h, targets) -> the microbatch's loss (a scalar)


@dataclasses.dataclass(frozen=True)
class TickPlan:
    tables: np.ndarray  # [ticks, devices, COLUMNS] int32
    act_slots: int  # received stage-input buffers per device, + 1 spare
    cot_slots: int  # received-cotangent buffers per device, + 1 spare
    res_slots: int  # residual buffers per device (microbatch-chunks between F and the end of their backward), + 1


def _allocate(intervals: list[tuple[int, int, object]]) -> tuple[dict, int]:
    """Greedy slots for [start, end] tick intervals (a slot is reusable after its end tick)."""
    free_after, slot_of = [], {}
    for start, end, key in sorted(intervals, key=lambda x: x[0]):
        slot = next((i for i, f in enumerate(free_after) if f < start), None)
        if slot is None:
            slot = len(free_after)
            free_after.append(end)
        free_after[slot] = end
        slot_of[key] = slot
    return slot_of, len(free_after)


def tick_plan(schedule: str, S: int, M: int, V: int) -> TickPlan:
    table, last = simulate(schedule, S, M, V), S * V - 1
    when = {}  # (kind, microbatch, virtual stage) -> tick
    for t, row in enumerate(table):
        for d, op in enumerate(row):
            if op is not None:
                when[(op.kind, op.microbatch, op.chunk * S + d)] = t
    # what each device must keep until the backward is over (ZB-H1: until W): an arrived stage input until
    # its forward has run, an arrived cotangent, and the residuals of each forward
    end = lambda m, v: when.get(("W", m, v), when[("B", m, v)])  # noqa: E731
    acts, cots, res = ([[] for _ in range(S)] for _ in range(3))
    for m in range(M):
        for v in range(last + 1):
            res[v % S].append((when[("F", m, v)], end(m, v), (m, v)))
            if v:
                acts[v % S].append((when[("F", m, v - 1)] + 1, when[("F", m, v)], (m, v)))
            if v < last:
                cots[v % S].append((when[("B", m, v + 1)] + 1, end(m, v), (m, v)))
    act_slot, cot_slot, res_slot = ([_allocate(x) for x in kept] for kept in (acts, cots, res))
    n_act, n_cot, n_res = (max(n for _, n in slots) + 1 for slots in (act_slot, cot_slot, res_slot))  # + scratch
    out = np.zeros((len(table), S, len(COLUMNS)), np.int32)
    for name, scratch in (("in_slot", n_act), ("recv_act", n_act), ("cot_slot", n_cot), ("recv_cot", n_cot),
                          ("res_slot", n_res), ("res_write", n_res)):
        out[..., COL[name]] = scratch - 1
    for (kind, m, v), t in when.items():
        d, first, final = v % S, v == 0, v == last
        code = CODES[kind][0 if first else 2 if final else 1]
        out[t, d, [COL["code"], COL["chunk"], COL["microbatch"]]] = code, v // S, m
        out[t, d, COL["res_write" if kind == "F" else "res_slot"]] = res_slot[d][0][(m, v)]
        if kind == "F" and not first:
            out[t, d, COL["in_slot"]] = act_slot[d][0][(m, v)]
            out[when[("F", m, v - 1)] + 1, d, COL["recv_act"]] = act_slot[d][0][(m, v)]
        if kind != "F" and not final:
            out[t, d, COL["cot_slot"]] = cot_slot[d][0][(m, v)]
            if kind == "B":
                out[when[("B", m, v + 1)] + 1, d, COL["recv_cot"]] = cot_slot[d][0][(m, v)]
    return TickPlan(out, n_act, n_cot, n_res)


class _Stage:
    """One device's side of the executor inside shard_map: its chunks of the model, and the branch each tick
    code runs. A branch takes (acts, cots, stash, own, grads, op) and returns (activation to send, cotangent to
    send, residuals to keep, the loss's own cotangent to keep, grads)."""

    def __init__(self, fns: StageFns, rest, blocks, consts, inputs, targets, M: int, act_shape, dtype, split: bool):
        self.fns, self.rest, self.blocks, self.consts = fns, rest, blocks, consts
        self.inputs, self.targets, self.M, self.dtype, self.split = inputs, targets, M, dtype, split
        self.zeros = jnp.zeros(act_shape, dtype)
        # residuals have one structure for every chunk, stage and microbatch: their buffers, and how to rebuild a
        # pullback from a slot of them
        found = {}

        def probe(x):
            _, leaves, found["treedef"] = self.layers_vjp(0, x)
            return leaves

        self.shapes = jax.eval_shape(probe, self.zeros)
        self.treedef = found["treedef"]

    @staticmethod
    def at(tree, i):
        return jax.tree.map(lambda w: w[i], tree)

    def layers_vjp(self, c, x):
        """The chunk's layers on x, and their pullback as a flat list of residuals."""
        h, pullback = jax.vjp(lambda b, x: self.fns.layers(self.rest, b, self.at(self.consts, c), x),
                              self.at(self.blocks, c), x)
        return h, jax.tree.leaves(pullback), jax.tree.structure(pullback)

    def new_stash(self, slots: int) -> list:
        return [jnp.zeros((slots,) + s.shape, s.dtype) for s in self.shapes]

    def no_residuals(self) -> list:
        return [jnp.zeros(s.shape, s.dtype) for s in self.shapes]

    def idle(self, acts, cots, stash, own, grads, op):
        return self.zeros, self.zeros, self.no_residuals(), self.zeros, grads

    def forward(self, first: bool, last: bool):
        def run(acts, cots, stash, own, grads, op):
            c, m = op["chunk"], op["microbatch"]
            x = self.fns.embed(self.rest, self.at(self.blocks, c), self.inputs[m]) if first else acts[op["in_slot"]]
            h, residuals, _ = self.layers_vjp(c, x)
            g_rest, g_blocks, loss_sum = grads
            d_h = self.zeros
            if last:  # head and loss differentiated now: their cotangent is the loss's 1/M
                loss, head_pullback = jax.vjp(
                    lambda r, h: self.fns.head_loss(r, self.at(self.blocks, c), h, self.targets[m]), self.rest, h)
                d_rest, d_h = head_pullback(jnp.asarray(1.0 / self.M, loss.dtype))
                g_rest, loss_sum = jax.tree.map(jnp.add, g_rest, d_rest), loss_sum + loss
            return h.astype(self.dtype), self.zeros, residuals, d_h.astype(self.dtype), (g_rest, g_blocks, loss_sum)
        return run

    def pullback(self, cots, stash, own, op, last: bool):
        """(gradient of the chunk's weights, of its input) from the kept residuals."""
        pullback = jax.tree.unflatten(self.treedef, [buf[op["res_slot"]] for buf in stash])
        return pullback(own[op["res_slot"]] if last else cots[op["cot_slot"]])

    def add_weights(self, grads, op, first: bool, d_chunk, d_x):
        g_rest, g_blocks, loss_sum = grads
        g_blocks = jax.tree.map(lambda a, g: a.at[op["chunk"]].add(g), g_blocks, d_chunk)
        if first:  # the embedding's gradient: its lookup recomputed under vjp (a gather)
            _, embed_pullback = jax.vjp(
                lambda r: self.fns.embed(r, self.at(self.blocks, op["chunk"]), self.inputs[op["microbatch"]]),
                self.rest)
            g_rest = jax.tree.map(jnp.add, g_rest, embed_pullback(d_x.astype(self.dtype))[0])
        return g_rest, g_blocks, loss_sum

    def backward(self, first: bool, last: bool):
        """The whole backward (1F1B, interleaved), or ZB-H1's B: the input gradient only (none on the first
        stage, whose input is the tokens)."""
        def run(acts, cots, stash, own, grads, op):
            if self.split and first:
                return self.idle(acts, cots, stash, own, grads, op)
            d_chunk, d_x = self.pullback(cots, stash, own, op, last)
            if not self.split:
                grads = self.add_weights(grads, op, first, d_chunk, d_x)
            return self.zeros, d_x.astype(self.dtype), self.no_residuals(), self.zeros, grads
        return run

    def weights(self, first: bool, last: bool):
        """ZB-H1's W: the weight gradient."""
        def run(acts, cots, stash, own, grads, op):
            d_chunk, d_x = self.pullback(cots, stash, own, op, last)
            return self.zeros, self.zeros, self.no_residuals(), self.zeros, self.add_weights(grads, op, first,
                                                                                             d_chunk, d_x)
        return run

    def branches(self) -> list:
        """Indexed by the tick code (CODES): idle, then F, B, W each as (middle, first, last) stage."""
        return [self.idle, *(make(first, last) for make in (self.forward, self.backward, self.weights)
                             for first, last in ((False, False), (True, False), (False, True)))]


def pipeline_value_and_grad(fns: StageFns, rest, blocks, consts, inputs, targets, *, mesh, schedule: str,
                            S: int, M: int, V: int, width: int, dtype):
    """(mean loss, grads of `rest`, grads of `blocks`) of a model pipelined over `pp`: S stages, M
    microbatches, V chunks per stage. blocks (trained) and consts (not) carry a leading layers axis;
    inputs/targets are [rows, seq] token ids in the order the model reads them."""
    plan = tick_plan(schedule, S, M, V)
    inputs, targets = split_microbatches(inputs, M), split_microbatches(targets, M)
    L = jax.tree.leaves(blocks)[0].shape[0]
    staged = lambda w: jnp.asarray(w).reshape(V, S, L // (S * V), *w.shape[1:])  # noqa: E731  [chunk, stage, layer]
    blocks, consts = jax.tree.map(staged, blocks), jax.tree.map(staged, consts)
    act_shape = inputs.shape[1:] + (width,)

    def body(rest, blocks, consts, inputs, targets, tables):
        blocks, consts = (jax.tree.map(lambda w: w[:, 0], t) for t in (blocks, consts))  # this device's chunks
        stage = _Stage(fns, rest, blocks, consts, inputs, targets, M, act_shape, dtype, split=schedule == "zb_h1")
        device, branches = jax.lax.axis_index(AXIS), stage.branches()

        def tick(carry, rows):
            acts, cots, stash, own, grads, got_act, got_cot = carry
            op = {name: rows[device, i] for name, i in COL.items()}
            acts = acts.at[op["recv_act"]].set(got_act)  # what the neighbours sent last tick
            cots = cots.at[op["recv_cot"]].set(got_cot)
            send_act, send_cot, residuals, d_h, grads = jax.lax.switch(
                op["code"], branches, acts, cots, stash, own, grads, op)
            stash = [buf.at[op["res_write"]].set(r) for buf, r in zip(stash, residuals)]  # a forward's, else scratch
            own = own.at[op["res_write"]].set(d_h)
            got_act = jax.lax.ppermute(send_act, AXIS, [(i, (i + 1) % S) for i in range(S)])
            got_cot = jax.lax.ppermute(send_cot, AXIS, [(i, (i - 1) % S) for i in range(S)])
            return (acts, cots, stash, own, grads, got_act, got_cot), None

        zeros = stage.zeros
        grads = (jax.tree.map(jnp.zeros_like, rest), jax.tree.map(jnp.zeros_like, blocks), jnp.zeros((), jnp.float32))
        carry = (jnp.zeros((plan.act_slots,) + act_shape, dtype), jnp.zeros((plan.cot_slots,) + act_shape, dtype),
                 stage.new_stash(plan.res_slots), jnp.zeros((plan.res_slots,) + act_shape, dtype), grads, zeros, zeros)
        (_, _, _, _, (g_rest, g_blocks, loss_sum), _, _), _ = jax.lax.scan(tick, carry, tables)
        g_rest, loss_sum = jax.lax.psum((g_rest, loss_sum), AXIS)
        return loss_sum / M, g_rest, jax.tree.map(lambda g: g[:, None], g_blocks)

    loss, g_rest, g_blocks = jax.shard_map(
        body, mesh=mesh, axis_names={AXIS}, check_vma=False,
        in_specs=(P(), P(None, AXIS), P(None, AXIS), P(), P(), P()), out_specs=(P(), P(), P(None, AXIS)),
    )(rest, blocks, consts, inputs, targets, jnp.asarray(plan.tables))
    return loss, g_rest, jax.tree.map(lambda g: g.reshape(L, *g.shape[3:]), g_blocks)
