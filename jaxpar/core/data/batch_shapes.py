"""The shapes of a run's training batches, from its config alone.

One shape without train.batch_rampup or buckets, a batch size per ramp step (rampup.py), a (rows, length) per bucket
(buckets.py). Each is checked against the layout before anything is traced, and jaxpar compiles its step once per shape.
"""

from __future__ import annotations

import dataclasses

from jaxpar.core.errors import UserError
from jaxpar.core.data.rampup import BatchSizes


def bucket_lengths(spec: str, seq_len: int) -> list[int]:
    """data.buckets "64,128,..." (targets per row, ascending, the last data.seq_len); empty: seq_len/8, /4, /2, 1."""
    if not spec:
        return sorted({max(seq_len // d, 1) for d in (8, 4, 2, 1)})
    try:
        lengths = sorted({int(x) for x in spec.split(",")})
    except ValueError:
        raise UserError(f"data.buckets={spec}: not a comma-separated list of lengths") from None
    if lengths[0] < 1 or lengths[-1] > seq_len:
        raise UserError(
            f"data.buckets={spec}: every bucket must be between 1 and data.seq_len={seq_len} tokens "
            "(a bucket larger than the window)"
        )
    return lengths if lengths[-1] == seq_len else lengths + [seq_len]


def bucket_shapes(cfg) -> list[tuple[int, int]]:
    """(rows, targets per row) of each bucket: train.tokens_per_batch // length rows, a multiple of train.microbatches.

    One line where the longest bucket gets no row.
    """
    t, d = cfg.train, cfg.data
    tokens, lengths = t.tokens_per_batch or t.global_batch_size * d.seq_len, bucket_lengths(d.buckets, d.seq_len)
    shapes = [(tokens // T // t.microbatches * t.microbatches, T) for T in lengths]
    if shapes[-1][0] < 1:
        raise UserError(
            f"train.tokens_per_batch={tokens} holds no row of the {lengths[-1]}-token bucket (with "
            f"train.microbatches={t.microbatches} it needs at least {lengths[-1] * t.microbatches})"
        )
    return shapes


def batch_shapes(cfg) -> list[tuple[int, int]]:
    """(rows, targets per row) of every training batch the run may take."""
    if cfg.data.batching == "buckets":
        return bucket_shapes(cfg)
    return [(size, cfg.data.seq_len) for size in BatchSizes.of(cfg).sizes]


def shape_config(cfg, rows: int, T: int):
    """The config of a run whose every batch is `rows` windows of T targets (a ramp's or a bucket's shape)."""
    return dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, global_batch_size=rows, batch_rampup="", tokens_per_batch=0),
        data=dataclasses.replace(cfg.data, seq_len=T, batching="windows", buckets=""),
    )


def for_each_shape(cfg, check) -> None:
    """check(cfg) at every batch shape (train.global_batch_size and data.seq_len in their place).

    One line naming the shape where a check fails.
    """
    t, d = cfg.train, cfg.data
    for rows, T in batch_shapes(cfg):
        try:
            check(shape_config(cfg, rows, T))
        except UserError as e:
            if (rows, T) == (t.global_batch_size, d.seq_len):
                raise
            what = "data.batching=buckets" if d.batching == "buckets" else f"train.batch_rampup={t.batch_rampup}"
            raise UserError(f"{what}, at a batch of {rows} x {T} tokens: {e}") from None
