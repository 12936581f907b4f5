"""torchft's mode of DiLoCo: each group its own launch (parallel.torchft_lighthouse), and what the mode runs with.

torchpar runs it (torchpar/torchft_groups.py); jaxpar.tools.launch writes its SLURM job. Here, without torch: which
group a launch is, the mesh its own ranks form, and the settings the mode refuses (docs/diloco.md "torchft").
"""

from __future__ import annotations

import dataclasses

from jaxpar.core.config.mesh_spec import format_mesh, parse_mesh
from jaxpar.core.errors import UserError
from jaxpar.core.optimizer.outer import AXIS


def _sizes(cfg) -> dict[str, int]:
    return parse_mesh(cfg.parallel.mesh) if cfg.parallel.mesh else {}


def launch_groups(cfg):
    """(the config of this launch, (its group, the group count)), or (cfg, None) without torchft.

    This launch's parallel.mesh is the mesh without `diloco`: its ranks are one group's.
    """
    p = cfg.parallel
    if not p.torchft_lighthouse:
        return cfg, None
    sizes = _sizes(cfg)
    groups = sizes.pop(AXIS, 1)
    inside = format_mesh({a: n for a, n in sizes.items() if n != 1}) if sizes else ""
    return dataclasses.replace(cfg, parallel=dataclasses.replace(p, mesh=inside)), (p.torchft_group, groups)


def check_torchft(cfg, backend: str) -> int:
    """The number of groups, or one line on what torchft's mode does not run with."""
    p = cfg.parallel
    groups = _sizes(cfg).get(AXIS, 1)
    if groups < 2:
        raise UserError(
            f"parallel.torchft_lighthouse={p.torchft_lighthouse} needs diloco=G (G >= 2, not -1) in parallel.mesh: "
            "the number of groups, each its own launch"
        )
    if p.torchft_group >= groups:
        raise UserError(f"parallel.torchft_group={p.torchft_group} is not one of the {groups} groups (0-{groups - 1})")
    refused = {
        f"--backend {backend} (torchft's groups run on ddp)": backend != "ddp",
        f"parallel.diloco_fragments={p.diloco_fragments} (torchft streams its fragments in its own order)": (
            p.diloco_fragments > 1
        ),
        f"parallel.diloco_delay={p.diloco_delay}": p.diloco_delay > 0,
        "model.moe_bias_update (torchft's outer step would move the balance bias)": cfg.model.moe_bias_update > 0,
        f"checkpoint.every={cfg.checkpoint.every}: set checkpoint.every=0 (a group that comes back heals from a live "
        "one; the run's end is saved)": cfg.checkpoint.every > 0,
    }
    for what, no in refused.items():
        if no:
            raise UserError(f"parallel.torchft_lighthouse does not run with {what} yet (docs/diloco.md)")
    return groups
