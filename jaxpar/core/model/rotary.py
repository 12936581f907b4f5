"""Rotary scaling for long contexts (model.rope_scaling): YaRN's frequencies, as both frameworks' rope reads them.

YaRN (Peng et al. 2023) keeps the fast-turning rotary pairs as they were, divides the slow ones' frequencies by
model.rope_factor, and blends the pairs in between along a linear ramp, whose ends are the pairs that turn
model.rope_beta_fast and model.rope_beta_slow times over the original context (model.rope_original_max_seq_len);
cos and sin are multiplied by an attention factor (model.rope_attention_factor, by default 0.1 ln(factor) + 1).
Hugging Face's `rope_type: yarn` computes the same, so converted weights keep their positions. DeepSeek-V3's YaRN
also scales multi-head latent attention's scores (model.rope_mscale_all_dim: `score_scale`). Pure numpy: a tuple of
floats, which the models keep as static data.
"""

from __future__ import annotations

import math

import numpy as np

from jaxpar.core.config.schema import ModelConfig


def yarn(m: ModelConfig, width: int) -> tuple[tuple[float, ...], float] | None:
    """(inverse frequencies of the width / 2 rotary pairs, the cos/sin factor) under YaRN; None without scaling."""
    if m.rope_scaling != "yarn":
        return None
    base, factor = m.rope_theta, m.rope_factor
    original = m.rope_original_max_seq_len or m.max_seq_len
    # pair i turns original / (2 pi base^(2i / width)) times over the original context: the pair that turns r times
    pair = lambda turns: width * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))
    low, high = pair(m.rope_beta_fast), pair(m.rope_beta_slow)
    if m.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, width - 1)
    high = high + 0.001 if low == high else high
    ramp = np.clip((np.arange(width // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: the pair keeps its frequency (extrapolation), 0: divided by the factor (interpolation)
    freqs = np.float32(base) ** (np.arange(0, width, 2, dtype=np.float32) / np.float32(width))
    inv_freq = (1.0 / (factor * freqs)) * (1 - keep) + (1.0 / freqs) * keep
    scale = m.rope_attention_factor or mscale(factor)
    return tuple(float(f) for f in inv_freq.astype(np.float32)), float(scale)


def mscale(factor: float, m: float = 1.0) -> float:
    """YaRN's magnitude correction for a context `factor` times longer: 0.1 m ln(factor) + 1, 1 up to a factor of 1."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def score_scale(m: ModelConfig) -> float:
    """What multiplies the attention scores under DeepSeek-V3's YaRN: mscale(factor, mscale_all_dim)^2, else 1."""
    if m.rope_scaling != "yarn" or not m.rope_mscale_all_dim:
        return 1.0
    return mscale(m.rope_factor, m.rope_mscale_all_dim) ** 2
