"""data.batching=buckets: batches of whole documents grouped by length, each about train.tokens_per_batch tokens.

The training split's documents (each from its end-of-document token to the next one, which it predicts; one
longer than data.seq_len targets cut into pieces of that many) go to the smallest bucket of data.buckets that
holds their targets; a batch of bucket T is tokens_per_batch // T rows of T + 1 tokens, padded at the tail with
end-of-document tokens that the loss skips (padding, as a packed window's). Short documents come many to a
batch, long ones few, and little of a batch is padding.

The order is a function of (data, seed, step), like the windows' (data_order.py): epoch e walks the documents
in the permutation keyed by seed + e (shuffled_index) and emits a bucket's batch whenever it has filled; what is
left in the buckets at an epoch's end is dropped. Step s is the s-th batch, on any mesh and in both frameworks,
so a resume is exact. jaxpar compiles its step once per bucket (at the bucket's first batch).
"""

from __future__ import annotations

import numpy as np

from jaxpar.core.errors import UserError
from jaxpar.core.data.packing import COUNTED, PADDING
from jaxpar.core.data.shuffle import shuffled_index


def spans(tokens: np.ndarray, eod: int, lo: int, hi: int, longest: int) -> np.ndarray:
    """Token ranges [n, 2] of the documents in [lo, hi), in pieces of at most `longest` targets.

    A range runs from a document's first token (its end-of-document token) to the next end-of-document token, included;
    a longer document is cut into pieces of at most `longest` targets, overlapping by one token.
    """
    chunk = 1 << 26  # the token file is scanned a chunk at a time, never read whole
    found = [c + np.flatnonzero(np.asarray(tokens[c : min(c + chunk, hi)]) == eod) for c in range(lo, hi, chunk)]
    starts = np.unique(np.concatenate([[lo], *found]))
    stops = np.r_[starts[1:] + 1, hi]
    out = []
    for a, b in zip(starts.tolist(), stops.tolist()):
        out += [(s, min(s + longest + 1, b)) for s in range(a, max(b - 1, a + 1), longest)]
    out = np.asarray(out, np.int64).reshape(-1, 2)
    return out[out[:, 1] - out[:, 0] >= 2]  # a lone token has nothing to predict


class BucketBatches:
    """The training batches of data.batching=buckets: step -> rows [n, T + 1] (the GlobalBatches interface)."""

    def __init__(self, samples, shapes: list[tuple[int, int]]):
        """`samples`: the split's data_order.Samples.

        `shapes`: (rows, targets per row) of each bucket (batch_shapes.bucket_shapes).
        """
        meta, self.samples = samples.meta, samples
        if "eod_token" not in meta or meta.get("window", 1) > 1:
            raise UserError(
                f"data.batching=buckets reads documents: dataset {samples.path} needs its end-of-document "
                "token and no --pack (prepare it with python -m jaxpar.data prepare, without --pack)"
            )
        self.rows_of, self.lengths = [r for r, _ in shapes], [T for _, T in shapes]
        self.eod, self.meta, self.vocab_size = meta["eod_token"], meta, samples.vocab_size
        self.seed, self.seq_len, self.masked = samples.seed, self.lengths[-1], True  # masked: padding is skipped
        hi = samples.offset + samples.num_windows * samples.width
        self.spans = spans(samples.tokens, self.eod, samples.offset, hi, self.seq_len)
        self.bucket = np.searchsorted(self.lengths, self.spans[:, 1] - self.spans[:, 0] - 1)
        self._ends, self._plans = [0], {}  # batches before each planned epoch; the last epochs' plans
        if not self.ends(0):
            raise UserError(
                f"dataset {samples.path}: its {len(self.spans)} documents fill no batch of any bucket "
                "(train.tokens_per_batch is too large for it)"
            )

    def plan(self, epoch: int) -> list[tuple[int, list[int]]]:
        """Epoch `epoch`'s batches: (bucket, span ids), in the order they fill (the last two epochs kept)."""
        if epoch in self._plans:
            return self._plans[epoch]
        n, waiting, out = len(self.spans), [[] for _ in self.lengths], []
        for j in range(n):
            k = shuffled_index(j, n, (self.seed % 2**32 + epoch) % 2**32)
            b = int(self.bucket[k])
            waiting[b].append(k)
            if len(waiting[b]) == self.rows_of[b]:
                out.append((b, waiting[b]))
                waiting[b] = []
        self._plans = {e: p for e, p in self._plans.items() if e == epoch - 1} | {epoch: out}
        return out

    def ends(self, epoch: int) -> int:
        """Batches in epochs 0 .. epoch."""
        while len(self._ends) <= epoch + 1:
            self._ends.append(self._ends[-1] + len(self.plan(len(self._ends) - 1)))
        return self._ends[epoch + 1]

    def at(self, step: int) -> tuple[int, list[int]]:
        epoch = 0
        while self.ends(epoch) <= step:
            epoch += 1
        return self.plan(epoch)[step - self._ends[epoch]]

    def batch_size(self, step: int) -> int:
        return len(self.at(step)[1])

    def shape(self, step: int) -> tuple[int, int]:
        b, ids = self.at(step)
        return len(ids), self.lengths[b] + 1

    def tokens(self, step: int) -> int:
        """Token positions the step computes (rows x targets per row), padding included."""
        rows, width = self.shape(step)
        return rows * (width - 1)

    def _row(self, span: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = span
        tokens = np.full(width, self.eod, np.int32)
        mask = np.full(width, PADDING, np.uint8)
        read, loss_mask = self.samples.span(a, b)
        tokens[: b - a] = read
        mask[: b - a] = COUNTED if loss_mask is None else loss_mask
        return tokens, mask

    def rows(self, step: int, start: int, stop: int) -> np.ndarray:
        """Rows start..stop-1 of the step's batch: int32 [stop - start, T + 1], a skipped target as ~token."""
        b, ids = self.at(step)
        out = np.empty((stop - start, self.lengths[b] + 1), np.int32)
        for j, k in enumerate(ids[start:stop]):
            tokens, mask = self._row(self.spans[k], out.shape[1])
            out[j] = np.where(mask == COUNTED, tokens, ~tokens)
        return out

    def global_batch(self, step: int) -> np.ndarray:
        return self.rows(step, 0, self.batch_size(step))

    def padding(self, step: int) -> int:
        b, ids = self.at(step)
        return sum(self.lengths[b] + 1 - int(np.diff(self.spans[k])[0]) for k in ids)
