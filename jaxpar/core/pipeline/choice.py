"""parallel.pipeline_schedule=auto: the schedule with the least modeled step time for a config, in both frameworks.

The model is the planner's (python -m jaxpar.tools.plan --schedules): a step's time is its matmul FLOPs (as a ratio
to one device's program of the same batch) over the share of the schedule's table that is busy,

    modeled time = flops_ratio / (1 - bubble)

so 1.00 is one device's work spread over the stages with no idle tick. A schedule the config's checks refuse, or
whose planned peak memory exceeds the device's, is no candidate. The bubble comes from the shared tables
(pipeline_schedules.py, no tracing); the FLOPs ratio is each framework's own figure, asked for lazily: every
schedule's ratio is at least 1.0, so 1 / (1 - bubble) bounds its time from below, and the candidates are visited
in the order of that bound until the best time found is no more than the next bound (usually one or two figures,
not five). Ties go to the earlier schedule in PROGRAMS' order, gpipe last (it holds every microbatch's
activations). Pure Python: both trainers and the planner call `choose`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from jaxpar.core.errors import UserError
from jaxpar.core.pipeline.schedules import AUTO, PROGRAMS, configured_bubble


def with_schedule(cfg, schedule: str):
    """`cfg` running `schedule`; interleaved takes the config's virtual stages, 2 where it has 1 (as the planner)."""
    V = max(cfg.parallel.pipeline_virtual_stages, 2) if schedule == "interleaved" else 1
    return dataclasses.replace(
        cfg, parallel=dataclasses.replace(cfg.parallel, pipeline_schedule=schedule, pipeline_virtual_stages=V)
    )


def modeled_time(bubble: float, flops_ratio: float) -> float:
    return flops_ratio / (1.0 - bubble)


def _order(bubbles: dict[str, float]) -> list[str]:
    names = list(PROGRAMS)
    return sorted(bubbles, key=lambda s: (modeled_time(bubbles[s], 1.0), s == "gpipe", names.index(s)))


def choose(
    bubbles: dict[str, float], flops_ratio: Callable[[str], float], fits: Callable[[str], bool] = lambda s: True
) -> tuple[str | None, dict[str, float]]:
    """(the schedule of least modeled time, {schedule: modeled time} of those whose figures were taken).

    bubbles: the candidates' bubble; flops_ratio and fits are called only for schedules that could still win.
    """
    best, times = None, {}
    for s in _order(bubbles):
        if best is not None and modeled_time(bubbles[s], 1.0) >= times[best]:
            break  # no schedule from here on can be faster than `best`
        times[s] = modeled_time(bubbles[s], flops_ratio(s))
        if (best is None or times[s] < times[best]) and fits(s):
            best = s
    return best, times


def candidates(cfg, stages: int, refusal: Callable[[object], None]) -> tuple[dict[str, float], dict[str, str]]:
    """({schedule: bubble} of those the config's checks accept, {schedule: the line that refuses it})."""
    p, bubbles, refused = cfg.parallel, {}, {}
    for s in PROGRAMS:
        if p.pipeline_virtual_stages > 1 and s != "interleaved":  # set by the user: only interleaved runs it
            refused[s] = f"parallel.pipeline_virtual_stages={p.pipeline_virtual_stages} is for interleaved only"
            continue
        c = with_schedule(cfg, s)
        try:
            refusal(c)
            bubbles[s] = configured_bubble(s, stages, p.pipeline_microbatches, c.parallel.pipeline_virtual_stages)
        except UserError as e:
            refused[s] = str(e)
    return bubbles, refused


def resolve(
    cfg,
    stages: int,
    refusal: Callable[[object], None],
    flops_ratio: Callable[[object], float],
    fits: Callable[[object], bool] = lambda c: True,
) -> tuple[object, str | None]:
    """(cfg with auto replaced by its choice, the start-up line saying it).

    `cfg` and None where the schedule is not auto or there is no pipeline. refusal(cfg) raises the UserError that
    refuses a schedule's config; flops_ratio(cfg) and fits(cfg) give the framework's figures.
    """
    if cfg.parallel.pipeline_schedule != AUTO or stages < 2:
        return cfg, None
    bubbles, refused = candidates(cfg, stages, refusal)
    best, times = choose(bubbles, lambda s: flops_ratio(with_schedule(cfg, s)), lambda s: fits(with_schedule(cfg, s)))
    if best is None and not times and len(set(refused.values())) == 1:
        raise UserError(next(iter(refused.values())))  # a refusal no schedule changes: as validate says it
    if best is None:
        raise UserError(
            "parallel.pipeline_schedule=auto: no schedule runs this config ("
            + "; ".join(f"{s}: {why}" for s, why in refused.items())
            + "".join(f"; {s}: over the device's memory" for s in times)
            + ")"
        )
    return with_schedule(cfg, best), describe(best, times, bubbles)


def describe(best: str, times: dict[str, float], bubbles: dict[str, float]) -> str:
    others = [f"{s} {t:.2f}" for s, t in times.items() if s != best]
    rest = [s for s in bubbles if s not in times]
    bound = min((modeled_time(bubbles[s], 1.0) for s in rest), default=None)
    return (
        f"pipeline schedule auto -> {best} (modeled step time {times[best]:.2f}: matmul FLOPs / (1 - bubble), "
        f"1.00 = one device's work without idle ticks"
        + "".join(f"; {o}" for o in others)
        + (f"; {', '.join(rest)} at least {bound:.2f}" if rest else "")
        + ")"
    )
