"""The optimizer's own collectives in a plan (jaxpar.tools.plan).

With optim.name=muon, the moves that deal each parameter's matrices out over the devices for Newton-Schulz and bring the
update back (jaxpar/optim.py spread_matrices), against the bound of that spreading.

Bound, per Muon parameter of P bytes (its momentum; the update has its bytes too) whose layout shards it S ways
over the N devices of the mesh (replicated over the other N/S): every device ends up with P/N of whole matrices,
of which 1/S was already in its own shard, so it receives (S-1)/S of P/N; on the way back it needs its shard P/S
of the update, all but the 1/N it computed itself: (N-1)/N of P/S. A bandwidth-optimal exchange sends what it
receives, so per device
    bytes(P) = P/N (S-1)/S + P/S (N-1)/N          (2 (N-1)/N P/N where the layout shards it over all N: fsdp=N)
summed over the Muon parameters. Nothing else moves: each device iterates on whole matrices. An all-to-all sends
equal blocks, so spread_matrices pads a parameter's B matrices to a multiple of N with zero matrices: it sends
B_pad/B of that (`padded`), which the note names where the step moves more than 1.1x the bound.

Measured: what Muon adds to the step -- its bytes less those of its AdamW twin (the same config and mesh with
optim.name=adamw, compiled beside it), whose per-axis rows the plan shows. That counts every move Muon's layout
causes, also one GSPMD places outside jaxpar/optim.py (e.g. the update taken back to the parameter's layout where
optax applies it); the collectives made for operations in jaxpar/optim.py are flagged `optimizer` (--json).
"""

from __future__ import annotations

import dataclasses
import math

import jax

from jaxpar.core.optimizer import muon

OPTIMIZER_FILE = "jaxpar/optim.py"  # a collective made for an operation there is the optimizer's


def is_optimizers(files) -> bool:
    """Whether a collective's source stack (hlo_collectives.Collective.files) passes through jaxpar/optim.py."""
    return any(f and f.replace("\\", "/").endswith(OPTIMIZER_FILE) for f in files)


def _name(path) -> str:
    return ".".join(k.key for k in path)


def muon_bounds(cfg, params, n: int) -> tuple[float, float]:
    """Bytes each device sends per step to spread Muon's matrices over n devices: (bound, padded).

    `params`: the abstract sharded parameters. `padded`: the same with each parameter's matrix count padded to a
    multiple of n.
    """
    if cfg.optim.name != "muon" or n == 1:
        return 0.0, 0.0
    bound = padded = 0.0
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        axes = muon.stacked_axes(_name(path))
        if axes is None:
            continue
        whole = math.prod(x.shape) * x.dtype.itemsize
        shards = whole // (math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize)
        b = math.prod(x.shape) // math.prod(muon.fans(x.shape, axes))
        cost = whole / n * (shards - 1) / shards + whole / shards * (n - 1) / n
        bound, padded = bound + cost, padded + cost * (b + -b % n) / b
    return bound, padded


def against_adamw(p: dict, cfg, plan_of, padded: float) -> dict:
    """A Muon plan with its optimizer row measured against its AdamW twin.

    With optim.name=muon, plan `p` with its optimizer row measured against the AdamW twin (`plan_of` plans a config on
    the same mesh), the per-axis rows the twin's, and the note; any other optimizer: `p` as it is.
    """
    if cfg.optim.name != "muon":
        return p
    twin = plan_of(dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, name="adamw")))
    measured = {**twin["measured"], "optimizer": p["traffic_bytes"] - twin["traffic_bytes"]}
    own = sum(c["traffic_bytes"] for c in p["collectives"] if c["optimizer"])
    return {
        **p,
        "measured": measured,
        "notes": p["notes"] + note(measured["optimizer"], own, p["bounds"]["optimizer"], padded, p["devices"]),
    }


def note(measured: float, own: float, bound: float, padded: float, n: int) -> list[str]:
    """Why Muon's moves pass 1.1x their bound.

    The padding, or moves made outside jaxpar/optim.py (`own`: those made there).
    """
    if not bound or measured <= 1.1 * bound:
        return []
    if measured > own + 0.05 * bound:
        why = (
            f"{measured - own:,.0f} of them are moves GSPMD placed outside jaxpar/optim.py (e.g. the parameter "
            "drawn into the spread layout for weight decay, and the update moved back where optax applies it)"
        )
    elif padded > 1.05 * bound:
        why = (
            f"each parameter's matrices are padded to a multiple of the {n} devices with zero matrices (all-to-"
            f"alls send equal blocks): {padded:,.0f} bytes with that padding, {padded / bound:.2f}x the bound"
        )
    else:
        why = "the spreading moves more than its all-to-alls: worth a look"
    return [f"optimizer: Muon's spread of its matrices sends {measured / bound:.2f}x its bound: {why}"]
