"""8-bit AdamW's shared rules (optim.name=adamw8bit), written once for jaxpar/optim.py.

torchpar steps torchao's AdamW8bit, which follows the same rules (tests/torchpar/test_adamw8bit.py holds the two to
them).

The algorithm (Dettmers et al., "8-bit Optimizers via Block-wise Quantization", arXiv 2110.02861), per parameter:
    m <- lerp(deq(M), g, 1 - beta1)          the moments held as 8-bit codes, read back in float32 each step
    v <- lerp(deq(V), g^2, 1 - beta2)
    M, V <- q(m), q(v)                       stored; this step's update uses the float32 m and v
    p <- p (1 - lr wd) - lr (m / bc1) / (sqrt(v) / sqrt(bc2) + eps)     bc = 1 - beta^step: AdamW
q: the moment in blocks of BLOCK consecutive elements (row-major, each framework's own layout of the tensor); a
block is divided by its largest magnitude (its scale, kept in float32) and each value rounded to the nearest entry
of the dynamic map (signed for m, unsigned for v): 8 bits of codes and 4 / BLOCK bytes of scale per element,
against AdamW's 8 bytes for the two moments in float32. A tensor under MIN_SIZE elements, or not a whole number of
blocks, keeps float32 moments (bitsandbytes' and torchao's rule; in jaxpar the size of one layer's tensor, as
torchpar's parameters are). Pure Python and numpy: no jax, no torch.
"""

from __future__ import annotations

import numpy as np

# elements per scale. torchao's default is 256; at 256 the first moment's codes cost quality at a high learning rate
# (gpt2-tiny d_model 256, lr 3e-3: +1.1% / +4.2% eval loss after 300 steps on two seeds, most of it m's rounding);
# at 64 within 1% of AdamW at every lr of the sweep (docs/benchmarks/optimizers.md), for 4 / 64 bytes of scale
BLOCK = 64
MIN_SIZE = 4096  # smaller tensors keep float32 moments


def quantized(numel: int) -> bool:
    """Whether a (per-layer) tensor of `numel` elements holds 8-bit moments."""
    return numel >= MIN_SIZE and numel % BLOCK == 0


def _linspace(n: int) -> np.ndarray:
    """torch.linspace(0.1, 1, n) in float32, computed as torch computes it.

    A float32 step, and from each end one rounding, so the map below is bit for bit torchao's.
    """
    step = float((np.float32(1) - np.float32(0.1)) / np.float32(n - 1))
    start = float(np.float32(0.1))
    return np.array([start + step * i if i < n // 2 else 1.0 - step * (n - 1 - i) for i in range(n)]).astype(np.float32)


def dynamic_map(signed: bool) -> np.ndarray:
    """The 256 sorted float32 values a code stands for.

    0, 1 and, for each power of ten from 1e-6 to 1, the midpoints of an even split of [0.1, 1] times it -- twice as
    many points at each larger power (the dynamic exponent of arXiv 1511.04561); signed: the same below zero, with
    half as many points per power.
    """
    values = [0.0, 1.0]
    for i in range(7):
        edges = _linspace((2**i if signed else 2 ** (i + 1)) + 1)
        level = ((edges[:-1] + edges[1:]) / np.float32(2) * np.float32(10.0 ** (i - 6))).tolist()
        values += level + ([-v for v in level] if signed else [])
    return np.sort(np.array(values, np.float32))
