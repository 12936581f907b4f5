"""Layer rules both frameworks' models share, derived from the config alone: sketches, block sparsity, loss chunks.

Sketched linear layers (model.linear=sketched): y = (x S) W + b with a fixed random sketch S [in, m] and a trained
factor W [m, out].

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

Block-sparse dilated attention (model.sparsity_ratio; models/dilated.py in jaxpar and torchpar, and decoding's
key_counts): which key blocks each query block of a dilated segment computes.

Each (segment length w, rate r) pair gives head h, in every segment, a row of min(w, T)/r selected tokens that
attend causally among themselves. Block sparsity cuts that row into blocks of model.sparsity_block tokens. Query
block i has i + 1 causal candidates: its own (diagonal) block, always kept so that every token has a key, and
the i blocks before it. It keeps ceil(sparsity_ratio x (i + 1)) of the candidates in all: the diagonal and that
many minus one past blocks drawn without replacement by numpy's PCG64 seeded with (model.sparsity_seed, w, r, h,
i). The draw is a pure function of those five numbers, never of the sequence length or of the process, so both
frameworks, every device, and decoding over a longer context see the same blocks; every segment of a pair and
every layer use the same pattern. sparsity_ratio 0 (the default) or 1 keeps every causal block: dense.

A computation with static shapes gives every query block the same number of key slots, K = the last block's
count (the most), and masks the slots a block does not use: its attention costs about K / n_blocks
~ sparsity_ratio of the dense segment's n x n scores.

Loss chunks (model.loss_chunks): how many chunks of positions the output head and its loss run in, one rule for
both frameworks (jaxpar/models/head.py, torchpar/models/head.py), so that both sum the same positions together.
"""

from __future__ import annotations

import functools
import math
import zlib
from dataclasses import dataclass

import numpy as np

from jaxpar.core.config.schema import ModelConfig

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


@dataclass(frozen=True)
class BlockSparsity:
    ratio: float  # the share of a query block's causal key blocks it computes, in (0, 1)
    block: int  # tokens of a pair's dilated row per block
    seed: int


def block_sparsity(m: ModelConfig) -> BlockSparsity | None:
    """The model's block sparsity; None where attention is dense (not dilated, or a ratio of 0 or 1)."""
    if m.attention != "dilated" or not 0 < m.sparsity_ratio < 1:
        return None
    return BlockSparsity(m.sparsity_ratio, m.sparsity_block, m.sparsity_seed)


def kept_count(ratio: float, candidates: int) -> int:
    """How many of its `candidates` causal blocks a query block keeps (at least its own)."""
    return max(1, math.ceil(ratio * candidates - 1e-9))  # the tolerance: 0.1 * 30 is 3.0000000000000004


@functools.lru_cache(maxsize=256)
def kept_blocks(sp: BlockSparsity, w: int, r: int, n_head: int, n_blocks: int) -> np.ndarray:
    """[heads, n_blocks, K] int32.

    The key blocks query block i of head h computes in the pair (w, r) (w as configured, not cut to the sequence):
    slot 0 its own block, then its drawn past blocks ascending, -1 in the slots it leaves unused. Read-only
    (cached).
    """
    K = kept_count(sp.ratio, n_blocks)
    out = np.full((n_head, n_blocks, K), -1, np.int32)
    for h in range(n_head):
        for i in range(n_blocks):
            rng = np.random.Generator(np.random.PCG64([sp.seed, w, r, h, i]))
            past = rng.permutation(i)[: kept_count(sp.ratio, i + 1) - 1]
            out[h, i, : 1 + len(past)] = [i, *sorted(past)]
    out.flags.writeable = False
    return out


def block_mask(sp: BlockSparsity, w: int, r: int, n_head: int, n_blocks: int) -> np.ndarray:
    """[heads, n_blocks, n_blocks] bool: query block i of head h computes key block j."""
    return dense_blocks(kept_blocks(sp, w, r, n_head, n_blocks))


def dense_blocks(kept: np.ndarray) -> np.ndarray:
    """kept_blocks' [heads, n_blocks, K] indices as a [heads, n_blocks, n_blocks] bool mask."""
    H, nb, _ = kept.shape
    mask = np.zeros((H, nb, nb + 1), bool)  # the last column takes the -1 slots
    np.put_along_axis(mask, np.where(kept < 0, nb, kept), True, axis=-1)
    return mask[..., :nb]


def loss_chunks(model_cfg, seq_len: int) -> int:
    """model.loss_chunks lowered to the largest count that divides `seq_len`.

    Each chunk holds seq_len / n positions of every row; 1: the whole logits at once.
    """
    return max(n for n in range(1, max(1, min(model_cfg.loss_chunks, seq_len)) + 1) if seq_len % n == 0)
