"""Per-device temporary memory of a pipelined loss+grad as the microbatch count grows, from XLA's
compiled memory analysis (nothing is run):
`python -m jaxpar.tools.pipeline_memory [--stages 4] [--microbatches 4,8,16] [--seq-len 512]`.

The microbatch size is fixed (global batch = M x microbatch size), so a schedule whose stages keep
every microbatch's activations until the backward (GPipe) grows linearly in M, and one that keeps
at most ~S in flight (1F1B) stays flat. Rows:
  gpipe                GPipe on GSPMD, gradients by jax.grad through the ticks (pipeline.py)
  gpipe (executor)     the GPipe order on the hand-scheduled executor (pipeline_executor.py)
  1f1b                 1F1B on the executor
  zb_h1                ZB-H1 on the executor (stage inputs and output cotangents kept until the W tick)
Target: 1F1B's temp at M=16 <= 1.25x its temp at M=4.
"""
from __future__ import annotations

import argparse

ROWS = {"gpipe": "gpipe", "gpipe (executor)": "gpipe", "1f1b": "1f1b", "zb_h1": "zb_h1"}


def main(argv=None) -> None:
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

    import jax
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.stages)
    from jaxpar.core.config import load_config
    from jaxpar.parallel.pipeline_executor import tick_plan
    from jaxpar.tools.sequence_memory import measure

    S, T, b = args.stages, args.seq_len, args.microbatch_size
    counts = [int(m) for m in args.microbatches.split(",")]
    print(f"jax {jax.__version__}, {jax.devices()[0].platform} x{S} (pp={S}), seq_len {T}, "
          f"{' '.join(args.model.split(','))}, microbatch size {b}, float32\n")
    print(f"| schedule | M | temp bytes / device | ratio to M={counts[0]} | stage inputs kept (executor) |")
    print("|---|---|---|---|---|")
    for row, schedule in ((r, ROWS[r]) for r in args.rows.split(",")):
        base = None
        for M in counts:
            cfg = load_config(None, args.model.split(",") + [
                f"data.seq_len={T}", f"model.max_seq_len={T}", f"train.global_batch_size={M * b}",
                f"parallel.pipeline_microbatches={M}", f"parallel.pipeline_schedule={schedule}",
                "train.matmul_precision=highest"])
            on_executor = schedule if row == "gpipe (executor)" else None
            temp = measure(cfg, {"pp": S}, jax.devices(), on_executor).temp_size_in_bytes
            base = base or temp
            kept = tick_plan(schedule, S, M, 1).act_slots - 1 if row != "gpipe" else "all activations"
            print(f"| {row} | {M} | {temp:,} | {temp / base:.2f} | {kept} |", flush=True)


if __name__ == "__main__":
    main()
