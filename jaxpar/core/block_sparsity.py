"""The block pattern of block-sparse dilated attention (model.sparsity_ratio; models/dilated.py in jaxpar and
torchpar, and decoding's key_counts): which key blocks each query block of a dilated segment computes.

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
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from jaxpar.core.config import ModelConfig


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
    """[heads, n_blocks, K] int32: the key blocks query block i of head h computes in the pair (w, r) (w as
    configured, not cut to the sequence): slot 0 its own block, then its drawn past blocks ascending, -1 in the
    slots it leaves unused. Read-only (cached)."""
    K = kept_count(sp.ratio, n_blocks)
    out = np.full((n_head, n_blocks, K), -1, np.int32)
    for h in range(n_head):
        for i in range(n_blocks):
            rng = np.random.Generator(np.random.PCG64([sp.seed, w, r, h, i]))
            past = rng.permutation(i)[:kept_count(sp.ratio, i + 1) - 1]
            out[h, i, :1 + len(past)] = [i, *sorted(past)]
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
