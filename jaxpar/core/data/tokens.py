"""Token files: prepare text into a flat token file, read and check its metadata, the default corpus.

A prepared dataset is `NAME.bin` (little-endian uint16/uint32 tokens) plus `NAME.bin.json` (metadata).
The order in which training reads it is data_order.py; the command line is `python -m jaxpar.data`.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import signal
import sys
import sysconfig
import tempfile
from contextlib import nullcontext

import numpy as np
from tqdm import tqdm

from jaxpar.core.config.schema import DataConfig
from jaxpar.core.data.corpus import collect, documents, read_bytes, records
from jaxpar.core.errors import UserError
from jaxpar.core.data.packing import COUNTED, PackStats, SftFields, document, pack as pack_windows, sft_pieces

_STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idlelib"}
EOD_NAMES = ("<|endoftext|>", "</s>", "<eos>")  # a tokenizer.json's end-of-document token, the first it has
_WORKER: dict = {}  # a prepare worker process's encoder (multiprocessing initializer)


def _hf_tokenizer(path: str):
    if not os.path.isfile(path):
        raise UserError(f"tokenizer must be 'byte' or a Hugging Face tokenizers JSON file; not found: {path}")
    try:
        from tokenizers import Tokenizer  # deferred: tokenizers, optional (the data extra): tokenizer.json files only
    except ImportError:
        raise UserError(f"tokenizer {path} needs the 'tokenizers' package (pip install tokenizers)") from None
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # the library raises its own exception types for malformed files
        raise UserError(f"cannot load tokenizer {path}: {(str(e) or repr(e)).splitlines()[0]}") from None


def _tokenizer(tokenizer: str):
    """Returns (encode: bytes -> int array, vocab_size, name stored in the sidecar)."""
    if tokenizer == "byte":
        return (lambda b: np.frombuffer(b, dtype=np.uint8)), 256, "byte"
    tok = _hf_tokenizer(tokenizer)
    # errors="replace": a stray non-UTF-8 file should not abort preparing a whole corpus.
    encode = lambda b: np.asarray(tok.encode(b.decode("utf-8", "replace"), add_special_tokens=False).ids)
    return encode, tok.get_vocab_size(), os.path.abspath(tokenizer)


def eod_token(tokenizer: str) -> int:
    """The token between documents: byte 0 (NUL, which text does not contain) for the byte-level tokenizer."""
    if tokenizer == "byte":
        return 0
    tok = _hf_tokenizer(tokenizer)
    for name in EOD_NAMES:
        if tok.token_to_id(name) is not None:
            return tok.token_to_id(name)
    raise UserError(f"tokenizer {tokenizer} has no end-of-document token ({' or '.join(EOD_NAMES)})")


def document_token(cfg) -> int | None:
    """The token that starts a document when attention stays within documents (data.document_mask), else None."""
    return eod_token(cfg.data.tokenizer) if cfg.data.document_mask else None


def _start_worker(tokenizer: str) -> None:
    # A pool stops its workers with SIGTERM; one inherited as ignored (a parent that ignores it, e.g. a finished
    # run's ignore_stop_requests) would keep a worker alive and the pool waiting for it forever.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _WORKER["encode"] = _tokenizer(tokenizer)[0]


def _encode_pieces(encode, doc):
    where, pieces = doc
    return where, [(encode(text), counted) for text, counted in pieces]


def _encode_in_worker(doc):
    return _encode_pieces(_WORKER["encode"], doc)


def _encoded(docs, tokenizer: str, encode, workers: int):
    """(where, [(tokens, counted)]) of each (where, [(bytes, counted)]) document, in order.

    In this process with `encode` for bytes (a copy), else in `workers` processes.
    """
    if tokenizer == "byte" or workers <= 1:
        yield from (_encode_pieces(encode, doc) for doc in docs)
        return

    pool = multiprocessing.get_context("spawn").Pool(workers, _start_worker, (tokenizer,))
    try:
        yield from pool.imap(_encode_in_worker, docs, chunksize=16)
        pool.close()  # every document encoded: the workers end on their own
    except BaseException:  # an error, or the reader stopped early: stop the workers
        pool.terminate()
        raise
    finally:
        pool.join()


def text_codec(tokenizer: str):
    """(encode: str -> list of ids, decode: ids -> str) of 'byte' or a tokenizer.json, for prompts and samples."""
    if tokenizer == "byte":
        return (
            (lambda text: list(text.encode("utf-8"))),
            (lambda ids: bytes(i for i in ids if i < 256).decode("utf-8", "replace")),
        )
    tok = _hf_tokenizer(tokenizer)
    return (lambda text: tok.encode(text, add_special_tokens=False).ids), tok.decode


def _temp_for(path: str, tmps: list, mode: str):
    # In the same directory as `path`, so os.replace is an atomic rename within one filesystem.
    fd, tmp = tempfile.mkstemp(
        dir=os.path.dirname(os.path.abspath(path)), prefix=f".{os.path.basename(path)}.", suffix=".tmp"
    )
    tmps.append(tmp)
    return os.fdopen(fd, mode)


def _write_dataset(
    out: str, chunks, vocab_size: int, tokenizer: str, eod: int | None = None, masked: bool = False, extra=dict
) -> str:
    """Streams token chunks (`masked`: (tokens, loss mask) pairs) to temp files, then renames.

    The sidecar goes last, marking a complete dataset; `extra()` adds to it once the chunks are written.

    An interrupted write leaves the old dataset; concurrent writers each rename their own complete file.
    """
    dtype = np.dtype("<u2") if vocab_size <= 65536 else np.dtype("<u4")
    tmps: list[str] = []
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        n_tok = n_doc = n_counted = 0
        with _temp_for(out, tmps, "wb") as f, _temp_for(out + ".mask", tmps, "wb") if masked else nullcontext() as m:
            for chunk in chunks:
                toks = np.asarray(chunk[0] if masked else chunk)
                if toks.size and (toks.min() < 0 or toks.max() >= vocab_size):
                    raise UserError(f"token ids out of range for vocab_size={vocab_size} while writing {out}")
                f.write(toks.astype(dtype).tobytes())
                if masked:
                    m.write(np.asarray(chunk[1], np.uint8).tobytes())
                    n_counted += int(np.count_nonzero(np.asarray(chunk[1]) == COUNTED))
                n_tok, n_doc = n_tok + toks.size, n_doc + 1
        meta = {
            "dtype": dtype.name,
            "vocab_size": int(vocab_size),
            "num_tokens": int(n_tok),
            "tokenizer": tokenizer,
            "num_documents": n_doc,
            **({} if eod is None else {"eod_token": eod}),
            **({"loss_mask": True, "counted_tokens": n_counted} if masked else {}),
            **extra(),
        }
        with _temp_for(out + ".json", tmps, "w") as f:
            json.dump(meta, f, indent=2)
        for tmp, dst in zip(tmps, (out,) + ((out + ".mask",) if masked else ()) + (out + ".json",)):
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


def _documents(files: list[str], text_field: str, sft: SftFields | None):
    """(where, [(bytes, counted)]) of each document: a text document is one counted piece; sft: packing.py."""
    if sft is None:
        for i, doc in enumerate(documents(files, text_field), 1):
            yield f"document {i}", [(doc, True)]
    else:
        for where, record in records(files, sft.columns):
            yield where, [(text.encode("utf-8"), counted) for text, counted in sft_pieces(where, record, sft)]


def prepare(
    inputs: list[str],
    out: str,
    tokenizer: str = "byte",
    text_field: str = "text",
    workers: int = 1,
    sft: SftFields | None = None,
    pack: int = 0,
    too_long: str = "refuse",
) -> str:
    """Tokenizes a corpus into the dataset `out` + `out.json`.

    The corpus is read with corpus.py (text files, JSON lines, Parquet; directories walked); the end-of-document token
    goes between documents; a progress bar shows on a terminal. `sft`: prompt/response records, with a loss mask
    (`out.mask`); `pack`: whole documents packed into windows of pack + 1 tokens (packing.py), with the padding masked
    out of the loss.
    """
    files = collect(inputs)
    encode, vocab_size, name = _tokenizer(tokenizer)
    eod = eod_token(tokenizer)
    sizes = None if any(f.endswith(".parquet") for f in files) else sum(os.path.getsize(f) for f in files)
    bar = tqdm(
        total=sizes,
        unit="B",
        unit_scale=True,
        desc=f"tokenizing {os.path.basename(out)}",
        disable=None,
        file=sys.stderr,
    )

    def read():
        for where, pieces in _documents(files, text_field, sft):
            bar.update(sum(len(text) for text, _ in pieces))
            yield where, pieces

    def encoded():
        n_tok = 0
        for where, pieces in _encoded(read(), tokenizer, encode, workers):
            n_tok += sum(len(t) for t, _ in pieces)
            bar.set_postfix_str(f"{n_tok / max(bar.format_dict['elapsed'], 1e-9):,.0f} tok/s", refresh=False)
            yield where, pieces

    try:
        if sft is None and not pack:  # a token stream: the end-of-document token before every document but the first
            chunks = (np.concatenate([[eod], p[0][0]]) if i else p[0][0] for i, (_, p) in enumerate(encoded()))
            return _write_dataset(out, chunks, vocab_size, name, eod=eod)
        docs = ((where, *document(pieces, eod)) for where, pieces in encoded())
        if not pack:
            return _write_dataset(out, ((t, m) for _, t, m in docs), vocab_size, name, eod=eod, masked=True)
        stats = PackStats()
        return _write_dataset(
            out,
            pack_windows(docs, pack + 1, eod, too_long, stats),
            vocab_size,
            name,
            eod=eod,
            masked=True,
            extra=lambda: {
                "window": pack + 1,
                "num_documents": stats.num_documents,
                "padding_tokens": stats.padding,
                "split_documents": stats.split,
                "dropped_documents": stats.dropped,
            },
        )
    finally:
        bar.close()


def write_tokens(out: str, tokens, vocab_size: int, tokenizer: str = "synthetic", eod: int | None = None) -> str:
    """Writes an already tokenized array as a dataset (tests, synthetic data, other converters).

    `eod`: the token that starts each document, if the data has one.
    """
    return _write_dataset(out, [np.asarray(tokens)], vocab_size, tokenizer, eod=eod)


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
        raise UserError(
            f"dataset sidecar {side} is invalid (dtype={meta['dtype']}, num_tokens={n}, vocab_size={vocab})"
        )
    size = os.path.getsize(path)
    if size != n * dtype.itemsize:  # e.g. a .bin truncated by a copy, or paired with another sidecar
        raise UserError(f"dataset {path} has {size} bytes but its sidecar says {n} {dtype.name} tokens")
    if meta.get("loss_mask") and (not os.path.isfile(path + ".mask") or os.path.getsize(path + ".mask") != n):
        raise UserError(
            f"dataset {path} needs its loss mask {path}.mask of {n} bytes (missing or another size); "
            "re-create it with python -m jaxpar.data prepare"
        )
    window = meta.get("window", 1)
    if not isinstance(window, int) or window < 1 or n % window:
        raise UserError(f"dataset sidecar {side} is invalid (window={window} does not tile {n} tokens)")
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
        digest = hashlib.sha256(read_bytes(cfg.tokenizer)).hexdigest()[:10]
        tok_name = f"{os.path.splitext(os.path.basename(cfg.tokenizer))[0]}-{digest}"
    cache = cfg.cache_dir or os.environ.get("JAXPAR_CACHE") or os.path.expanduser("~/.cache/jaxpar")
    # "-eod": documents separated by the end-of-document token (earlier caches used a newline)
    path = os.path.join(cache, f"stdlib-py{sys.version_info.major}.{sys.version_info.minor}-{tok_name}-eod.bin")
    try:
        read_meta(path)
        return path
    except UserError:
        pass  # missing or damaged cache: (re)build it
    files = stdlib_files()
    print(f"preparing dataset {path} from {len(files)} stdlib files (first use)", file=sys.stderr, flush=True)
    return prepare(files, path, cfg.tokenizer)


def split_range(num_tokens: int, val_fraction: float, split: str, window: int = 1) -> tuple[int, int]:
    """Token range [lo, hi) of a split of the token file.

    Validation is the last `val_fraction` of the file, in whole windows of a packed dataset (`window` tokens each).
    """
    n_val = int(num_tokens // window * val_fraction) * window
    return (0, num_tokens - n_val) if split == "train" else (num_tokens - n_val, num_tokens)
