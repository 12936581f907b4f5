"""A train step's peak bytes per device, from the step compiled for abstract inputs (nothing allocated).

The trainer's automatic pipeline schedule (jaxpar/pipeline/auto.py) fits schedules to a memory budget with it;
the planner (python -m jaxpar.tools.plan) reports it beside the step's collectives.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from jaxpar.core.config.schema import Config
from jaxpar.core.data.batch_shapes import bucket_shapes, shape_config
from jaxpar.cost.activations import offloaded_bytes
from jaxpar.step import build_step


def compile_layout(cfg: Config, sizes: dict[str, int], devices=None):
    """(compiled train step, layout, abstract state) for abstract inputs: nothing is allocated.

    PowerSGD's step is compiled without its warm-up (whose plain reduction would count beside the compressed one).
    """
    if cfg.parallel.grad_compression == "powersgd":
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, powersgd_warmup_steps=0))

    layout, state, step = build_step(cfg, sizes, devices, abstract=True)
    return step, layout, state


def shard_bytes(tree) -> int:
    """Bytes one device holds of the (abstract, sharded) arrays of `tree`."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def device_memory(compiled, layout, state) -> dict:
    """The compiled step's memory per device: its fields, the peak, and what waits in host memory.

    parallel.offload's state and model.remat=offload's activations: GPU backends count host-memory arguments
    apart; XLA:CPU counts them with the rest, so there the device's peak is the compiled one less them
    (`peak_estimated`).
    """
    mem = compiled.memory_analysis()
    peak = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes
    host = shard_bytes({k: state[k] for k in layout.offloaded})
    estimated = bool(host) and not getattr(mem, "host_argument_size_in_bytes", 0)
    if estimated:
        peak -= host
    held = offloaded_bytes(layout)
    if held and layout.mesh.devices.flat[0].platform == "cpu":
        peak -= held
        estimated = True
    return {
        "argument_bytes": mem.argument_size_in_bytes,
        "temp_bytes": mem.temp_size_in_bytes,
        "output_bytes": mem.output_size_in_bytes,
        "alias_bytes": mem.alias_size_in_bytes,
        "peak_bytes": peak,
        "host_bytes": host,
        "activation_host_bytes": held,
        "peak_estimated": estimated,
    }


def shape_peak_bytes(cfg: Config, sizes: dict[str, int], devices=None) -> int:
    """The peak bytes per device of the step at the config's own batch shape."""
    return device_memory(*compile_layout(cfg, sizes, devices))["peak_bytes"]


def peak_bytes(cfg: Config, sizes: dict[str, int], devices=None) -> int:
    """The step's peak bytes per device; with data.batching=buckets, the highest over the buckets' shapes."""
    if cfg.data.batching != "buckets":
        return shape_peak_bytes(cfg, sizes, devices)
    return max(shape_peak_bytes(shape_config(cfg, rows, T), sizes, devices) for rows, T in bucket_shapes(cfg))
