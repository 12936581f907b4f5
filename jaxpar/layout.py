"""Layout: the shardings of the train state and the batch for one (config, mesh). Shardings only.

Parameters follow their logical axes through the rules table (jaxpar/sharding.py). All ZeRO
stages are here, on plain data parallelism (`dp`):
  0  parameters, gradients and optimizer state replicated over dp
  1  optimizer moments sharded over dp as well (each follows its parameter, plus dp)
  2  1, and gradients reduce-scattered to the moments' layout instead of all-reduced
  3  parameters sharded over dp too: the rules put dp beside fsdp on the weights' "embed"
GSPMD inserts every collective from these shardings; nothing is hand-written.

parallel.offload keeps the optimizer state (and with params+optimizer the parameters) in host memory
between steps: their `state_shardings` carry a host memory kind (pinned_host where the devices have it),
`device_shardings` the same layout in device memory; the step moves them in and out (to_device, to_rest).
"""

from __future__ import annotations

import math

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar import loss_scale
from jaxpar.checks import check_layout
from jaxpar.context import tracing_mesh
from jaxpar.core.config.schema import Config
from jaxpar.core.errors import UserError
from jaxpar.core.data.batch_shapes import for_each_shape
from jaxpar.models.decoder import abstract_model
from jaxpar.optim import make_optimizer
from jaxpar.parallel import diloco, powersgd
from jaxpar.sharding import RULES, spec_for, with_extra_axis


def rules_for(cfg: Config) -> dict[str, tuple[str, ...]]:
    """The rules table for a config.

    ZeRO-3 shards the weights over dp wherever fsdp shards them (docs/features.md: the same as putting those devices
    on fsdp; "embed" alone left a sketched factor's input dim on fsdp only).
    """
    if cfg.parallel.zero_stage != 3:
        return dict(RULES)
    return {name: axes + ("dp",) if "fsdp" in axes and "dp" not in axes else axes for name, axes in RULES.items()}


def path_keys(path) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", None))) for k in path)


def _is_spec(x) -> bool:
    return isinstance(x, P)


def host_memory_kind(mesh) -> str:
    """The host memory the mesh's devices can keep arrays in: pinned_host where they have it."""
    device = mesh.devices.flat[0]
    kinds = {m.kind for m in device.addressable_memories()}
    for kind in ("pinned_host", "unpinned_host"):
        if kind in kinds:
            return kind
    raise UserError(
        f"parallel.offload: {device.platform} devices have no host memory to offload to "
        f"(memory kinds: {', '.join(sorted(kinds))}); use parallel.offload=none"
    )


class Layout:
    """The shardings of one (config, mesh); with DiLoCo's groups (a `diloco` axis), `group` is one group's Layout.

    `for_group`: this Layout is a group's view of the mesh (the rules without `diloco`: jaxpar/parallel/diloco.py),
    which the inner step's shard_map traces the plain step in.
    """

    def __init__(self, cfg: Config, mesh, for_group: bool = False):
        for_each_shape(cfg, lambda at: check_layout(at, mesh.shape))
        self.cfg, self.mesh, self.rules = cfg, mesh, rules_for(cfg)
        if for_group:
            self.rules = diloco.group_rules(self.rules)
        _, self.axes, abstract_params = abstract_model(cfg.model)
        self.abstract_params = abstract_params
        self.param_specs = jax.tree_util.tree_map_with_path(
            lambda p, x: spec_for(self.axes[path_keys(p)], x.shape, mesh, self.rules), abstract_params
        )
        self._param_at = {path_keys(p): x for p, x in jax.tree_util.tree_flatten_with_path(abstract_params)[0]}
        abstract_opt = jax.eval_shape(make_optimizer(cfg).init, abstract_params)
        opt_specs = jax.tree_util.tree_map_with_path(self._opt_spec, abstract_opt)
        self.state_shardings = {
            "params": self.shardings(self.param_specs),
            "opt_state": self.shardings(opt_specs),
            "step": NamedSharding(mesh, P()),
        }
        if loss_scale.enabled(cfg):  # the loss scaler's scalars
            self.state_shardings["loss_scale"] = {
                k: NamedSharding(mesh, P()) for k in ("scale", "good_steps", "skipped")
            }
        if powersgd.enabled(self):  # its error buffers and factors (jaxpar/parallel/powersgd.py)
            self.state_shardings["powersgd"] = powersgd.shardings(self)
        self.device_shardings = dict(self.state_shardings)  # where the step computes on them
        self.offloaded = {"none": (), "optimizer": ("opt_state",), "params+optimizer": ("params", "opt_state")}[
            cfg.parallel.offload
        ]
        if self.offloaded:
            kind = host_memory_kind(mesh)
            for key in self.offloaded:
                self.state_shardings[key] = jax.tree.map(lambda s: s.with_memory_kind(kind), self.state_shardings[key])
        # ZeRO-2: gradients reduce-scattered to the optimizer-state layout instead of all-reduced.
        self.grad_specs = (
            jax.tree_util.tree_map_with_path(self._opt_spec, abstract_params)
            if cfg.parallel.zero_stage >= 2
            else self.param_specs
        )
        t = cfg.train
        self.batch_shape = (t.global_batch_size, cfg.data.seq_len + 1)
        self.batch_sharding = NamedSharding(
            mesh, spec_for(("batch", None), (t.global_batch_size // t.microbatches, 1), mesh, self.rules)
        )
        self.group, self.fragments = None, []  # DiLoCo's: a group's Layout; each fragment's rows (diloco.fragments)
        if diloco.groups(mesh) > 1 and not for_group:  # every group's inner state and parameters; the outer state
            self.group, self.fragments = Layout(cfg, mesh, for_group=True), diloco.fragments(self)
            self.state_shardings["opt_state"] = jax.tree.map(diloco.stacked, self.state_shardings["opt_state"])
            outer = {  # each fragment's outer optimizer state (parallel/diloco.py)
                str(f): jax.eval_shape(
                    lambda p, rows=rows: diloco.outer_optimizer(cfg).init(diloco.piece(p, rows)), abstract_params
                )
                for f, rows in enumerate(self.fragments)
            }
            self.state_shardings["diloco"] = {
                "params": jax.tree.map(diloco.stacked, self.state_shardings["params"]),
                "outer": self.shardings(jax.tree_util.tree_map_with_path(self._opt_spec, outer)),
            }
            if cfg.parallel.diloco_delay:  # streaming's exchanges in flight (parallel/diloco.py)
                started = NamedSharding(mesh, P())
                self.state_shardings["diloco"]["exchange"] = {
                    "started": started,
                    "local": self.state_shardings["diloco"]["params"],  # each group's delta
                    "mean": self.state_shardings["params"],
                }
            self.device_shardings = dict(self.state_shardings)

    def shardings(self, specs):
        """NamedShardings of a tree of specs, on the mesh (the abstract one while tracing inside a shard_map)."""
        mesh = tracing_mesh(self.mesh)
        return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)

    def to_device(self, state: dict) -> dict:
        """The offloaded parts of the state (parallel.offload) moved into device memory, inside the jitted step."""
        return {k: jax.device_put(v, self.device_shardings[k]) if k in self.offloaded else v for k, v in state.items()}

    def to_rest(self, state: dict) -> dict:
        """...and back to host memory, where they stay between steps."""
        return {k: jax.device_put(v, self.state_shardings[k]) if k in self.offloaded else v for k, v in state.items()}

    def _opt_spec(self, path, leaf) -> P:
        """Optimizer moments follow their parameter (matched by path suffix); ZeRO>=1 adds dp.

        adamw8bit's scales (one per block of a parameter's codes: a vector) are dealt over the devices its codes
        are on.
        """
        keys = path_keys(path)
        for start in range(len(keys)):
            axes = self.axes.get(keys[start:])
            if axes is not None and len(axes) == len(leaf.shape):
                spec = spec_for(axes, leaf.shape, self.mesh, self.rules)
                if self.cfg.parallel.zero_stage >= 1:
                    spec = with_extra_axis(spec, leaf.shape, self.mesh, "dp")
                return spec
            if axes is not None and leaf.ndim == 1 and len(axes) > 1:
                return self._flat_spec(self._opt_spec(path, self._param_at[keys[start:]]), leaf.shape[0])
        return P()  # counters and other scalars: replicated

    def _flat_spec(self, spec: P, n: int) -> P:
        """A vector of n over the mesh axes of `spec` (those that divide it)."""
        axes = [a for e in spec if e for a in (e if isinstance(e, tuple) else (e,))]
        while axes and n % math.prod(self.mesh.shape[a] for a in axes):
            axes.pop()
        return P(tuple(axes) if axes else None)
