"""XLA options jaxpar sets on GPUs only, before jax starts (docs/gpu.md lists them with their reasons).

They let XLA overlap collectives with compute, which the scan over layers makes possible: the fsdp
all-gather of layer i+1's weights and the reduce-scatter of layer i-1's gradients run during layer i.
A flag the user already put in XLA_FLAGS is left as the user set it.
"""

from __future__ import annotations

import os

COMBINE_BYTES = 1 << 27  # collectives combined into one call up to 128 MiB (the default ~30 MiB splits layers)
GPU_FLAGS = {
    "xla_gpu_enable_latency_hiding_scheduler": "true",  # schedule async collectives around compute
    "xla_gpu_enable_while_loop_double_buffering": "true",  # the scan body unrolled x2: overlap across layers
    "xla_gpu_enable_pipelined_all_gather": "true",  # fsdp: gather the next layer's weights ahead
    "xla_gpu_enable_pipelined_reduce_scatter": "true",  # fsdp: scatter the previous layer's gradients behind
    "xla_gpu_enable_pipelined_all_reduce": "true",  # dp: all-reduce gradients behind
    "xla_gpu_all_reduce_combine_threshold_bytes": str(COMBINE_BYTES),
    "xla_gpu_all_gather_combine_threshold_bytes": str(COMBINE_BYTES),
    "xla_gpu_reduce_scatter_combine_threshold_bytes": str(COMBINE_BYTES),
}


def with_gpu_flags(xla_flags: str) -> str:
    """XLA_FLAGS with jaxpar's GPU options added where the user has not set them."""
    present = {f.lstrip("-").split("=", 1)[0] for f in xla_flags.split()}
    added = [f"--{k}={v}" for k, v in GPU_FLAGS.items() if k not in present]
    return " ".join([xla_flags, *added]).strip()


def set_gpu_flags() -> None:
    """Called on a machine with a GPU, before jax initialises its backends."""
    os.environ["XLA_FLAGS"] = with_gpu_flags(os.environ.get("XLA_FLAGS", ""))
