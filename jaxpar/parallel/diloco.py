"""DiLoCo in jaxpar: groups of devices that train alone and meet every H steps.

The mesh's `diloco` axis (outermost) splits the devices into groups. Each group holds its own parameters and inner
optimizer state, a leading dimension of the group count sharded over `diloco`; inside a group dp, fsdp, tp, pp, ep
and sp work as they do without groups. The global batch at each step is split over the groups as dp splits it
(the rules table puts `diloco` first on "batch").

- inner step (every step): the layout's own train step in a shard_map manual over `diloco` alone, so nothing in it
  crosses groups; the step's metrics come back one per group and are averaged on the host.
- outer step (after every parallel.diloco_inner_steps-th step): the groups' parameter deltas from the synchronised
  parameters (the pseudo-gradients) are averaged by one all-reduce over `diloco`, and the outer optimizer
  (optim.outer_*: SGD at a constant lr with Nesterov momentum) applies the mean to the synchronised parameters, which
  every group then takes as its own. The inner optimizer states carry on.

Streaming DiLoCo (parallel.diloco_fragments=F): the parameters are F fragments, fragment f the f-th of F equal runs of
layers of every layer stack (the embeddings and the final norm in fragment 0), and each fragment meets on its own
schedule, fragment f after every H-th step counted from step f x H / F: each meeting sends 1/F of the parameters.
After the run's last step every fragment meets, so the trained parameters hold every step (the schedule is shared
with torchpar: jaxpar/core/optimizer/outer.py).

With parallel.diloco_delay=D a meeting's exchange runs behind D inner steps: its start sets each group's delta aside,
the next inner step's program carries the all-reduce beside its own work (group_step's `carry`), and D steps after
the start the mean is applied (the schedule: jaxpar/core/optimizer/outer.py).

The train state keeps the synchronised parameters as "params" (evaluation, sampling, export and conversion read
those), every group's inner optimizer state as "opt_state" [groups, ...], and under "diloco" every group's parameters
[groups, ...], the outer optimizer's state of each fragment and, with a delay, "exchange": each fragment's start
step (-1: none in flight), each group's delta set aside and their mean. The experts' balance bias is moved by each
group's own choices and, at a meeting, becomes the groups' mean (it has no gradient for the outer optimizer to follow).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.core.config.schema import Config
from jaxpar.core.errors import UserError
from jaxpar.core.optimizer.outer import AXIS, actions, layer_runs
from jaxpar.core.weights.names import flatten, unflatten

BALANCE_BIAS = ("blocks", "moe", "router", "bias")  # the experts' balance bias (models/moe.py update_router_bias)


def groups(mesh) -> int:
    """The number of DiLoCo groups in `mesh` (1: no DiLoCo)."""
    return dict(mesh.shape).get(AXIS, 1)


def group_rules(rules: dict) -> dict:
    """The rules table as one group sees it: without the `diloco` axis."""
    return {name: tuple(a for a in axes if a != AXIS) for name, axes in rules.items()}


def outer_optimizer(cfg: Config) -> optax.GradientTransformation:
    """optim.outer_*: SGD at a constant lr on the mean pseudo-gradient, with (Nesterov) momentum."""
    o = cfg.optim
    return optax.sgd(o.outer_lr, momentum=o.outer_momentum or None, nesterov=o.outer_nesterov)


def stacked(sharding: NamedSharding) -> NamedSharding:
    """A group's sharding with a leading group dimension over `diloco`."""
    return NamedSharding(sharding.mesh, P(AXIS, *sharding.spec))


def for_each_group(tree, n: int):
    """Every leaf of `tree` repeated along a new leading dimension of `n` groups."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *jnp.shape(x))), tree)


def fragments(layout) -> list[dict]:
    """For each fragment: flat parameter name -> the rows (lo, hi) of its leading layers axis it holds, or None (whole).

    Fragment f holds the f-th of F equal runs of every layer stack's layers; the other parameters are fragment 0's.
    """
    F = layout.cfg.parallel.diloco_fragments
    out = [{} for _ in range(F)]
    for name, leaf in flatten(layout.abstract_params).items():
        if layout.axes[tuple(name.split("."))][0] != "layers":
            out[0][name] = None
            continue
        for f, run in enumerate(layer_runs(leaf.shape[0], F, name.split(".")[0])):
            out[f][name] = (run.start, run.stop)
    return out


def piece(tree, rows: dict, stacked: bool = False) -> dict:
    """The parameters of one fragment (`rows`: fragments()'s) of a params-shaped tree; `stacked`: [groups, ...]."""
    flat, lead = flatten(tree), (slice(None),) * stacked
    return unflatten({n: flat[n] if r is None else flat[n][(*lead, slice(*r))] for n, r in rows.items()})


def put(tree, rows: dict, fragment: dict, stacked: bool = False) -> dict:
    """`tree` with one fragment's parameters replaced by `fragment`'s."""
    flat, new, lead = flatten(tree), flatten(fragment), (slice(None),) * stacked
    for n, r in rows.items():
        flat[n] = new[n] if r is None else flat[n].at[(*lead, slice(*r))].set(new[n])
    return unflatten(flat)


def initial(layout, params, opt_state) -> tuple:
    """The inner optimizer state for every group, and the DiLoCo part of a fresh state: (opt_state, state["diloco"])."""
    n, tx = groups(layout.mesh), outer_optimizer(layout.cfg)
    outer = {str(f): tx.init(piece(params, rows)) for f, rows in enumerate(layout.fragments)}
    state = {"params": for_each_group(params, n), "outer": outer}
    if layout.cfg.parallel.diloco_delay:  # streaming's exchanges in flight: each fragment's start step, the means
        state["exchange"] = {
            "started": jnp.full((len(layout.fragments),), -1, jnp.int32),
            "local": for_each_group(jax.tree.map(jnp.zeros_like, params), n),  # each group's delta, set aside
            "mean": jax.tree.map(jnp.zeros_like, params),  # the groups' mean of it
        }
    return for_each_group(opt_state, n), state


def group_step(layout, step, carry: int | None = None):
    """The inner step: `step` (one group's (state, batch) -> (state, metrics)) on every group at once.

    A shard_map manual over `diloco` only: each group sees its parameters, inner optimizer state and rows, and the
    other axes stay GSPMD's inside it. The step counter is shared; metrics come back [groups, ...]. `carry`: the
    fragment whose exchange (parallel.diloco_delay) this step carries: its groups' deltas, set aside by the exchange's
    start, averaged by one all-reduce in the same program, which the compiler may run beside the step's own work.
    """
    mesh = layout.mesh
    one, ours = lambda t: jax.tree.map(lambda x: x[0], t), lambda t: jax.tree.map(lambda x: x[None], t)
    rows = None if carry is None else layout.fragments[carry]

    def local(params, opt_state, count, batch, *sending):
        new, metrics = step({"params": one(params), "opt_state": one(opt_state), "step": count}, batch)
        means = [jax.tree.map(lambda d: jax.lax.pmean(d[0], AXIS), s) for s in sending]
        return ours(new["params"]), ours(new["opt_state"]), ours(metrics), *means

    run = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(AXIS), P(AXIS), P(), P(AXIS)) + (P(AXIS),) * (carry is not None),
        out_specs=(P(AXIS),) * 3 + (P(),) * (carry is not None),
        axis_names={AXIS},
        check_vma=False,
    )

    def inner(state, batch):
        held = state["diloco"].get("exchange")
        sending = () if carry is None else (piece(held["local"], rows, stacked=True),)
        params, opt_state, metrics, *mean = run(
            state["diloco"]["params"], state["opt_state"], state["step"], batch, *sending
        )
        diloco = {**state["diloco"], "params": params}
        if mean:
            diloco["exchange"] = {**held, "mean": put(held["mean"], rows, mean[0])}
        return {**state, "opt_state": opt_state, "step": state["step"] + 1, "diloco": diloco}, metrics

    return inner


def make_outer_step(layout, fragment: int = 0, part: str = "meet"):
    """The jitted meeting of a fragment: (state, step) -> state, the groups' mean delta applied, given to every group.

    Only the fragment's parameters are all-reduced; the other fragments' stay as each group has them. `part` "start"
    and "land" bracket an exchange under parallel.diloco_delay: "start" sets each group's delta aside in
    state["diloco"]["exchange"] with its step (nothing sent), the next inner step averages it (group_step's carry), and
    "land" applies the mean.
    """
    cfg, mesh, n = layout.cfg, layout.mesh, groups(layout.mesh)
    tx, rows = outer_optimizer(cfg), layout.fragments[fragment]

    def mean_delta(synced, group):  # [1, ...] per group -> the mean over the groups, one all-reduce
        return jax.tree.map(lambda s, g: jax.lax.pmean(s - g[0], AXIS), synced, group)

    average = jax.shard_map(
        mean_delta, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P(), axis_names={AXIS}, check_vma=False
    )

    def delta_of(state):
        return average(piece(state["params"], rows), piece(state["diloco"]["params"], rows, stacked=True))

    def apply(state, delta):
        synced = piece(state["params"], rows)
        updates, outer_state = tx.update(delta, state["diloco"]["outer"][str(fragment)], synced)
        new = optax.apply_updates(synced, updates)
        if ".".join(BALANCE_BIAS) in rows:  # the balance bias: the groups' mean
            new = _set(new, BALANCE_BIAS, _get(synced, BALANCE_BIAS) - _get(delta, BALANCE_BIAS))
        new = jax.tree.map(lambda x, like: x.astype(like.dtype), new, synced)
        group = put(state["diloco"]["params"], rows, for_each_group(new, n), stacked=True)
        outers = {**state["diloco"]["outer"], str(fragment): outer_state}
        return {
            **state,
            "params": put(state["params"], rows, new),
            "diloco": {**state["diloco"], "params": group, "outer": outers},
        }

    def own_delta(synced, group):  # [1, ...] per group -> its delta, [1, ...]: nothing sent
        return jax.tree.map(lambda s, g: (s - g[0])[None], synced, group)

    own = jax.shard_map(
        own_delta, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P(AXIS), axis_names={AXIS}, check_vma=False
    )

    def exchange(state, **changed):
        return {**state, "diloco": {**state["diloco"], "exchange": {**state["diloco"]["exchange"], **changed}}}

    def start(state, step):  # each group's delta set aside; the next inner step averages it (group_step's carry)
        held = state["diloco"]["exchange"]
        deltas = own(piece(state["params"], rows), piece(state["diloco"]["params"], rows, stacked=True))
        return exchange(
            state, started=held["started"].at[fragment].set(step), local=put(held["local"], rows, deltas, stacked=True)
        )

    def land(state, step):
        held = state["diloco"]["exchange"]
        state = apply(state, piece(held["mean"], rows))
        return exchange(state, started=held["started"].at[fragment].set(-1))

    run = {"meet": lambda state, step: apply(state, delta_of(state)), "start": start, "land": land}[part]
    return jax.jit(
        run, in_shardings=(layout.state_shardings, None), out_shardings=layout.state_shardings, donate_argnums=0
    )


class Meetings:
    """(state, 0-based step) -> the state after what follows that step: exchanges landing, meetings, exchanges starting.

    The schedule is jaxpar/core/optimizer/outer.py's; each fragment's part is its own jitted program (make_outer_step),
    compiled at its first use. Which exchanges are in flight is read from the state once, then followed on the host.
    """

    def __init__(self, layout):
        self.layout, self.cfg, self.programs, self.started = layout, layout.cfg, {}, None

    def program(self, fragment: int, part: str):
        if (fragment, part) not in self.programs:
            self.programs[fragment, part] = make_outer_step(self.layout, fragment, part)
        return self.programs[fragment, part]

    def read(self, state) -> None:
        """The exchanges in flight, as the state holds them (a fresh or a restored run's), once."""
        if self.started is None:
            held = state["diloco"].get("exchange")
            none = [-1] * len(self.layout.fragments)  # no delay: nothing is ever in flight
            self.started = none if held is None else [int(t) for t in jax.device_get(held["started"])]

    def carry(self, state, step: int) -> int | None:
        """The fragment whose exchange the inner step `step` carries (started after the step before), or None."""
        self.read(state)
        return next((f for f, t in enumerate(self.started) if t >= 0 and t == step - 1), None)

    def __call__(self, state, step: int):
        self.read(state)
        for f, part in actions(self.cfg, self.started, step):
            state = self.program(f, part)(state, step)
            self.started[f] = {"land": -1, "start": step}.get(part, self.started[f])
        return state


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _set(tree, path, value):
    if not path:
        return value
    return {**tree, path[0]: _set(tree[path[0]], path[1:], value)}


def check_saved_groups(saved: dict | None, n: int) -> None:
    """A checkpoint's state (its tree of metadata; None: no checkpoint) resumes on a mesh of `n` groups, or one line.

    A group's parameters and inner optimizer state are its own: another number of groups, or groups where the run had
    none (or none where it had them), is refused.
    """
    if saved is None:
        return
    had = _groups_of(saved) if "diloco" in saved else 1
    if had != n:
        raise UserError(
            f"the checkpoint holds {_phrase(had)} and the mesh has {_phrase(n)}: resume on the mesh's diloco={had} "
            "(each group's parameters and optimizer state are its own), or start a new run.dir"
        )


def params_fit(layout, abstract: dict, otherwise):
    """A checkpoint fit (Checkpointer.restore_latest) for readers of the parameters alone.

    A DiLoCo run's checkpoint, on a layout without its groups, is read as saved (each group's state whole on every
    device) and kept to its synchronised parameters and step; any other goes to `otherwise`.
    """
    whole = NamedSharding(layout.mesh, P())
    as_saved = lambda tree: jax.tree.map(
        lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=whole),
        tree,
        is_leaf=lambda m: hasattr(m, "shape"),
    )

    def fit(saved: dict):
        if "diloco" not in saved or "diloco" in abstract:
            return otherwise(saved)
        target = {**abstract, "opt_state": as_saved(saved["opt_state"]), "diloco": as_saved(saved["diloco"])}
        return target, lambda state: {"params": state["params"], "step": state["step"]}

    return fit


def _groups_of(saved: dict) -> int:
    return int(jax.tree.leaves(saved["diloco"]["params"])[0].shape[0])


def _phrase(n: int) -> str:
    return f"DiLoCo's state for {n} groups" if n > 1 else "no DiLoCo groups"


def mean_over_groups(metrics: dict) -> dict:
    """The inner step's per-group metrics as one run's: the mean over the groups (equal rows each)."""
    return {k: v.mean(axis=0) for k, v in metrics.items()}
