"""The data order, defined once: the global batch at step s is a function of (dataset, seed, s) only.

Samples of a split are the windows of seq_len + 1 tokens that tile it. Sample i of the training split
is window P_e(i mod N), with e = i div N and P_e a pseudo-random permutation of range(N) keyed by
seed + e: every epoch sees each window once, in a fresh order. P_e is computed per index (a small
block cipher with cycle walking, the one grain's MapDataset.shuffle uses, so the order is the one
jaxpar has always read), and nothing of size N is ever materialised, however large the corpus.
The validation split is read in natural order, repeated. The global batch at step s is samples
s*B .. s*B + B - 1, so any process can read just its own rows, and the data seen is the same for any
mesh, process count or framework. Python and numpy only: jaxpar serves these samples through grain,
torchpar reads them straight from the memory-mapped file.
"""

from __future__ import annotations

import numpy as np

from jaxpar.core.data.batch_shapes import bucket_shapes
from jaxpar.core.data.buckets import BucketBatches
from jaxpar.core.config.schema import Config
from jaxpar.core.errors import UserError
from jaxpar.core.data.packing import COUNTED, PADDING
from jaxpar.core.data.rampup import BatchSizes
from jaxpar.core.data.shuffle import shuffled_index
from jaxpar.core.data.tokens import read_meta, resolve_dataset, split_range


class Samples:
    """Random access to sample i (any i >= 0) of a split, in the shared order: int32 [seq_len + 1]."""

    def __init__(self, path: str, seq_len: int, seed: int, split: str = "train", val_fraction: float = 0.01):
        if split not in ("train", "val"):
            raise UserError(f"split must be 'train' or 'val', got {split!r}")
        if not 0.0 <= val_fraction < 1.0:
            raise UserError(f"val_fraction must be in [0, 1), got {val_fraction}")
        self.path, self.meta, self.seed, self.split = path, read_meta(path), seed, split
        self.vocab_size, self.num_tokens = self.meta["vocab_size"], self.meta["num_tokens"]
        self.width = seq_len + 1  # inputs row[:-1], targets row[1:]
        window = self.meta.get("window", 1)  # a packed dataset's (jaxpar/core/data/packing.py)
        if window not in (1, self.width):
            raise UserError(
                f"dataset {path} is packed into windows of {window} tokens: it needs "
                f"data.seq_len={window - 1}, not {seq_len}"
            )
        self.offset, hi = split_range(self.num_tokens, val_fraction, split, window)
        if hi - self.offset < self.width:
            raise UserError(
                f"{split} split of dataset {path} has {hi - self.offset} tokens (of {self.num_tokens}, "
                f"val_fraction={val_fraction}); one window of seq_len+1 needs {self.width}"
            )
        self.num_windows = (hi - self.offset) // self.width
        self._mm = self._mask = None

    def window(self, i: int) -> int:
        """Which window sample i reads."""
        epoch, j = divmod(int(i), self.num_windows)
        if self.split == "val":
            return j
        return shuffled_index(j, self.num_windows, (self.seed % 2**32 + epoch) % 2**32)  # a new order each epoch

    def __getitem__(self, i: int) -> np.ndarray:
        """Sample i, with the tokens the loss skips as targets negated.

        Where the dataset has a loss mask, a token the loss skips as a target reads as ~token (negative: loss.py and
        torchpar's loss skip it, `unmasked` gives the token back).
        """
        start = self.offset + self.window(i) * self.width
        row, mask = self.span(start, start + self.width)
        return row if mask is None else np.where(mask == COUNTED, row, ~row)

    def span(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Tokens [start, stop) of the file (int32) and their loss mask (None without one)."""
        self._open()
        tokens = np.asarray(self._mm[start:stop], dtype=np.int32)
        return tokens, (None if self._mask is None else np.asarray(self._mask[start:stop]))

    @property
    def tokens(self) -> np.ndarray:
        """The whole token file, memory-mapped."""
        self._open()
        return self._mm

    def _open(self) -> None:
        if self._mm is None:  # opened lazily, and dropped when pickled: worker processes map the file themselves
            dtype = np.dtype(self.meta["dtype"]).newbyteorder("<")
            self._mm = np.memmap(self.path, dtype=dtype, mode="r", shape=(self.num_tokens,))
            if self.meta.get("loss_mask"):
                self._mask = np.memmap(self.path + ".mask", dtype=np.uint8, mode="r", shape=(self.num_tokens,))

    def padding(self, i: int) -> int:
        """Padding tokens in sample i (a packed window's tail; 0 without a loss mask)."""
        start = self.offset + self.window(i) * self.width
        mask = self.span(start, start + self.width)[1]
        return 0 if mask is None else int(np.count_nonzero(mask == PADDING))

    def __getstate__(self):
        return {**self.__dict__, "_mm": None, "_mask": None}


def unmasked(rows):
    """The token ids of rows read from a dataset with a loss mask (Samples): ~t gives t back, and t stays.

    Operators only, so numpy, torch and jax arrays alike (an arithmetic shift: -1 where negative, else 0).
    """
    return rows ^ (rows >> 31)


class GlobalBatches:
    """Rows of the global batch at a step.

    `read(i)` returns sample i (the Samples themselves, or a framework's loader over them). `sizes`: the batch size
    of each step (train.batch_rampup; rampup.py), else global_batch_size at every step.
    """

    def __init__(self, samples: Samples, global_batch_size: int, read=None, sizes: BatchSizes | None = None):
        self.samples, self.global_batch_size = samples, global_batch_size
        self.sizes = sizes or BatchSizes(global_batch_size)
        self.read = read or samples.__getitem__
        self.seq_len, self.vocab_size, self.num_windows = samples.width - 1, samples.vocab_size, samples.num_windows
        self.num_tokens, self.meta = samples.num_tokens, samples.meta
        self.masked = bool(self.meta.get("loss_mask"))  # some targets are skipped (the loss's token_share)

    def batch_size(self, step: int) -> int:
        return self.sizes.size(step)

    def shape(self, step: int) -> tuple[int, int]:
        return self.batch_size(step), self.seq_len + 1

    def tokens(self, step: int) -> int:
        """Token positions the step computes (rows x targets per row), padding included."""
        return self.batch_size(step) * self.seq_len

    def rows(self, step: int, start: int, stop: int) -> np.ndarray:
        """Rows start..stop-1 of the global batch at `step`: int32 [stop-start, seq_len+1]."""
        if step < 0:
            raise UserError(f"data step must be >= 0, got {step}")
        B, first = self.batch_size(step), self.sizes.first(step)
        if not 0 <= start <= stop <= B:
            raise UserError(
                f"batch rows [{start}, {stop}) out of range for the step's batch of {B} "
                f"(train.global_batch_size={self.global_batch_size})"
            )
        out = np.empty((stop - start, self.seq_len + 1), dtype=np.int32)
        for j, i in enumerate(range(start, stop)):
            out[j] = self.read(first + i)
        return out

    def global_batch(self, step: int) -> np.ndarray:
        return self.rows(step, 0, self.batch_size(step))

    def padding(self, step: int) -> int:
        """Padding tokens in the global batch at `step` (read from the mask file, not through `read`)."""
        if not self.masked:
            return 0
        first = self.sizes.first(step)
        return sum(self.samples.padding(first + i) for i in range(self.batch_size(step)))


def open_splits(cfg: Config, batches=GlobalBatches) -> tuple[GlobalBatches, GlobalBatches]:
    """(train, val) global batches of the configured dataset (the default corpus is prepared on first use).

    A validation batch is one microbatch of windows. `batches(samples, global_batch_size, sizes=None)` builds each
    but data.batching=buckets' training batches (buckets.py).
    """
    t, d = cfg.train, cfg.data
    dataset = resolve_dataset(d)
    samples = Samples(dataset, d.seq_len, t.seed, "train", d.val_fraction)
    if d.batching == "buckets":  # whole documents, grouped by length (read straight from the memmap)
        train = BucketBatches(samples, bucket_shapes(cfg))
    else:
        train = batches(samples, t.global_batch_size, sizes=BatchSizes.of(cfg))
    if train.vocab_size > cfg.model.vocab_size:
        raise UserError(f"dataset {dataset} has vocab {train.vocab_size} > model.vocab_size={cfg.model.vocab_size}")
    val = batches(Samples(dataset, d.seq_len, t.seed, "val", d.val_fraction), t.global_batch_size // t.microbatches)
    return train, val
