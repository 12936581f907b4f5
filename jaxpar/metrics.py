"""metrics.jsonl, the console progress line, model FLOPs and MFU."""
from __future__ import annotations

import json
import math
import os
import sys

from jaxpar.config import ModelConfig
from jaxpar.models.gpt import count_params

# Dense datasheet peaks (FLOP/s per device); float32 matmuls run as TF32 on these GPUs by default.
PEAK_FLOPS = {
    ("H100", "bfloat16"): 989e12, ("H100", "float32"): 494.5e12,
    ("H200", "bfloat16"): 989e12, ("H200", "float32"): 494.5e12,
    ("A100", "bfloat16"): 312e12, ("A100", "float32"): 156e12,
}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 * (non-embedding params + tied head) + attention 12*L*T*d."""
    n = count_params(cfg)["non_embedding"] + cfg.vocab_size * cfg.d_model
    return 6 * n + 12 * cfg.n_layer * seq_len * cfg.d_model


def peak_flops(device_kind: str, dtype: str) -> float | None:
    for (kind, dt), peak in PEAK_FLOPS.items():
        if kind in device_kind and dt == dtype:
            return peak
    return None  # unknown (e.g. CPU): MFU is reported as null


def device_memory_gib(device) -> float | None:
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    return stats["peak_bytes_in_use"] / 2**30


class MetricsLog:
    """Appends one JSON object per logged step; prints progress on process 0 only."""

    def __init__(self, run_dir: str, is_main: bool, total_steps: int):
        self.is_main, self.total = is_main, total_steps
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.file = open(self.path, "a") if is_main else None

    def log(self, record: dict) -> None:
        if not self.is_main:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self.file.write(json.dumps(clean) + "\n")
        self.file.flush()
        parts = [f"step {record['step']:>{len(str(self.total))}}/{self.total}"]
        for key, fmt in (("loss", "loss {:.4f}"), ("eval_loss", "eval {:.4f}"), ("lr", "lr {:.2e}"),
                         ("grad_norm", "gnorm {:.3f}"), ("tokens_per_sec", "{:,.0f} tok/s"),
                         ("mfu", "mfu {:.1%}"), ("memory_gib", "mem {:.2f} GiB")):
            if record.get(key) is not None:
                parts.append(fmt.format(record[key]))
        print(" | ".join(parts), file=sys.stdout, flush=True)

    def close(self) -> None:
        if self.file:
            self.file.close()
