"""DiLoCo's rules both trainers share: when the groups meet, and what groups do not run with.

The groups (a `diloco` axis in the mesh) train alone and meet every parallel.diloco_inner_steps steps, where the outer
optimizer (optim.outer_*: SGD at a constant lr with Nesterov momentum) applies their mean parameter delta. Streaming
DiLoCo (parallel.diloco_fragments=F) meets by fragment: fragment f holds the f-th of F equal runs of layers of every
layer stack (the other parameters are fragment 0's) and meets after every H-th step counted from step f x H / F.
After the run's last step every fragment meets, so the trained parameters hold every step.

With parallel.diloco_delay=D (streaming's overlap) a meeting's exchange starts after its step and lands D steps later:
the groups' mean delta is taken at the start, the outer step is applied at the landing, and the fragment's parameters
in every group become the result (the D inner steps between are the other fragments' alone). An exchange that would not
land before the run's last step does not start; the last step's meeting covers it. docs/diloco.md.
"""

from __future__ import annotations

from jaxpar.core.config.schema import Config
from jaxpar.core.errors import UserError

AXIS = "diloco"


def scheduled(cfg: Config, step: int) -> list[int]:
    """The fragments whose meeting falls after the 0-based `step` on the schedule (the run's end aside)."""
    H, F = cfg.parallel.diloco_inner_steps, cfg.parallel.diloco_fragments
    return [f for f in range(F) if (step + 1 - f * H // F) % H == 0]


def meeting(cfg: Config, step: int) -> list[int]:
    """The fragments whose groups meet between the 0-based `step` and the next: every one after the last step."""
    if step + 1 == cfg.train.steps:
        return list(range(cfg.parallel.diloco_fragments))
    return [] if cfg.parallel.diloco_delay else scheduled(cfg, step)


def starts(cfg: Config, step: int) -> list[int]:
    """The fragments whose exchange starts after `step`, to land parallel.diloco_delay steps later (before the last)."""
    delay = cfg.parallel.diloco_delay
    if not delay or step + delay >= cfg.train.steps - 1:
        return []
    return scheduled(cfg, step)


def layer_runs(layers: int, fragments: int, stack: str) -> list[range]:
    """Each fragment's run of a stack of `layers` layers, or one line where the fragments do not divide them."""
    if layers % fragments:
        raise UserError(
            f"parallel.diloco_fragments={fragments} does not divide the {layers} layers of {stack}: each "
            "fragment holds an equal run of every layer stack's layers"
        )
    n = layers // fragments
    return [range(f * n, (f + 1) * n) for f in range(fragments)]


def due(cfg: Config, started: list[int], step: int) -> list[int]:
    """The exchanges in flight (`started`: each fragment's start step, -1: none) that land after `step`.

    parallel.diloco_delay steps after their start, or after the last step whatever their start (a resumed run whose
    train.steps moved).
    """
    last, delay = step + 1 == cfg.train.steps, cfg.parallel.diloco_delay
    return [f for f, t in enumerate(started) if t >= 0 and (t + delay == step or last)]


def actions(cfg: Config, started: list[int], step: int) -> list[tuple[int, str]]:
    """What follows the 0-based `step`, in order: (fragment, "land" | "meet" | "start") for both trainers.

    The exchanges in flight that are due land; the fragments that meet now meet (after the last step, those that did
    not just land); the exchanges of this step start, one still in flight for the same fragment (a resume moved
    parallel.diloco_inner_steps) landing first.
    """
    landed = due(cfg, started, step)
    out = [(f, "land") for f in landed] + [(f, "meet") for f in meeting(cfg, step) if f not in landed]
    for f in starts(cfg, step):
        out += [(f, "land")] * (started[f] >= 0 and f not in landed) + [(f, "start")]
    return out


def check_diloco(cfg: Config, sizes) -> None:
    """What DiLoCo's groups do not run with yet, one line each (sizes: mesh axis -> size)."""
    if sizes.get(AXIS, 1) == 1:
        return
    p, m = cfg.parallel, cfg.model
    refusals = {
        "parallel.grad_compression=powersgd": p.grad_compression == "powersgd",
        f"parallel.offload={p.offload}": p.offload != "none",
        "model.compute_dtype=float16 (its loss scale)": m.compute_dtype == "float16",
    }
    for what, refused in refusals.items():
        if refused:
            raise UserError(f"diloco={sizes[AXIS]} in the mesh does not run with {what} yet (docs/diloco.md)")
    H, F = p.diloco_inner_steps, p.diloco_fragments
    if H % F:
        raise UserError(f"parallel.diloco_fragments={F} does not divide parallel.diloco_inner_steps={H}")
    if p.diloco_delay >= H:
        raise UserError(
            f"parallel.diloco_delay={p.diloco_delay} must be below parallel.diloco_inner_steps={H}, so that an "
            "exchange lands before its fragment's next one starts"
        )
