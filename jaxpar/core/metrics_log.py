"""metrics.jsonl (one JSON object per logged step, the source of truth) and the console progress line."""
from __future__ import annotations

import json
import math
import os
import sys


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
