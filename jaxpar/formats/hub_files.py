"""Reading the Hub's safetensors files, whatever their float type.

The Hub's checkpoints are mostly bfloat16, which numpy (and so safetensors' numpy reader) has no type for: such a
file is read through safetensors' jax reader on the CPU and widened to float32, exactly (jaxpar does not import torch).
"""

from __future__ import annotations

import numpy as np
from safetensors.numpy import load_file


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """A safetensors file's tensors as numpy arrays; bfloat16 ones widened to float32."""
    try:
        return load_file(path)
    except TypeError as e:  # "data type 'bfloat16' not understood"
        if "bfloat16" not in str(e):
            raise
    import jax  # deferred: jax (~1 s) for bfloat16 files only; float32 conversions stay numpy
    from safetensors.flax import load_file as load_jax  # deferred: with jax

    with jax.default_device(jax.devices("cpu")[0]):
        tensors = load_jax(path)
    wide = lambda t: np.asarray(t.astype("float32") if t.dtype == "bfloat16" else t)
    return {name: wide(t) for name, t in tensors.items()}
