"""Tiny configs and a synthetic-but-learnable dataset shared by the tests."""
from __future__ import annotations

import numpy as np

from jaxpar.config import load_config
from jaxpar.data import write_tokens

TINY = ["model.n_layer=2", "model.n_head=4", "model.d_model=32", "model.max_seq_len=32", "data.seq_len=16",
        "train.global_batch_size=8", "train.steps=10", "optim.warmup_steps=3", "optim.lr=1e-2", "optim.min_lr=1e-3",
        "data.val_fraction=0.1", "train.eval_batches=2", "train.log_every=1", "train.matmul_precision=highest"]


def tiny_config(*overrides: str):
    return load_config(None, TINY + list(overrides))


def make_dataset(path, n_tokens: int = 40_000, seed: int = 0) -> str:
    """Random text with structure (a noisy repeating pattern) so losses move."""
    rng = np.random.default_rng(seed)
    base = np.tile(np.frombuffer(b"def f(x):\n    return x + 1\n", np.uint8), n_tokens // 27 + 1)[:n_tokens]
    noise = rng.integers(0, 256, n_tokens)
    tokens = np.where(rng.random(n_tokens) < 0.1, noise, base)
    return write_tokens(str(path), tokens, 256)
