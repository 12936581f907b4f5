"""Prints the clock-cycle table and bubble fraction of a pipeline schedule.

python -m jaxpar.tools.pipeline_table --stages S --microbatches M [--schedule 1f1b] [--virtual-stages V]

Prints the clock-cycle table of a pipeline schedule (which stage runs the forward F or backward B
of which microbatch at each tick; `F3.1` = microbatch 3 on the device's virtual chunk 1; zb_h1 and zb_v
split the backward into B, the input gradient, and W, the weight gradient; zb_v's and dualpipev's chunk 1 runs back
up the devices; dualpipev's `F5+BW1.1` overlaps microbatch 5's forward on chunk 0 with microbatch 1's whole backward
on chunk 1) and its bubble fraction, with one unit of time per operation (a zb_v op is half a stage's layers), and
in lockstep, a tick as long as its slowest op (pipeline_schedules.lockstep_bubble: the executor's).
"""

from __future__ import annotations

import argparse
import sys

from jaxpar.core.errors import cli
from jaxpar.core.pipeline.schedules import (
    SPLIT_BACKWARD,
    PROGRAMS,
    V_SHAPED,
    bubble_fraction,
    chunks,
    lockstep_bubble,
    max_in_flight,
    render,
    simulate,
)


@cli
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m jaxpar.tools.pipeline_table",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--stages", type=int, required=True)
    ap.add_argument("--microbatches", type=int, required=True)
    ap.add_argument("--schedule", default="1f1b", choices=tuple(PROGRAMS))
    ap.add_argument("--virtual-stages", type=int, default=1)
    args = ap.parse_args(argv)
    table = simulate(args.schedule, args.stages, args.microbatches, args.virtual_stages)
    print(render(table))
    S, M, V = args.stages, args.microbatches, args.virtual_stages
    textbook = {
        "zb_h1": f"(S-1)/(3M+S-1) = {(S - 1) / (3 * M + S - 1):.3f}, 1F1B's (S-1)/(M+S-1) = "
        f"{(S - 1) / (M + S - 1):.3f}",
        "zb_v": f"at least (S-1)/(6M+S-1) = {(S - 1) / (6 * M + S - 1):.3f}: two chunks of F, B, W per "
        "microbatch, the last device starting after S-1 of them",
        "dualpipev": "none: its ops are one to three units",
    }.get(args.schedule, f"(S-1)/(V*M+S-1) = {(S - 1) / (V * M + S - 1):.3f}")
    # ZB's bubble as the paper measures it, in time: idle units of one stage's F, B or W per device (a ZB-V tick is
    # half a unit: its chunks are half a stage)
    idle = sum(op is None for row in table for op in row) / S / chunks(args.schedule, V)
    idle = f", idle {idle:g} units of a stage's F, B or W per device" if args.schedule in SPLIT_BACKWARD else ""
    print(
        f"\n{args.schedule}: {len(table)} ticks, bubble {bubble_fraction(table):.3f} (textbook {textbook}){idle}; "
        f"lockstep {lockstep_bubble(args.schedule, table):.3f}; peak microbatches in flight on stage 0: "
        f"{max_in_flight(table, 0)}, on the last stage: {max_in_flight(table, S - 1)}"
        + (" chunks of half a stage" if args.schedule in V_SHAPED else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
