"""DiLoCo in torchpar: groups of ranks that train alone and meet every H steps (docs/diloco.md).

parallel.mesh=diloco=G,... on --backend ddp or fsdp is one launch of G x S ranks; rank r is in group r // S (the mesh's
`diloco` axis outermost, as in jaxpar), so group g reads the g-th of G blocks of every global batch, as dp would split
it. Inside a group DDP or FSDP2 runs on the group's own DeviceMesh and nothing crosses groups. After the steps
jaxpar/core/optimizer/outer.py's `actions` name, each meeting fragment's delta from the synchronised parameters (the
pseudo-gradient) is averaged over the groups by one all-reduce, torch's SGD (optim.outer_*) applies it to the
synchronised parameters, and every group takes them as its own; the inner optimizer states carry on.

Each rank keeps its shard of the synchronised parameters and of each fragment's outer momentum. Evaluation, sampling
and the weights written read the synchronised parameters (`synchronised`). The experts' balance bias becomes the groups'
mean at a meeting, as in jaxpar. With parallel.diloco_delay=D a meeting's all-reduce is started with async_op and runs
while the next D steps compute; its mean is applied after them.

A checkpoint holds the synchronised parameters as the model's (what readers of the parameters load), each group's
parameters and inner optimizer state under `groups.<g>`, the outer momentum and, with a delay, `exchange`: each
fragment's start step (-1: none in flight) and the mean of one in flight (waited for at the save). It resumes on the
same number of groups, with any number of ranks in each (DCP reshards).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as tdist
from torch.distributed.device_mesh import init_device_mesh

from jaxpar.core.config.mesh_spec import parse_mesh, resolve_sizes
from jaxpar.core.errors import UserError
from jaxpar.core.optimizer.outer import AXIS, actions, layer_runs
from jaxpar.core.weights.names import ALL_NAMES, shared_name, stacks_of
from torchpar.optim import local

BALANCE_BIAS = "moe.router.bias"  # the experts' balance bias: no gradient moves it, the groups' mean does


def group_count(cfg, world: int) -> int:
    """The number of DiLoCo groups parallel.mesh asks for (1: none)."""
    return resolve_sizes(parse_mesh(cfg.parallel.mesh), world).get(AXIS, 1) if cfg.parallel.mesh else 1


def group_mesh(env, shape: tuple, names: tuple):
    """The DeviceMesh of the groups (`diloco` first) and the inner axes `names` of `shape`; and a group's submesh."""
    mesh = init_device_mesh(env.device.type, shape, mesh_dim_names=(AXIS, *names))
    return mesh, mesh[names if len(names) > 1 else names[0]]


def layer_fragments(cfg) -> dict[str, int]:
    """Torch name -> fragment of every per-layer parameter: the f-th of F equal runs of each layer stack's layers.

    One line where parallel.diloco_fragments does not divide a stack.
    """
    F, m = cfg.parallel.diloco_fragments, cfg.model
    first = m.moe_first_dense if m.moe_experts else 0
    fragment_of = {}
    for shared, pattern in ALL_NAMES.items():
        if "{l}" not in pattern:
            continue
        for prefix, layers in stacks_of(shared, first, m.n_layer, m.mtp_depth):
            stack = prefix.rstrip(".") or shared.split(".")[0]
            for f, run in enumerate(layer_runs(len(layers), F, stack)):
                fragment_of.update({pattern.format(l=layers[j]): f for j in run})
    return fragment_of


def fragments(cfg, names: list[str]) -> list[list[str]]:
    """Each fragment's parameter names (layer_fragments); the parameters outside the layer stacks in fragment 0."""
    fragment_of = layer_fragments(cfg)
    out = [[] for _ in range(cfg.parallel.diloco_fragments)]
    for name in names:
        shared_name(name)  # every parameter has its shared name: a new one is placed, never skipped
        out[fragment_of.get(name, 0)].append(name)
    return out


class Groups:
    """The meetings of a DiLoCo run, on this rank: its group, the synchronised parameters, the outer optimizer."""

    def __init__(self, raw, cfg, env, mesh, groups: int):
        self.cfg, self.env, self.count, self.size = cfg, env, groups, env.world // groups  # size: ranks per group
        self.index = env.rank // self.size
        self.between = mesh[AXIS].get_group()  # this rank and its peers at the same place in the other groups
        self.within = tdist.new_subgroups(self.size)[0] if self.size > 1 else None  # this rank's group
        self.live = dict(raw.named_parameters())
        self.sharded = [m for m in raw.modules() if hasattr(m, "reshard") and hasattr(m, "unshard")]  # FSDP2's
        self.synced = {n: local(p).detach().clone() for n, p in self.live.items()}
        self.fragments = fragments(cfg, list(self.live))
        o = cfg.optim
        self.outer = []
        for names in self.fragments:
            moved = [self.synced[n] for n in names if not n.endswith(BALANCE_BIAS)]
            sgd = torch.optim.SGD(
                moved or [torch.zeros(0)],
                lr=o.outer_lr,
                momentum=o.outer_momentum,
                nesterov=o.outer_nesterov and o.outer_momentum > 0,
                foreach=False,
            )
            for t in moved:  # torch's first step takes the gradient as its buffer: 0 x momentum + g is the same, and
                sgd.state[t]["momentum_buffer"] = torch.zeros_like(t)  # saved whatever the momentum (zeros at 0)
            self.outer.append(sgd)
        # streaming's overlap (parallel.diloco_delay): each fragment's exchange in flight, the step it started (-1:
        # none) and, once waited for, its mean delta
        self.exchanges, self.started = {}, torch.full((len(self.fragments),), -1, dtype=torch.int64)
        self.pending = {n: torch.zeros_like(t) for n, t in self.synced.items()} if cfg.parallel.diloco_delay else {}

    def sum_within(self, values: list[float]) -> list[float]:
        """Sum of small host values over this rank's group (the experts' loads that move its balance bias)."""
        if self.within is None:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.env.device)
        tdist.all_reduce(t, group=self.within)
        return t.tolist()

    def after(self, step: int) -> None:
        """The meetings that follow the 0-based `step`: exchanges landing, meetings, exchanges starting (outer.py)."""
        for f, part in actions(self.cfg, self.started.tolist(), step):
            if part == "land":
                self.land(f)
            elif part == "meet":
                self.apply(f, self.mean_delta(f))
            else:
                self.start(f, step)

    @torch.no_grad()
    def mean_delta(self, fragment: int, wait: bool = True):
        """The groups' mean delta of a fragment's parameters from the synchronised ones, by one all-reduce.

        `wait=False`: the all-reduce in flight, (its flat buffer, its work) returned; the mean is the buffer over the
        group count once the work is done.
        """
        names = self.fragments[fragment]
        flat = torch.cat([(self.synced[n] - local(self.live[n])).reshape(-1) for n in names])
        work = tdist.all_reduce(flat, group=self.between, async_op=not wait)
        if not wait:
            return flat, work
        return self._split(fragment, flat / self.count)

    def _split(self, fragment: int, flat: torch.Tensor) -> dict:
        names = self.fragments[fragment]
        parts = flat.split([self.synced[n].numel() for n in names])
        return {n: part.view_as(self.synced[n]) for n, part in zip(names, parts)}

    def start(self, fragment: int, step: int) -> None:
        """A fragment's exchange started behind the next inner steps (parallel.diloco_delay)."""
        self.exchanges[fragment] = self.mean_delta(fragment, wait=False)
        self.started[fragment] = step

    @torch.no_grad()
    def settle(self, fragments=None) -> None:
        """Waits for exchanges in flight (`fragments`, or all); their means go to `pending`, which checkpoints save."""
        for fragment in list(self.exchanges) if fragments is None else [f for f in fragments if f in self.exchanges]:
            flat, work = self.exchanges.pop(fragment)
            work.wait()
            for n, mean in self._split(fragment, flat / self.count).items():
                self.pending[n].copy_(mean)

    def land(self, fragment: int) -> None:
        """An exchange in flight applied: the outer step on its mean, the fragment's local steps since replaced."""
        self.settle([fragment])
        self.apply(fragment, {n: self.pending[n] for n in self.fragments[fragment]})
        self.started[fragment] = -1

    @torch.no_grad()
    def apply(self, fragment: int, mean: dict) -> None:
        """The outer step of a fragment on the groups' mean delta; every group takes the synchronised result."""
        names = self.fragments[fragment]
        for n in names:
            if n.endswith(BALANCE_BIAS):  # the groups' mean
                self.synced[n].sub_(mean[n])
            else:
                self.synced[n].grad = mean[n]
        self.outer[fragment].step()
        for n in names:
            self.synced[n].grad = None
            local(self.live[n]).copy_(self.synced[n])

    def synchronised(self):
        """The model holds the synchronised parameters inside; each group's own again after.

        FSDP2's gathered parameters are dropped at both ends (with parallel.zero_stage 1 or 2 a forward keeps them):
        the next forward gathers what the shards hold.
        """
        return holding(self.live, self.synced, self._reshard)

    def _reshard(self) -> None:
        for module in self.sharded:
            module.reshard()

    # the checkpoint (torchpar/checkpoint.py's `views`)
    def views(self, state: dict) -> dict:
        """{"model", "optim"} of this rank as DCP saves it: the synchronised parameters as the model's."""
        synced = {n: self._as_param(n, t) for n, t in self.synced.items()}
        momentum = {
            n: self._as_param(n, sgd.state[t]["momentum_buffer"])
            for sgd, names in zip(self.outer, self.fragments)
            for n in names
            if (t := self.synced[n]) in sgd.state
        }
        out = {"model": {**state["model"], **synced}, "groups": {str(self.index): state}, "outer": momentum}
        if self.pending:  # the exchanges in flight: when each started, and its mean delta
            self.settle()
            out["exchange"] = {
                "started": self.started,
                "mean": {n: self._as_param(n, t) for n, t in self.pending.items()},
            }
        return out

    def unviews(self, state: dict) -> dict:
        return state["groups"][str(self.index)]

    def _as_param(self, name: str, t: torch.Tensor):
        """`t`, this rank's shard, as its parameter is: a DTensor over the group's mesh under FSDP2 (same storage)."""
        p = self.live[name]
        if not hasattr(p, "device_mesh"):
            return t
        from torch.distributed.tensor import DTensor  # deferred: DTensor on import keeps gloo alive at exit

        return DTensor.from_local(t, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False)

    def describe(self) -> str:
        H, F, o = self.cfg.parallel.diloco_inner_steps, self.cfg.parallel.diloco_fragments, self.cfg.optim
        streaming = f" in {F} fragments (streaming)" if F > 1 else ""
        if self.cfg.parallel.diloco_delay:
            streaming += f", each exchange behind {self.cfg.parallel.diloco_delay} inner steps"
        return (
            f"DiLoCo: {self.count} groups of {self.size} rank{'s' * (self.size > 1)}, meeting every {H} steps"
            f"{streaming}; "
            f"outer SGD lr {o.outer_lr:g}, momentum {o.outer_momentum:g}{' (Nesterov)' * o.outer_nesterov}"
        )


@contextmanager
def holding(params: dict, values: dict, reset=lambda: None):
    """Each parameter of `params` holds `values`' tensor of its name inside (this rank's shards), its own after.

    `reset` runs at both ends, before the copy in and before the copy back.
    """
    kept = {n: local(p).detach().clone() for n, p in params.items()}
    try:
        reset()
        with torch.no_grad():
            for n, p in params.items():
                local(p).copy_(values[n])
        yield
    finally:
        reset()
        with torch.no_grad():
            for n, p in params.items():
                local(p).copy_(kept[n])


def check_saved_groups(meta: dict, groups: int, path: str) -> None:
    """A checkpoint's meta resumes on `groups` groups, or one line (each group's state is its own)."""
    had = int(meta.get("diloco_groups", 1))
    if had != groups:
        phrase = lambda n: f"DiLoCo's state for {n} groups" if n > 1 else "no DiLoCo groups"
        raise UserError(
            f"checkpoint {path} holds {phrase(had)} and parallel.mesh has {phrase(groups)}: resume with diloco={had} "
            "(each group's parameters and optimizer state are its own), or start a new run.dir"
        )
