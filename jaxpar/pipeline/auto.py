"""jaxpar's figures for parallel.pipeline_schedule=auto (the choice itself: jaxpar/core/pipeline/choice.py).

A candidate is a schedule jaxpar's checks accept (the contract and the layout's refusals, every batch shape); its
FLOPs ratio is the planner's: matmul FLOPs of the traced (loss, grads) program, nothing compiled, against one
device's program of the same batch (jaxpar/cost/loss_and_grad.py: step_flops); it fits where the device
reports a memory limit (GPUs) and the planner's compiled peak is within it (only the schedules that could win are
compiled; on a CPU nothing is). On gpt2-tiny with 8 layers on pp=4 the choice traces one device's program and
one or three schedules' (about 2-5 s on a CPU core).
"""

from __future__ import annotations

import dataclasses
import math

import jax

from jaxpar.checks import check_config
from jaxpar.core.pipeline.choice import resolve
from jaxpar.cost.loss_and_grad import step_flops
from jaxpar.pipeline.tick_plan import HAND_SCHEDULED


def _full(sizes: dict) -> dict:
    return {a: sizes.get(a, 1) for a in ("dp", "fsdp", "tp", "pp", "sp", "ep")} | dict(sizes)


def refusal(cfg, sizes: dict) -> None:
    """The UserError jaxpar refuses `cfg` on `sizes` with, if any (validate's checks short of run.dir's)."""
    check_config(cfg, sizes)


def flops_ratio(cfg, sizes: dict, devices, one: list) -> float:
    """The step's matmul FLOPs over one device's; `one` holds one device's once counted (the same for every schedule).

    Counted with the state on the devices: parallel.offload moves it to the host between steps only, and a program
    traced on host-resident parameters is not the step's (the trainer brings them in first).
    """
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, offload="none"))
    if not one:
        one.append(step_flops(cfg, {"dp": 1}, devices[:1], None))
    schedule = cfg.parallel.pipeline_schedule
    return step_flops(cfg, sizes, devices, schedule if schedule in HAND_SCHEDULED else None) / one[0]


def memory_limit(device) -> int | None:
    """The device's memory in bytes where its backend reports it (GPUs), else None (the CPU: everything fits)."""
    return (device.memory_stats() or {}).get("bytes_limit")


def resolve_schedule(cfg, sizes: dict, devices, peak, budget: int | None = None):
    """(cfg with parallel.pipeline_schedule=auto resolved for this mesh, the start-up line or None).

    peak(cfg, sizes, devices): the planner's peak bytes per device (jaxpar/cost/peak_bytes.py; compiled only where a
    budget is known); `budget`: bytes per device (default: the device's reported limit).
    """
    sizes = _full(sizes)
    devices = list(jax.devices() if devices is None else devices)[: math.prod(sizes.values())]
    budget = memory_limit(jax.local_devices()[0]) if budget is None else budget
    one: list = []
    return resolve(
        cfg,
        sizes["pp"],
        lambda c: refusal(c, sizes),
        lambda c: flops_ratio(c, sizes, devices, one),
        lambda c: budget is None or peak(c, sizes, devices) <= budget,
    )
