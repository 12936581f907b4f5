"""Hand-scheduled pipeline over `pp`: runs a schedule table from jaxpar/core/pipeline_schedules.py
(1F1B, interleaved, or GPipe for comparison) tick by tick, each stage doing its own forward or backward.
It knows no model: the caller passes `stage_forward`, the computation of one virtual stage.

Inside `jax.shard_map` over `pp` only (dp/fsdp/tp/sp stay with GSPMD inside each stage), every
device reads its row of precomputed tables at each tick and runs one branch of a `lax.switch`:
idle, forward or backward of (microbatch, chunk), first / middle / last virtual stage. Virtual
stage v = chunk * S + device holds layers [v*k, (v+1)*k); `stage_forward` runs the embedding on
v = 0 (`first`) and the head and loss on v = S*V - 1 (`last`).

- Forward keeps only the stage *input* (in a slot of a ring of buffers); the backward recomputes the
  stage under `jax.vjp` and applies the cotangent that came from the next stage. A stage therefore
  holds at most as many microbatch inputs as the schedule keeps in flight: ~S for 1F1B, M for GPipe.
- ZB-H1 splits the backward: B takes the vjp with respect to the stage input only (XLA drops the weight
  gradients' matmuls from it), W later with respect to the weights only, from the same kept input and
  cotangent (both held until W). Each recomputes the stage's forward.
- After every tick each device sends its forward output to device d+1 and its input cotangent to
  d-1 (`ppermute`, circular so interleaved chunks wrap from the last device to the first); the
  tables say which slot, if any, keeps what arrives.
- Gradients of the layers stay on their stage; those of the other parameters (`rest`: used on the
  first and the last stage, e.g. a tied embedding) are summed over `pp`.
"""
from __future__ import annotations

import dataclasses

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
CODES = {"F": (F_FIRST, F_MID, F_LAST), "B": (B_FIRST, B_MID, B_LAST), "W": (W_FIRST, W_MID, W_LAST)}
# one row per (tick, device): the branch, its chunk and microbatch, the slots it reads its stage input
# and cotangent from, and the slots where this tick's arrivals from the neighbours are kept
COLUMNS = ("code", "chunk", "microbatch", "in_slot", "cot_slot", "recv_act", "recv_cot")
COL = {name: i for i, name in enumerate(COLUMNS)}


@dataclasses.dataclass(frozen=True)
class TickPlan:
    tables: np.ndarray  # [ticks, devices, COLUMNS] int32
    act_slots: int  # stage-input buffers per device (the memory the schedule costs), + 1 spare
    cot_slots: int  # received-cotangent buffers per device, + 1 spare


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
    # what each device must keep: a stage input from its arrival to its (weight) backward, a cotangent likewise
    acts = [[] for _ in range(S)]
    cots = [[] for _ in range(S)]
    end = lambda m, v: when.get(("W", m, v), when[("B", m, v)])  # noqa: E731
    for m in range(M):
        for v in range(1, last + 1):
            acts[v % S].append((when[("F", m, v - 1)] + 1, end(m, v), (m, v)))
        for v in range(last):
            cots[v % S].append((when[("B", m, v + 1)] + 1, end(m, v), (m, v)))
    act_slot, cot_slot = [_allocate(a) for a in acts], [_allocate(c) for c in cots]
    n_act = max(n for _, n in act_slot) + 1  # the last slot is scratch for "nothing arrived"
    n_cot = max(n for _, n in cot_slot) + 1
    out = np.zeros((len(table), S, len(COLUMNS)), np.int32)
    for name, scratch in (("in_slot", n_act), ("recv_act", n_act), ("cot_slot", n_cot), ("recv_cot", n_cot)):
        out[..., COL[name]] = scratch - 1
    for (kind, m, v), t in when.items():
        d, first, final = v % S, v == 0, v == last
        code = CODES[kind][0 if first else 2 if final else 1]
        out[t, d, [COL["code"], COL["chunk"], COL["microbatch"]]] = code, v // S, m
        if not first:
            out[t, d, COL["in_slot"]] = act_slot[d][0][(m, v)]
            if kind == "F":
                out[when[("F", m, v - 1)] + 1, d, COL["recv_act"]] = act_slot[d][0][(m, v)]
        if kind != "F" and not final:
            out[t, d, COL["cot_slot"]] = cot_slot[d][0][(m, v)]
            if kind == "B":
                out[when[("B", m, v + 1)] + 1, d, COL["recv_cot"]] = cot_slot[d][0][(m, v)]
    return TickPlan(out, n_act, n_cot)


def pipeline_value_and_grad(stage_forward, rest, blocks, consts, inputs, targets, *, mesh, schedule: str,
                            S: int, M: int, V: int, width: int, dtype):
    """(mean loss, grads of `rest`, grads of `blocks`) of a model pipelined over `pp`: S stages, M
    microbatches, V chunks per stage.

    stage_forward(rest, chunk_blocks, chunk_consts, x, tokens, targets, first, last) -> (h, loss):
      one virtual stage's forward; x is the incoming activation [rows, seq, width] (unused when first),
      loss is only read when last. blocks (trained) and consts (not) carry a leading layers axis;
      inputs/targets are [rows, seq] token ids in the order the model reads them.
    """
    plan = tick_plan(schedule, S, M, V)
    inputs, targets = split_microbatches(inputs, M), split_microbatches(targets, M)
    L = jax.tree.leaves(blocks)[0].shape[0]
    staged = lambda w: jnp.asarray(w).reshape(V, S, L // (S * V), *w.shape[1:])  # noqa: E731  [chunk, stage, layer]
    blocks, consts = jax.tree.map(staged, blocks), jax.tree.map(staged, consts)
    act_shape = inputs.shape[1:] + (width,)

    def body(rest, blocks, consts, inputs, targets, tables):
        blocks, consts = (jax.tree.map(lambda w: w[:, 0], t) for t in (blocks, consts))  # this device's chunks
        device = jax.lax.axis_index(AXIS)
        at = lambda tree, c: jax.tree.map(lambda w: w[c], tree)  # noqa: E731

        def forward(rest, chunk, c, x, m, first: bool, last: bool):
            return stage_forward(rest, chunk, at(consts, c), x, inputs[m], targets[m], first, last)

        def f_branch(first, last):
            def run(acts, cots, grads, op):
                c, m = op["chunk"], op["microbatch"]
                h, loss = forward(rest, at(blocks, c), c, acts[op["in_slot"]], m, first, last)
                g_rest, g_blocks, loss_sum = grads
                return h.astype(dtype), jnp.zeros(act_shape, dtype), (g_rest, g_blocks, loss_sum + loss)
            return run

        def backward(acts, cots, op, first, last, inputs: bool, weights: bool):
            """vjp of the stage, recomputed from its kept input, with respect to what is asked."""
            c, m = op["chunk"], op["microbatch"]
            (h, _), vjp = jax.vjp(lambda r, b, x: forward(r, b, c, x, m, first, last),
                                  rest, at(blocks, c), acts[op["in_slot"]])
            ct_h = jnp.zeros(h.shape, h.dtype) if last else cots[op["cot_slot"]]
            d_rest, d_block, d_x = vjp((ct_h, jnp.asarray(1.0 / M if last else 0.0, jnp.float32)))
            return (d_rest, d_block) if weights else None, d_x if inputs else None

        def add_weights(grads, op, first, last, d_rest, d_block):
            g_rest, g_blocks, loss_sum = grads
            g_blocks = jax.tree.map(lambda a, g: a.at[op["chunk"]].add(g), g_blocks, d_block)
            if first or last:
                g_rest = jax.tree.map(jnp.add, g_rest, d_rest)
            return g_rest, g_blocks, loss_sum

        def b_branch(first, last, split: bool):
            """The whole backward (1F1B, interleaved), or ZB-H1's B: the input gradient only (none on the
            first stage, whose input is the tokens)."""
            def run(acts, cots, grads, op):
                if split and first:
                    return idle(acts, cots, grads, op)
                w, d_x = backward(acts, cots, op, first, last, inputs=True, weights=not split)
                if w is not None:
                    grads = add_weights(grads, op, first, last, *w)
                return jnp.zeros(act_shape, dtype), d_x.astype(dtype), grads
            return run

        def w_branch(first, last):
            def run(acts, cots, grads, op):
                w, _ = backward(acts, cots, op, first, last, inputs=False, weights=True)
                return jnp.zeros(act_shape, dtype), jnp.zeros(act_shape, dtype), add_weights(grads, op, first, last, *w)
            return run

        def idle(acts, cots, grads, op):
            return jnp.zeros(act_shape, dtype), jnp.zeros(act_shape, dtype), grads

        split = schedule == "zb_h1"
        branches = [idle, f_branch(False, False), f_branch(True, False), f_branch(False, True),
                    b_branch(False, False, split), b_branch(True, False, split), b_branch(False, True, split),
                    w_branch(False, False), w_branch(True, False), w_branch(False, True)]

        def tick(carry, rows):
            acts, cots, grads, got_act, got_cot = carry
            op = {name: rows[device, i] for name, i in COL.items()}
            acts = acts.at[op["recv_act"]].set(got_act)  # what the neighbours sent last tick
            cots = cots.at[op["recv_cot"]].set(got_cot)
            send_act, send_cot, grads = jax.lax.switch(op["code"], branches, acts, cots, grads, op)
            got_act = jax.lax.ppermute(send_act, AXIS, [(i, (i + 1) % S) for i in range(S)])
            got_cot = jax.lax.ppermute(send_cot, AXIS, [(i, (i - 1) % S) for i in range(S)])
            return (acts, cots, grads, got_act, got_cot), None

        zeros = jnp.zeros(act_shape, dtype)
        grads = (jax.tree.map(jnp.zeros_like, rest), jax.tree.map(jnp.zeros_like, blocks), jnp.zeros((), jnp.float32))
        carry = (jnp.zeros((plan.act_slots,) + act_shape, dtype), jnp.zeros((plan.cot_slots,) + act_shape, dtype),
                 grads, zeros, zeros)
        (_, _, (g_rest, g_blocks, loss_sum), _, _), _ = jax.lax.scan(tick, carry, tables)
        g_rest, loss_sum = jax.lax.psum((g_rest, loss_sum), AXIS)
        return loss_sum / M, g_rest, jax.tree.map(lambda g: g[:, None], g_blocks)

    loss, g_rest, g_blocks = jax.shard_map(
        body, mesh=mesh, axis_names={AXIS}, check_vma=False,
        in_specs=(P(), P(None, AXIS), P(None, AXIS), P(), P(), P()), out_specs=(P(), P(), P(None, AXIS)),
    )(rest, blocks, consts, inputs, targets, jnp.asarray(plan.tables))
    return loss, g_rest, jax.tree.map(lambda g: g.reshape(L, *g.shape[3:]), g_blocks)
