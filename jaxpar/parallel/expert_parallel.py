"""Expert parallelism on the `ep` mesh axis: a mixture of experts' tokens travel to their experts and back.

The rules table puts the experts' axis on ep ("experts" -> ep) and the batch on ep as well ("batch" -> dp,
fsdp, ep), so outside the experts an ep rank is one more data rank. Inside a shard_map (manual over every
axis) each device sorts its own tokens' choices into a buffer [experts, slots, embed]
(jaxpar/parallel/expert_dispatch.py), an all-to-all over ep hands each rank the slots of the experts it holds (from
every ep rank), the experts run as one batched matmul, and a second all-to-all brings the outputs home. An expert's
width may be split over tp (rules: "mlp" -> tp): the partial outputs are summed over tp, as in a tensor-parallel MLP.
The expert weights enter whole along embed: a weight sharded over fsdp is gathered on the way in, its gradient
reduce-scattered on the way out (GSPMD, from the shard_map's input layout).

The all-to-all moves slots = every token of the device (dropless) or a row's capacity per row, zero-padded:
XLA:CPU has no ragged all-to-all. Which exchange ran is said once at trace time.
"""

from __future__ import annotations

import functools
import sys

import jax

from jaxpar.context import tracing_mesh
from jaxpar.parallel.expert_dispatch import local_experts, ragged_experts
from jaxpar.sharding import spec_for

AXIS = "ep"
_said: set = set()


def _to_owners(buffer, n: int):
    """[E, S, D] -> [E/n, n x S, D] on each ep rank: its experts' slots from every rank (an all-to-all over ep)."""
    E, S, D = buffer.shape
    got = jax.lax.all_to_all(buffer, AXIS, 0, 0, tiled=True)  # [n sources x E/n, S, D]
    return got.reshape(n, E // n, S, D).swapaxes(0, 1).reshape(E // n, n * S, D)


def _to_sources(out, n: int):
    """The inverse of _to_owners: each rank gets back its own slots' outputs, [E, S, D]."""
    El, nS, D = out.shape
    back = out.reshape(El, n, nS // n, D).swapaxes(0, 1).reshape(n * El, nS // n, D)
    return jax.lax.all_to_all(back, AXIS, 0, 0, tiled=True)


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def expert_parallel(mesh, rules, ragged: bool = False):
    """experts(x, ids, weights, kept, w, capacity, activation) for the parallel context of `mesh` (local_experts').

    `ragged` (model.moe_ragged, ep=1: jaxpar/checks.py): each device's rows through ragged_experts instead.
    """
    n = mesh.shape[AXIS]
    if n > 1 and "padded" not in _said:
        _said.add("padded")
        print(
            f"experts: tokens travel over ep={n} by a padded all-to-all (fixed slots per expert)",
            file=sys.stderr,
            flush=True,
        )

    def experts(x, ids, weights, kept, w: dict, capacity: int, activation: tuple = ("swiglu", 0.0, 0.0)):
        act = spec_for(("batch", "seq", "act_embed"), x.shape, mesh, rules)
        choice = jax.P(act[0], act[1], None)
        w_in = spec_for(("experts", None, "mlp"), w["gate"].shape, mesh, rules)  # embed gathered (fsdp)
        w_out = spec_for(("experts", "mlp", None), w["down"].shape, mesh, rules)
        split = _axes(w_out[1])  # the axes an expert's width is split over: their partial outputs are summed
        # the biases (model.moe_expert_bias) split as their weights' experts and width; down's output whole
        specs = {"gate": w_in, "up": w_in, "down": w_out, "gate_bias": jax.P(w_in[0], w_in[2])}
        specs.update(up_bias=specs["gate_bias"], down_bias=jax.P(w_out[0], None))

        owners = n if AXIS in _axes(w_in[0]) else 1
        moves = (
            {}
            if owners == 1
            else {"exchange": lambda buf: _to_owners(buf, owners), "back": lambda out: _to_sources(out, owners)}
        )
        reduce = (lambda y: jax.lax.psum(y, split)) if split else (lambda y: y)
        if ragged:  # the rows each expert received alone (no exchange: ep=1)
            local = functools.partial(ragged_experts, capacity=capacity, activation=activation, reduce=reduce)
        else:
            local = functools.partial(
                local_experts, capacity=capacity, activation=activation, owners=owners, **moves, reduce=reduce
            )
        return jax.shard_map(
            local,
            mesh=tracing_mesh(mesh),
            in_specs=(act, choice, choice, choice, {n: specs[n] for n in w}),
            out_specs=act,
            check_vma=False,
        )(x, ids, weights, kept, w)

    return experts
