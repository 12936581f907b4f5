"""Sketched linear layers: y = (x S) W + b with a fixed random sketch S [in, m] and a trained factor W [m, out].

m = max(1, round(sketch_ratio * in)). S is Gaussian N(0, 1/m) or random signs +-1/sqrt(m) (so
E[S S^T] = I) and is *derived*, never trained or stored: `sketch_matrix` draws it with numpy's
counter-free PCG64 seeded by (model.sketch_seed, layer, crc32(name)) — not Python's salted
`hash`, not any process-global RNG state — so every device, process and framework builds the
same bits (torchpar calls this same function for its non-persistent buffers). The shared weights
file holds only the factor and the bias; the optimizer sees only them.

The model passes the per-layer sketches into the layer scan beside the parameters (a constant of
L*in*m floats in the compiled program). Tensor parallelism: the factor's output features are
split over `tp` for `fc` ("mlp"); `proj` contracts the tp-sharded hidden features through its
sketch (row-parallel) and keeps its output on "embed".

Shared layout: blocks.mlp.{fc,proj}.factor [L, m, out] and .bias [L, out].
"""
from __future__ import annotations

import zlib

import numpy as np

from jaxpar.core.config import ModelConfig

NAMES = ("fc", "proj")


def sketch_dim(cfg: ModelConfig, in_features: int) -> int:
    return max(1, round(cfg.sketch_ratio * in_features))


def mlp_in_features(cfg: ModelConfig) -> dict[str, int]:
    return {"fc": cfg.d_model, "proj": cfg.ff_dim}


def sketch_matrix(cfg: ModelConfig, layer: int, name: str) -> np.ndarray:
    """The sketch of one layer's `name` projection, float32 [in, m]; a pure function of the config."""
    n_in = mlp_in_features(cfg)[name]
    m = sketch_dim(cfg, n_in)
    rng = np.random.Generator(np.random.PCG64([cfg.sketch_seed, layer, zlib.crc32(name.encode())]))
    if cfg.sketch == "sign":
        s = np.where(rng.integers(0, 2, (n_in, m)) == 1, 1.0, -1.0)
    else:
        s = rng.standard_normal((n_in, m))
    return (s / np.sqrt(m)).astype(np.float32)


def stacked_sketches(cfg: ModelConfig) -> dict[str, np.ndarray]:
    """{name: [n_layer, in, m]} for a sketched MLP; {} for a dense one."""
    if cfg.linear != "sketched":
        return {}
    return {name: np.stack([sketch_matrix(cfg, i, name) for i in range(cfg.n_layer)]) for name in NAMES}
