"""The shared weight file: safetensors, one tensor per jaxpar parameter path ("blocks.mlp.fc.kernel").

jaxpar's own names and shapes *are* the shared layout; torchpar maps onto it (torchpar/layout.py).
Pure numpy, no jax: both trainers read and write it.
"""
from __future__ import annotations

import os

import numpy as np
from safetensors.numpy import load_file, save_file

from jaxpar.errors import UserError


def flatten(tree: dict, prefix: str = "") -> dict:
    """{"blocks": {"mlp": {"fc": {"kernel": x}}}} -> {"blocks.mlp.fc.kernel": x} (leaves untouched)."""
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        out.update(flatten(value, name + ".") if isinstance(value, dict) else {name: value})
    return out


def unflatten(flat: dict[str, np.ndarray]) -> dict:
    tree: dict = {}
    for name, value in flat.items():
        node = tree
        *parents, leaf = name.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def save_weights(path: str, params: dict) -> None:
    """Write float32 weights atomically (temp file + rename)."""
    flat = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in flatten(params).items()}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    save_file(flat, tmp)
    os.replace(tmp, path)


def load_weights(path: str, expected_shapes: dict[str, tuple]) -> dict[str, np.ndarray]:
    """Flat {name: array}, checked name-for-name and shape-for-shape against the model."""
    if not os.path.exists(path):
        raise UserError(f"weights file not found: {path}")
    try:
        flat = load_file(path)
    except Exception as e:  # noqa: BLE001 - any unreadable file is bad input
        raise UserError(f"weights file {path} is not a readable safetensors file: {e}") from None
    missing = sorted(set(expected_shapes) - set(flat))
    extra = sorted(set(flat) - set(expected_shapes))
    if missing or extra:
        raise UserError(f"weights file {path} does not match the model: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, shape in expected_shapes.items():
        if tuple(flat[name].shape) != tuple(shape):
            raise UserError(f"weights file {path}: {name} has shape {tuple(flat[name].shape)}, model expects {tuple(shape)}")
    return flat
