"""Per-device activation memory of loss+grad under sequence parallelism, from XLA's compiled memory analysis.

Nothing is run: `python -m jaxpar.tools.sequence_memory [--seq-len T] [--devices 8]`.

For each attention strategy and sp = N it compiles value_and_grad of the training loss on an
sp=N mesh and reports `temp_size_in_bytes` (the per-device scratch: activations, residuals,
score blocks) against the unsharded program's (N = 1), with the target bound 1.3/N.
On CPU the devices are simulated (`jax_num_cpu_devices`).
"""

from __future__ import annotations

import argparse
import sys

from jaxpar.core.config.schema import load_config
from jaxpar.core.errors import UserError, cli


@cli
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--strategies", default="ring,all_gather,ulysses")
    ap.add_argument("--model", default="model.n_layer=2,model.n_head=8,model.d_model=64,model.vocab_size=256")
    args = ap.parse_args(argv)
    if args.devices < 1 or args.seq_len < 1:
        raise UserError("--devices and --seq-len must be at least 1")

    import jax  # deferred: jax (~1 s) loads after the arguments are checked; its CPU devices set below

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.devices)
    from jaxpar.cost.loss_and_grad import compiled_memory  # deferred: imports jax, once the devices are set

    T, sizes = args.seq_len, [n for n in (1, 2, 4, 8) if n <= args.devices]
    overrides = args.model.split(",") + [
        f"data.seq_len={T}",
        f"model.max_seq_len={T}",
        "train.global_batch_size=1",
        "train.matmul_precision=highest",
    ]
    print(
        f"jax {jax.__version__}, {jax.devices()[0].platform} x{args.devices}, seq_len {T}, "
        f"{' '.join(args.model.split(','))}, batch 1\n"
    )
    print("| attention | zig-zag | sp=N | temp bytes / device | ratio to N=1 | bound 1.3/N | holds |")
    print("|---|---|---|---|---|---|---|")
    devices = jax.devices()
    for strategy in args.strategies.split(","):
        for zigzag in (True, False):
            cfg = load_config(
                None, overrides + [f"parallel.sequence_attention={strategy}", f"parallel.sequence_zigzag={zigzag}"]
            )
            base = None
            for n in sizes:
                temp = compiled_memory(cfg, {"sp": n}, devices).temp_size_in_bytes
                base = base or temp
                ratio, bound = temp / base, 1.3 / n
                print(
                    f"| {strategy} | {'yes' if zigzag else 'no'} | {n} | {temp:,} | {ratio:.3f} | {bound:.3f} | "
                    f"{'yes' if ratio <= bound else '**no**'} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
