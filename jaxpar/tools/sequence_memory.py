"""Per-device activation memory of loss+grad under sequence parallelism, from XLA's compiled memory
analysis (nothing is run): `python -m jaxpar.tools.sequence_memory [--seq-len T] [--devices 8]`.

For each attention strategy and sp = N it compiles value_and_grad of the training loss on an
sp=N mesh and reports `temp_size_in_bytes` (the per-device scratch: activations, residuals,
score blocks) against the unsharded program's (N = 1), with the target bound 1.3/N.
On CPU the devices are simulated (`jax_num_cpu_devices`).
"""
from __future__ import annotations

import argparse
import sys

from jaxpar.core.errors import UserError, cli


def loss_and_grad_program(cfg, sizes: dict[str, int], devices, schedule: str | None = None):
    """(fn, abstract params, abstract batch): (loss, grads) on a mesh of `sizes` as the train step computes
    them (`schedule`: run that pipeline schedule on the hand-scheduled executor), ready to trace."""
    import math

    import jax

    from jaxpar.context import use
    from jaxpar.layout import Layout
    from jaxpar.mesh import make_mesh
    from jaxpar.state import abstract_state
    from jaxpar.step import loss_and_grad

    layout = Layout(cfg, make_mesh(sizes, devices[:math.prod(sizes.values())]))
    fn, context = loss_and_grad(layout, schedule)
    params = abstract_state(layout)["params"]
    batch = jax.ShapeDtypeStruct(layout.batch_shape, jax.numpy.int32, sharding=layout.batch_sharding)

    def traced(params, batch):
        with use(context):
            return fn(params, batch)

    return traced, params, batch


def measure(cfg, sizes: dict[str, int], devices, schedule: str | None = None):
    """Compiled memory analysis of (loss, grads) on a mesh of `sizes` (see loss_and_grad_program)."""
    import jax

    traced, params, batch = loss_and_grad_program(cfg, sizes, devices, schedule)
    return jax.jit(traced).lower(params, batch).compile().memory_analysis()


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

    import jax
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.devices)
    from jaxpar.core.config import load_config

    T, sizes = args.seq_len, [n for n in (1, 2, 4, 8) if n <= args.devices]
    overrides = args.model.split(",") + [f"data.seq_len={T}", f"model.max_seq_len={T}", "train.global_batch_size=1",
                                         "train.matmul_precision=highest"]
    print(f"jax {jax.__version__}, {jax.devices()[0].platform} x{args.devices}, seq_len {T}, "
          f"{' '.join(args.model.split(','))}, batch 1\n")
    print("| attention | zig-zag | sp=N | temp bytes / device | ratio to N=1 | bound 1.3/N | holds |")
    print("|---|---|---|---|---|---|---|")
    devices = jax.devices()
    for strategy in args.strategies.split(","):
        for zigzag in (True, False):
            cfg = load_config(None, overrides + [f"parallel.sequence_attention={strategy}",
                                                 f"parallel.sequence_zigzag={zigzag}"])
            base = None
            for n in sizes:
                temp = measure(cfg, {"sp": n}, devices).temp_size_in_bytes
                base = base or temp
                ratio, bound = temp / base, 1.3 / n
                print(f"| {strategy} | {'yes' if zigzag else 'no'} | {n} | {temp:,} | {ratio:.3f} | {bound:.3f} | "
                      f"{'yes' if ratio <= bound else '**no**'} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
