"""Padding share of the ways to batch documents of long-tailed lengths (docs/benchmarks/padding-share.md).

  python benchmarks/padding_share.py [--documents 20000] [--seq-len 1024] [--sigma 1.0]

Log-normal document lengths, median seq_len / 8. Rows: one document per fixed window (padded to seq_len + 1),
packed windows (`prepare --pack`, best fit), and data.batching=buckets at 1, 2 and 4 buckets per octave (the
train split's batches of one epoch, at train.tokens_per_batch = 16 windows). Data only: no model runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxpar.core.data.buckets import BucketBatches  # noqa: E402
from jaxpar.core.config.schema import load_config  # noqa: E402
from jaxpar.core.data.batch_shapes import bucket_shapes  # noqa: E402
from jaxpar.core.data.order import Samples  # noqa: E402
from jaxpar.core.data.packing import PackStats, pack  # noqa: E402
from jaxpar.core.data.tokens import write_tokens  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--documents", type=int, default=20000)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--sigma", type=float, default=1.0)
    a = p.parse_args()
    T, rng = a.seq_len, np.random.default_rng(0)
    lengths = np.maximum(rng.lognormal(np.log(T / 8), a.sigma, a.documents).astype(int), 1)
    docs = [np.r_[0, rng.integers(1, 256, n)] for n in lengths]
    print("| batching | shapes | padding share |\n|---|---|---|")
    rows = np.minimum(lengths + 2, T + 1)  # a document with its end-of-document tokens, cut at a window
    print(f"| one document per window of {T + 1} | 1 | {1 - rows.sum() / (len(rows) * (T + 1)):.1%} |")
    stats = PackStats()
    list(
        pack(
            ((str(i), d[1:] if i == 0 else d, np.ones(len(d), np.uint8)) for i, d in enumerate(docs)),
            T + 1,
            0,
            "split",
            stats,
        )
    )
    print(f"| packed windows (`prepare --pack {T}`, best fit) | 1 | {stats.padding / (stats.windows * (T + 1)):.1%} |")
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tokens(os.path.join(tmp, "d.bin"), np.concatenate(docs), 256, eod=0)
        for per_octave in (1, 2, 4):
            buckets = ",".join(str(round(T * 2 ** (-k / per_octave))) for k in range(5 * per_octave + 1))
            cfg = load_config(
                None,
                [
                    f"data.seq_len={T}",
                    f"model.max_seq_len={T}",
                    "data.batching=buckets",
                    f"data.buckets={buckets}",
                    f"train.tokens_per_batch={16 * T}",
                ],
            )
            data = BucketBatches(Samples(path, T, 0, val_fraction=cfg.data.val_fraction), bucket_shapes(cfg))
            steps = range(data.ends(0))
            share = sum(map(data.padding, steps)) / sum(r * w for r, w in map(data.shape, steps))
            print(
                f"| buckets, {per_octave} per octave (`data.buckets={buckets}`) | {len(data.lengths)} | {share:.1%} |"
            )


if __name__ == "__main__":
    main()
