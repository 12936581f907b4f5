"""metrics.jsonl (one JSON object per logged step, the source of truth) and the console.

A live progress bar (tqdm: step, loss, tokens/s, MFU, ETA) when stdout is a terminal, one plain line per logged step
when it is not (CI, log files); evaluations are kept as lines in both.
"""

from __future__ import annotations

import json
import math
import os
import sys

from tqdm import tqdm

from jaxpar.core.data.tokens import text_codec


class MetricsLog:
    """Appends one JSON object per logged step; prints progress on process 0 only."""

    def __init__(
        self,
        run_dir: str,
        is_main: bool,
        total_steps: int,
        start_step: int = 0,
        trackers=(),
        tokenizer: str = "byte",
        outcome=None,
    ):
        """`outcome`: a run_summary.Outcome that gathers the numbers of the run's closing lines."""
        self.is_main, self.total, self.trackers = is_main, total_steps, list(trackers)  # core/run/trackers.py
        self.outcome = outcome
        self.tokenizer, self.decode = tokenizer, None  # the decoder is loaded at the first sample
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.file = open(self.path, "a") if is_main else None
        self.bar = None
        if is_main and sys.stdout.isatty():
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True, file=sys.stdout)

    def log(self, record: dict) -> None:
        if not self.is_main:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._gather(clean)
        self.file.write(json.dumps(clean) + "\n")
        self.file.flush()
        scalars = {k: v for k, v in clean.items() if k != "step" and isinstance(v, (int, float))}
        for tracker in self.trackers:
            tracker.log(record["step"], scalars)
        parts = [f"step {record['step']:>{len(str(self.total))}}/{self.total}"]
        for key, fmt in (
            ("loss", "loss {:.4f}"),
            ("eval_loss", "eval {:.4f}"),
            ("batch_size", "batch {}"),
            ("lr", "lr {:.2e}"),
            ("grad_norm", "gnorm {:.3f}"),
            ("loss_scale", "scale {:g}"),
            ("skipped_steps", "skipped {:.0f}"),
            ("tokens_per_sec", "{:,.0f} tok/s"),
            ("padding_share", "pad {:.0%}"),
            ("moe_balance", "balance {:.3f}"),
            ("moe_max_load", "max load {:.2f}"),
            ("moe_dropped", "dropped {:.1%}"),
            ("mfu", "mfu {:.1%}"),
            ("memory_in_use_gib", "mem {:.2f}"),
            ("memory_gib", "peak {:.2f} GiB"),
            ("data_wait_share", "data {:.0%}"),
            ("comm_share", "comm {:.0%}"),
        ):
            if record.get(key) is not None:
                parts.append(fmt.format(record[key]))
        if self.bar is None:
            print(" | ".join(parts), file=sys.stdout, flush=True)
            return
        self.bar.update(record["step"] - self.bar.n)
        self.bar.set_postfix_str(" | ".join(parts[1:]))
        if record.get("eval_loss") is not None:
            self.bar.write(" | ".join(parts))

    def _gather(self, record: dict) -> None:
        o = self.outcome
        if o is None:
            return
        o.loss = record.get("loss", o.loss)
        o.eval_loss = record.get("eval_loss") if record.get("eval_loss") is not None else o.eval_loss
        if record.get("tokens_per_sec") is not None:
            o.rates.append(record["tokens_per_sec"])
        if record.get("mfu") is not None:
            o.mfus.append(record["mfu"])

    def note(self, line: str) -> None:
        """One line on the console of process 0 (above the progress bar on a terminal)."""
        if self.is_main:
            print(line, flush=True) if self.bar is None else self.bar.write(line)

    def sample(self, step: int, tokens: list[int] | None) -> None:
        """A sampled continuation, printed as text (the run's tokenizer) on process 0."""
        if not self.is_main or tokens is None:
            return
        self.decode = self.decode or text_codec(self.tokenizer)[1]
        line = f"sample at step {step}: {self.decode(tokens)!r}"
        self.note(line)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        if self.bar is not None:
            self.bar.close()
        if self.file:
            self.file.close()
