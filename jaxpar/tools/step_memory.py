"""A train step's memory measured on this host, for one CPU device (whose runtime keeps no memory counters).

python -m jaxpar.tools.step_memory --config C [key=value ...].

The step is compiled and run once, the memory the compiler and that first step freed is handed back to the system
(glibc's malloc_trim), the kernel's high-water mark of the process's resident set is reset, and one more step
runs: the mark's rise over the resident set just before the step is what the step's own buffers took at their most
(the planner's `temp` estimates it), and that rise plus the train state's bytes is the measured counterpart of the
planner's peak (jaxpar.tools.plan, XLA's memory analysis of the same compiled step; the process's Python and
libraries are left out of both). docs/benchmarks/chunked-loss-2026-11-27.md has its figures for the chunked loss.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re

import numpy as np

from jaxpar.core.config.schema import Config, load_config
from jaxpar.core.errors import cli

MIB = 2**20


def _status_bytes(field: str) -> int:
    """/proc/self/status's VmRSS (resident now) or VmHWM (its highest since the last reset) in bytes."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1)) * 1024


def measure(cfg: Config) -> dict:
    """Measured and planned memory of the config's train step on the first device.

    Returns {"state_bytes", "step_bytes" (the resident set's rise during a warm step), "peak_bytes" (their sum),
    "planned_temp_bytes", "planned_peak_bytes"}.
    """
    import jax  # deferred: jax reads JAX_PLATFORMS, which main sets, on import

    from jaxpar.step import build_step  # deferred: imports jax, after main sets JAX_PLATFORMS

    layout, state, step = build_step(cfg, {"dp": 1}, jax.devices()[:1])
    memory = step.memory_analysis()
    rows = np.random.default_rng(0).integers(0, cfg.model.vocab_size, layout.batch_shape, dtype=np.int32)
    batch = jax.device_put(rows, layout.batch_sharding)
    state = jax.block_until_ready(step(state, batch)[0])
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:  # the kernel's high-water mark starts again from now (Linux >= 4.0)
        f.write("5")
    before = _status_bytes("VmRSS")
    state = jax.block_until_ready(step(state, batch)[0])
    rise = _status_bytes("VmHWM") - before
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    return {
        "state_bytes": state_bytes,
        "step_bytes": rise,
        "peak_bytes": state_bytes + rise,
        "planned_temp_bytes": memory.temp_size_in_bytes,
        "planned_peak_bytes": memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + memory.temp_size_in_bytes,
    }


@cli
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m jaxpar.tools.step_memory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--config")
    ap.add_argument("--json", help="also write the figures as JSON here")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    result = measure(load_config(args.config, args.overrides))
    for key, value in result.items():
        print(f"{key:<20} {value / MIB:>10,.1f} MiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
