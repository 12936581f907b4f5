"""Per-device temporary memory and matmul FLOPs of a pipelined loss+grad as the microbatch count grows.

Compiled and traced, nothing is run:
`python -m jaxpar.tools.pipeline_memory [--stages 4] [--microbatches 4,8,16] [--seq-len 512] [--rows ...]`.

The microbatch size is fixed (global batch = M x microbatch size), so a schedule whose stages keep
every microbatch's activations until the backward (GPipe) grows linearly in M, and one that keeps
at most ~S in flight (1F1B) stays flat. Rows:
  gpipe                GPipe on GSPMD, gradients by jax.grad through the ticks (gpipe.py)
  gpipe (executor)     the GPipe order on the hand-scheduled executor (pipeline/executor.py)
  1f1b                 1F1B on the executor
  zb_h1                ZB-H1 on the executor (W: the projections' weight gradients from the inputs and output
                       gradients B kept, under every model.remat)
  zb_v                 ZB-V on the executor (two chunks of half a stage per device, in a V; W as ZB-H1's)
Memory: XLA's `temp_size_in_bytes` per device. FLOPs: matmul FLOPs of one step summed over the devices
(jaxpar/cost/jaxpr_flops.py; the executor's ticks counted from its table), as a ratio to one device's program of the
same batch: above 1.0 is computation a schedule adds (GSPMD GPipe's bubble ticks compute on garbage; a
recomputed forward). Target: 1F1B's temp at M=16 <= 1.25x its temp at M=4.
"""

from __future__ import annotations

import argparse
import sys

from jaxpar.core.config.schema import load_config
from jaxpar.core.errors import UserError, cli
from jaxpar.pipeline.tick_plan import tick_plan

ROWS = {"gpipe": "gpipe", "gpipe (executor)": "gpipe", "1f1b": "1f1b", "zb_h1": "zb_h1", "zb_v": "zb_v"}


@cli
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--microbatches", default="4,8,16")
    ap.add_argument("--microbatch-size", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--rows", default=",".join(ROWS), help=f"which rows (default all: {', '.join(ROWS)})")
    ap.add_argument("--model", default="model.n_layer=8,model.n_head=4,model.d_model=128,model.vocab_size=256")
    args = ap.parse_args(argv)
    if set(args.rows.split(",")) - set(ROWS):
        ap.error(f"--rows {args.rows!r}: choose from {', '.join(ROWS)}")
    if min(args.stages, args.microbatch_size, args.seq_len) < 1:
        raise UserError("--stages, --microbatch-size and --seq-len must be at least 1")
    if not all(m.isdigit() and int(m) > 0 for m in args.microbatches.split(",")):
        raise UserError(f"--microbatches {args.microbatches!r}: positive whole numbers, comma-separated")

    import jax  # deferred: jax (~1 s) loads after the arguments are checked; its CPU devices set below

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.stages)
    from jaxpar.cost.loss_and_grad import compiled_memory, step_flops  # deferred: imports jax, once the devices are set

    S, T, b = args.stages, args.seq_len, args.microbatch_size
    counts = [int(m) for m in args.microbatches.split(",")]
    print(
        f"jax {jax.__version__}, {jax.devices()[0].platform} x{S} (pp={S}), seq_len {T}, "
        f"{' '.join(args.model.split(','))}, microbatch size {b}, float32\n"
    )
    print(
        f"| schedule | M | temp bytes / device | ratio to M={counts[0]} | microbatches' residuals kept (executor) "
        "| matmul FLOPs / step | ratio to one device |"
    )
    print("|---|---|---|---|---|---|---|")
    one_device = {}  # M -> matmul FLOPs of the same batch on one device (the same for every row)
    for row, schedule in ((r, ROWS[r]) for r in args.rows.split(",")):
        base = None
        for M in counts:
            cfg = load_config(
                None,
                args.model.split(",")
                + [
                    f"data.seq_len={T}",
                    f"model.max_seq_len={T}",
                    f"train.global_batch_size={M * b}",
                    f"parallel.pipeline_microbatches={M}",
                    f"parallel.pipeline_schedule={schedule}",
                    "train.matmul_precision=highest",
                ],
            )
            on_executor = schedule if row != "gpipe" else None
            temp = compiled_memory(cfg, {"pp": S}, jax.devices(), on_executor).temp_size_in_bytes
            base = base or temp
            kept = tick_plan(schedule, S, M, 1).res_slots - 1 if on_executor else "all activations"
            kept = f"{kept} chunks of half a stage" if schedule == "zb_v" else kept
            flops = step_flops(cfg, {"pp": S}, jax.devices(), on_executor)
            if M not in one_device:
                one_device[M] = step_flops(cfg, {"pp": 1}, jax.devices()[:1], None)
            one = one_device[M]
            print(
                f"| {row} | {M} | {temp:,} | {temp / base:.2f} | {kept} | {flops:.3e} | {flops / one:.2f} |", flush=True
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
