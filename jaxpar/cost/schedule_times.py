"""The planner's `--schedules` table: python -m jaxpar.tools.plan --config C --mesh pp=4 --schedules."""

from __future__ import annotations

import jax

from jaxpar.core.errors import UserError
from jaxpar.core.pipeline.choice import choose, modeled_time, with_schedule
from jaxpar.core.pipeline.schedules import PROGRAMS
from jaxpar.pipeline import auto as pipeline_auto


def compare(cfg, sizes: dict[str, int], plan, devices=None, budget: int | None = None) -> list[dict]:
    """Each pipeline schedule on this config and mesh.

    Bubble, peak and temp bytes per device, matmul FLOPs as a ratio to one device's program of the same batch
    (jaxpr_flops: recomputed work shows above 1.0), the modeled step time (FLOPs / (1 - bubble)) and whether
    parallel.pipeline_schedule=auto picks it (among those within `budget` bytes per device), or the one line that
    refuses it. plan(cfg, sizes, devices): the planner's dict. Interleaved takes the config's virtual stages, 2
    where it has 1. The FLOPs ratio is auto's own figure.
    """
    if sizes.get("pp", 1) < 2:
        raise UserError("--schedules compares pipeline schedules: the mesh needs pp > 1")
    devices = jax.devices() if devices is None else devices
    one: list = []  # one device's FLOPs, counted once for every schedule
    rows = []
    for schedule in PROGRAMS:
        c = with_schedule(cfg, schedule)
        try:
            p = plan(c, sizes, devices)
        except UserError as e:
            rows.append({"schedule": schedule, "refused": str(e)})
            continue
        ratio = pipeline_auto.flops_ratio(c, sizes, devices, one)
        rows.append(
            {
                "schedule": schedule,
                "virtual_stages": c.parallel.pipeline_virtual_stages,
                "bubble": p["pipeline"]["bubble"],
                "peak_bytes": p["peak_bytes"],
                "temp_bytes": p["temp_bytes"],
                "flops_ratio": ratio,
                "modeled_time": modeled_time(p["pipeline"]["bubble"], ratio),
                "fits": budget is None or p["peak_bytes"] <= budget,
            }
        )
    by = {r["schedule"]: r for r in rows if "refused" not in r}
    auto, _ = choose({s: r["bubble"] for s, r in by.items()}, lambda s: by[s]["flops_ratio"], lambda s: by[s]["fits"])
    for r in by.values():
        r["auto"] = r["schedule"] == auto
    return rows


def print_schedules(rows: list[dict]) -> None:
    print(
        f"{'schedule':<12} {'bubble':>7} {'peak/device':>14} {'temp/device':>14} {'matmul FLOPs':>13} "
        f"{'modeled time':>13}"
    )
    for r in rows:
        if "refused" in r:
            print(f"{r['schedule']:<12} refused: {r['refused']}")
            continue
        mark = "  <- auto" if r["auto"] else "" if r["fits"] else "  over --memory-per-device"
        print(
            f"{r['schedule']:<12} {r['bubble']:>7.3f} {r['peak_bytes'] / 2**20:>10.2f} MiB "
            f"{r['temp_bytes'] / 2**20:>10.2f} MiB {r['flops_ratio']:>12.2f}x {r['modeled_time']:>13.2f}{mark}"
        )
    print(
        "bubble: the schedule table's idle share (python -m jaxpar.tools.pipeline_table; dualpipev's in lockstep, a "
        "tick as long as its slowest op, its overlapped forward and backward three units); matmul FLOPs: the step's "
        "against one device's (above 1.0: work the schedule adds: GSPMD GPipe's bubble ticks); ZB's peak and temp "
        "include W's stash, each projection's input and output gradient from B to W (with remat, more than the "
        "layer inputs remat keeps); "
        "modeled time: FLOPs / (1 - bubble), 1.00 = one device's work on every stage without an idle tick; auto: "
        "parallel.pipeline_schedule=auto's choice, the least modeled time that fits in --memory-per-device"
    )
