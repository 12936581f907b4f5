"""How many chunks of positions the output head and its loss run in (model.loss_chunks): one rule for both
frameworks (jaxpar/models/head.py, torchpar/models/head.py), so that both sum the same positions together."""
from __future__ import annotations


def loss_chunks(model_cfg, seq_len: int) -> int:
    """model.loss_chunks lowered to the largest count that divides `seq_len` (each chunk holds seq_len / n positions
    of every row); 1: the whole logits at once."""
    return max(n for n in range(1, max(1, min(model_cfg.loss_chunks, seq_len)) + 1) if seq_len % n == 0)
