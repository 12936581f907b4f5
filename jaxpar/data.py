"""Token datasets: prepare text into a flat token file, then serve deterministic global batches.

No jax import on purpose: torchpar reads the same files with the same batch order.
A prepared dataset is `NAME.bin` (little-endian uint16/uint32 tokens) plus `NAME.bin.json` (metadata).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import sysconfig
import tempfile

import numpy as np

from jaxpar.config import DataConfig
from jaxpar.errors import UserError, cli

TEXT_SUFFIXES = (".py", ".txt", ".md")
_STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idlelib"}


def _collect(inputs: list[str]) -> list[str]:
    """Explicit files are taken as given; directories contribute their text files in sorted order."""
    files = []
    for inp in inputs:
        if os.path.isdir(inp):
            found = [os.path.join(d, f) for d, _, fs in os.walk(inp) for f in fs if f.endswith(TEXT_SUFFIXES)]
            files.extend(sorted(found))
        elif os.path.isfile(inp):
            files.append(inp)
        else:
            raise UserError(f"input not found: {inp}")
    if not files:
        raise UserError(f"no {'/'.join(TEXT_SUFFIXES)} files found in {' '.join(inputs) or '(no inputs)'}")
    return files


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _tokenizer(tokenizer: str):
    """Returns (encode: bytes -> int array, vocab_size, name stored in the sidecar)."""
    if tokenizer == "byte":
        return (lambda b: np.frombuffer(b, dtype=np.uint8)), 256, "byte"
    if not os.path.isfile(tokenizer):
        raise UserError(f"tokenizer must be 'byte' or a Hugging Face tokenizers JSON file; not found: {tokenizer}")
    try:
        from tokenizers import Tokenizer  # optional dependency, only needed for this branch
    except ImportError:
        raise UserError(f"tokenizer {tokenizer} needs the 'tokenizers' package (pip install tokenizers)") from None
    try:
        tok = Tokenizer.from_file(tokenizer)
    except Exception as e:  # the library raises its own exception types for malformed files
        raise UserError(f"cannot load tokenizer {tokenizer}: {(str(e) or repr(e)).splitlines()[0]}") from None
    # errors="replace": a stray non-UTF-8 file should not abort preparing a whole corpus.
    encode = lambda b: np.asarray(tok.encode(b.decode("utf-8", "replace"), add_special_tokens=False).ids)
    return encode, tok.get_vocab_size(), os.path.abspath(tokenizer)


def _temp_for(path: str, tmps: list, mode: str):
    # In the same directory as `path`, so os.replace is an atomic rename within one filesystem.
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=f".{os.path.basename(path)}.",
                               suffix=".tmp")
    tmps.append(tmp)
    return os.fdopen(fd, mode)


def _write_dataset(out: str, chunks, vocab_size: int, tokenizer: str) -> str:
    """Streams token chunks to a temp file, then renames; the sidecar goes last, marking a complete dataset.

    An interrupted write leaves the old dataset; concurrent writers each rename their own complete file.
    """
    dtype = np.dtype("<u2") if vocab_size <= 65536 else np.dtype("<u4")
    tmps: list[str] = []
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        n_tok = n_doc = 0
        with _temp_for(out, tmps, "wb") as f:
            for toks in chunks:
                toks = np.asarray(toks)
                if toks.size and (toks.min() < 0 or toks.max() >= vocab_size):
                    raise UserError(f"token ids out of range for vocab_size={vocab_size} while writing {out}")
                f.write(toks.astype(dtype).tobytes())
                n_tok, n_doc = n_tok + toks.size, n_doc + 1
        meta = {"dtype": dtype.name, "vocab_size": int(vocab_size), "num_tokens": int(n_tok),
                "tokenizer": tokenizer, "num_documents": n_doc}
        with _temp_for(out + ".json", tmps, "w") as f:
            json.dump(meta, f, indent=2)
        for tmp, dst in zip(tmps, (out, out + ".json")):
            os.chmod(tmp, 0o644)  # mkstemp creates 0600; datasets are often shared
            os.replace(tmp, dst)
    except BaseException as e:  # also KeyboardInterrupt: never leave temp files behind
        for tmp in tmps:
            if os.path.exists(tmp):
                os.unlink(tmp)
        if isinstance(e, OSError):
            raise UserError(f"cannot write dataset {out}: {e}") from None
        raise
    return out


def prepare(inputs: list[str], out: str, tokenizer: str = "byte") -> str:
    """Tokenizes text files (directories walked for *.py/*.txt/*.md) into `out` + `out.json`."""
    files = _collect(inputs)
    encode, vocab_size, name = _tokenizer(tokenizer)
    sep = encode(b"\n")

    def chunks():
        for i, path in enumerate(files):
            try:
                data = _read(path)
            except OSError as e:
                raise UserError(f"cannot read {path}: {e.strerror or e}") from None
            yield np.concatenate([sep, encode(data)]) if i else encode(data)

    return _write_dataset(out, chunks(), vocab_size, name)


def write_tokens(out: str, tokens, vocab_size: int, tokenizer: str = "synthetic") -> str:
    """Writes an already tokenized array as a dataset (tests, synthetic data, other converters)."""
    return _write_dataset(out, [np.asarray(tokens)], vocab_size, tokenizer)


def read_meta(path: str) -> dict:
    """The sidecar of a prepared dataset, checked against the token file; UserError naming the path."""
    if not os.path.isfile(path):
        raise UserError(f"dataset file not found: {path} (create one with: python -m jaxpar.data prepare)")
    side = path + ".json"
    if not os.path.isfile(side):
        raise UserError(f"dataset {path} has no sidecar {side}; re-create it with python -m jaxpar.data prepare")
    try:
        with open(side) as f:
            meta = json.load(f)
        dtype = np.dtype(meta["dtype"]).newbyteorder("<")
        n, vocab = int(meta["num_tokens"]), int(meta["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"dataset sidecar {side} is invalid ({type(e).__name__}: {e})") from None
    if dtype.name not in ("uint16", "uint32") or n < 0 or vocab < 1:
        raise UserError(f"dataset sidecar {side} is invalid (dtype={meta['dtype']}, num_tokens={n}, vocab_size={vocab})")
    size = os.path.getsize(path)
    if size != n * dtype.itemsize:  # e.g. a .bin truncated by a copy, or paired with another sidecar
        raise UserError(f"dataset {path} has {size} bytes but its sidecar says {n} {dtype.name} tokens")
    return {**meta, "dtype": dtype.name, "num_tokens": n, "vocab_size": vocab}


def stdlib_files() -> list[str]:
    """This Python's stdlib .py files, minus tests and IDLE to keep the corpus moderate (~10 MB)."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for d, dirs, fs in os.walk(root):
        dirs[:] = [x for x in dirs if x not in _STDLIB_SKIP]
        files.extend(os.path.join(d, f) for f in fs if f.endswith(".py"))
    return sorted(files)


def resolve_dataset(cfg: DataConfig) -> str:
    """Path of a prepared .bin: the named file, or the stdlib corpus prepared into the cache on first use."""
    if cfg.dataset != "stdlib":
        read_meta(cfg.dataset)
        return cfg.dataset
    tok_name = "byte"
    if cfg.tokenizer != "byte":  # a content hash, so editing the tokenizer file does not reuse a stale cache
        if not os.path.isfile(cfg.tokenizer):
            raise UserError(f"tokenizer file not found: {cfg.tokenizer}")
        digest = hashlib.sha256(_read(cfg.tokenizer)).hexdigest()[:10]
        tok_name = f"{os.path.splitext(os.path.basename(cfg.tokenizer))[0]}-{digest}"
    cache = cfg.cache_dir or os.environ.get("JAXPAR_CACHE") or os.path.expanduser("~/.cache/jaxpar")
    path = os.path.join(cache, f"stdlib-py{sys.version_info.major}.{sys.version_info.minor}-{tok_name}.bin")
    try:
        read_meta(path)
        return path
    except UserError:
        pass  # missing or damaged cache: (re)build it
    files = stdlib_files()
    print(f"preparing dataset {path} from {len(files)} stdlib files (first use)", file=sys.stderr, flush=True)
    return prepare(files, path, cfg.tokenizer)


def split_range(num_tokens: int, val_fraction: float, split: str) -> tuple[int, int]:
    """Token range [lo, hi) of a split: validation is the last `val_fraction` of the file."""
    n_val = int(num_tokens * val_fraction)
    return (0, num_tokens - n_val) if split == "train" else (num_tokens - n_val, num_tokens)


class _Windows:
    """Random-access source for grain: window i = tokens[offset + i*W : offset + (i+1)*W] as int32."""

    def __init__(self, path: str, meta: dict, offset: int, width: int, count: int):
        self.path, self.meta, self.offset, self.width, self.count, self._mm = path, meta, offset, width, count, None

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> np.ndarray:
        if self._mm is None:  # opened lazily, and dropped when pickled, so worker processes don't copy the data
            dtype = np.dtype(self.meta["dtype"]).newbyteorder("<")
            self._mm = np.memmap(self.path, dtype=dtype, mode="r", shape=(self.meta["num_tokens"],))
        start = self.offset + int(i) * self.width
        return np.asarray(self._mm[start:start + self.width], dtype=np.int32)

    def __getstate__(self):
        return {**self.__dict__, "_mm": None}


class TokenBatches:
    """Global batch at step s = rows s*B .. s*B+B-1 of a (shuffled, repeated) sequence of windows.

    Depends only on (data, seed, step): each process asks for its own row range of the same global batch,
    so the data seen is identical for any number of processes or devices.
    """

    def __init__(self, path: str, seq_len: int, global_batch_size: int, seed: int, split: str = "train",
                 val_fraction: float = 0.01):
        import grain  # here, not at module level: grain imports jax (~1 s), which prepare/info don't need

        if split not in ("train", "val"):
            raise UserError(f"split must be 'train' or 'val', got {split!r}")
        if not 0.0 <= val_fraction < 1.0:
            raise UserError(f"val_fraction must be in [0, 1), got {val_fraction}")
        self.meta = read_meta(path)
        self.seq_len, self.global_batch_size, self.split = seq_len, global_batch_size, split
        self.vocab_size, self.num_tokens = self.meta["vocab_size"], self.meta["num_tokens"]
        lo, hi = split_range(self.num_tokens, val_fraction, split)
        width = seq_len + 1  # inputs row[:-1], targets row[1:]
        if hi - lo < width:
            raise UserError(f"{split} split of dataset {path} has {hi - lo} tokens (of {self.num_tokens}, val_fraction="
                            f"{val_fraction}); one window of seq_len+1 needs {width}")
        self.num_windows = (hi - lo) // width
        ds = grain.MapDataset.source(_Windows(path, self.meta, lo, width, self.num_windows))
        if split == "train":
            # grain wants a seed in [0, 2**32); repeat() reshuffles each epoch, still a function of the seed.
            ds = ds.shuffle(seed=seed % 2**32)
        self._ds = ds.repeat()

    def rows(self, step: int, start: int, stop: int) -> np.ndarray:
        """Rows start..stop-1 of the global batch at `step`: int32 [stop-start, seq_len+1]."""
        B = self.global_batch_size
        if step < 0:
            raise UserError(f"data step must be >= 0, got {step}")
        if not 0 <= start <= stop <= B:
            raise UserError(f"batch rows [{start}, {stop}) out of range for global_batch_size={B}")
        base = step * B
        out = np.empty((stop - start, self.seq_len + 1), dtype=np.int32)
        for j, i in enumerate(range(start, stop)):
            out[j] = self._ds[base + i]
        return out

    def global_batch(self, step: int) -> np.ndarray:
        return self.rows(step, 0, self.global_batch_size)


@cli
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxpar.data", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare", help="tokenize files/directories (*.py, *.txt, *.md) into a .bin dataset")
    pp.add_argument("--out", required=True)
    pp.add_argument("--tokenizer", default="byte", help="'byte' or a Hugging Face tokenizers JSON file")
    pp.add_argument("inputs", nargs="+")
    pi = sub.add_parser("info", help="show a dataset's metadata and window counts")
    pi.add_argument("path")
    pi.add_argument("--seq-len", type=int, default=128)
    pi.add_argument("--val-fraction", type=float, default=0.01)
    args = p.parse_args(argv)
    if args.cmd == "prepare":
        meta = read_meta(prepare(args.inputs, args.out, args.tokenizer))
        print(f"wrote {args.out}: {meta['num_tokens']} tokens from {meta['num_documents']} documents")
    else:
        if args.seq_len < 1 or not 0 <= args.val_fraction < 1:
            raise UserError("need --seq-len >= 1 and 0 <= --val-fraction < 1")
        meta = read_meta(args.path)
        (a, b), (c, d) = (split_range(meta["num_tokens"], args.val_fraction, s) for s in ("train", "val"))
        print(json.dumps(meta, indent=2))
        w = args.seq_len + 1
        print(f"seq_len={args.seq_len}: {(b - a) // w} train windows, {(d - c) // w} val windows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
