"""data.batching=buckets (jaxpar/core/data/buckets.py).

Whole documents grouped by length, each target read once, the order a function of (data, seed, step), the padding
skipped, and one line for buckets that cannot run.
"""

import numpy as np
import pytest

from jaxpar.core.data.batch_shapes import bucket_shapes
from jaxpar.core.data.buckets import BucketBatches, spans
from jaxpar.core.config.schema import load_config
from jaxpar.core.data.order import Samples, unmasked
from jaxpar.core.errors import UserError
from jaxpar.core.data.tokens import write_tokens
from tests.helpers import TINY, make_dataset


def lognormal_documents(path, n: int, median: int, seed: int = 0) -> np.ndarray:
    """n documents of log-normal lengths (sigma 1) around `median`, each after an end-of-document token (0)."""
    rng = np.random.default_rng(seed)
    lengths = np.maximum(rng.lognormal(np.log(median), 1.0, n).astype(int), 1)
    tokens = np.concatenate([np.r_[0, rng.integers(1, 256, k)] for k in lengths])
    write_tokens(str(path), tokens, 256, eod=0)
    return lengths


def test_each_target_of_the_split_is_read_once():
    tokens = np.array([5, 6, 0, 7, 0, 0, 8, 9, 1, 2, 3, 4, 0, 1])  # a long document cut in pieces of 3 targets
    got = spans(tokens, 0, 0, len(tokens), longest=3).tolist()
    assert got == [[0, 3], [2, 5], [4, 6], [5, 9], [8, 12], [11, 13], [12, 14]]
    targets = np.concatenate([np.arange(a + 1, b) for a, b in got])
    assert sorted(targets) == list(range(1, len(tokens)))  # every position predicted once


def batches(path, *overrides, seq_len=32):
    cfg = load_config(
        None, [*TINY, f"data.seq_len={seq_len}", f"model.max_seq_len={seq_len}", "data.batching=buckets", *overrides]
    )
    return BucketBatches(Samples(str(path), seq_len, 0, val_fraction=cfg.data.val_fraction), bucket_shapes(cfg)), cfg


def test_batches_hold_whole_documents_of_their_bucket(tmp_path):
    data, _ = batches(make_dataset(tmp_path / "d.bin", n_tokens=6000, document_length=12), "train.tokens_per_batch=256")
    assert data.lengths == [4, 8, 16, 32] and data.rows_of == [64, 32, 16, 8]
    seen, epoch_end = set(), data.ends(0)
    for step in range(epoch_end):
        b, ids = data.at(step)
        rows = data.global_batch(step)
        assert rows.shape == (data.rows_of[b], data.lengths[b] + 1) and not seen & set(ids)
        seen |= set(ids)
        for row, k in zip(rows, ids):
            (a, e), n = data.spans[k], np.diff(data.spans[k])[0]
            smaller = data.lengths[b - 1] if b else 0
            assert smaller < n - 1 <= data.lengths[b]  # the smallest bucket that holds its targets
            assert (unmasked(row[:n]) == data.samples._mm[a:e]).all() and (row[n:] == ~0).all()  # padding skipped
    assert data.padding(0) == sum(data.lengths[data.at(0)[0]] + 1 - np.diff(data.spans[k])[0] for k in data.at(0)[1])
    again, _ = batches(tmp_path / "d.bin", "train.tokens_per_batch=256")  # the order: (data, seed, step) only
    for step in (0, 5, epoch_end, epoch_end + 3):
        assert (again.global_batch(step) == data.global_batch(step)).all()
    assert {tuple(data.at(epoch_end + s)[1]) for s in range(3)} != {tuple(data.at(s)[1]) for s in range(3)}


def test_buckets_waste_little_on_long_tailed_lengths(tmp_path):
    """Log-normal lengths with median 1/8 of the window: one document per fixed window pads most of it.

    Four buckets per octave pad under a tenth (docs/benchmarks/padding-share.md has the rows).
    """
    T = 256
    lengths = lognormal_documents(tmp_path / "ln.bin", 3000, T // 8)
    per_window = 1 - np.minimum(lengths + 2, T + 1).sum() / (len(lengths) * (T + 1))
    buckets = ",".join(str(round(T * 2 ** (-k / 4))) for k in range(21))
    data, _ = batches(tmp_path / "ln.bin", f"data.buckets={buckets}", f"train.tokens_per_batch={16 * T}", seq_len=T)
    steps = range(data.ends(0))
    share = sum(map(data.padding, steps)) / sum(r * w for r, w in map(data.shape, steps))
    assert per_window > 0.4 and share < 0.1, (per_window, share)


@pytest.mark.parametrize(
    "overrides,phrase",
    [
        (["data.buckets=8,64"], "every bucket must be between 1 and data.seq_len=32 tokens"),
        (["train.tokens_per_batch=16"], "train.tokens_per_batch=16 holds no row of the 32-token bucket"),
        (["train.batch_rampup=4,4,8"], "train.batch_rampup with data.batching=buckets"),
    ],
)
def test_buckets_that_cannot_run_get_one_line(overrides, phrase):
    with pytest.raises(UserError, match=phrase):
        load_config(None, [*TINY, "data.seq_len=32", "model.max_seq_len=32", "data.batching=buckets", *overrides])


def test_buckets_need_documents(tmp_path):
    with pytest.raises(UserError, match="needs its end-of-document token and no --pack"):
        batches(make_dataset(tmp_path / "plain.bin"))


def test_mfu_counts_each_buckets_attention_at_its_length(tmp_path):
    from jaxpar.core.model.flops import flops_per_token
    from jaxpar.core.run.hooks import Throughput

    data, cfg = batches(
        make_dataset(tmp_path / "d.bin", n_tokens=6000, document_length=12), "train.tokens_per_batch=256"
    )
    meter = Throughput(cfg, flops_per_token(cfg.model, 32), 1.0, data)
    meter.restart(0, 0.0)
    r = meter.record(6, 0.0)
    shapes = [data.shape(k) for k in range(6)]
    per_token = sum(n * (w - 1) * flops_per_token(cfg.model, w - 1) for n, w in shapes) / sum(
        n * (w - 1) for n, w in shapes
    )
    assert len({w for _, w in shapes}) > 1 and r["mfu"] / r["tokens_per_sec"] == pytest.approx(per_token, rel=1e-9)
    assert per_token < flops_per_token(cfg.model, 32)  # the full-length count would overstate it
