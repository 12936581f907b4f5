"""The documents of a corpus, as bytes.

A text file is one document (.py, .txt, .md, or any file named explicitly), a JSON-lines file one per line (its
`text_field`), a Parquet file one per row (its `text_field` column, read with pyarrow). Directories are walked for those
suffixes in sorted order.
"""

from __future__ import annotations

import json
import os
from typing import Iterator

from jaxpar.core.errors import UserError
from jaxpar.core.data.packing import SftFields

TEXT_SUFFIXES = (".py", ".txt", ".md")
CORPUS_SUFFIXES = TEXT_SUFFIXES + (".jsonl", ".parquet")


def collect(inputs: list[str]) -> list[str]:
    """Explicit files are taken as given; directories contribute their corpus files in sorted order."""
    files = []
    for inp in inputs:
        if os.path.isdir(inp):
            found = [os.path.join(d, f) for d, _, fs in os.walk(inp) for f in fs if f.endswith(CORPUS_SUFFIXES)]
            files.extend(sorted(found))
        elif os.path.isfile(inp):
            files.append(inp)
        else:
            raise UserError(f"input not found: {inp}")
    if not files:
        raise UserError(f"no {'/'.join(CORPUS_SUFFIXES)} files found in {' '.join(inputs) or '(no inputs)'}")
    return files


def read_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}") from None


def _text(value, where: str, field: str) -> bytes:
    if not isinstance(value, str):
        raise UserError(f"{where}: field {field!r} is {type(value).__name__}, not text (--text-field names it)")
    return value.encode("utf-8")


def _sft_hint(fields) -> str:
    """Where a text record lacks its text but holds fine-tuning fields (packing.py's default names).

    The flag that reads them.
    """
    sft = SftFields()
    if sft.messages in fields:
        held = repr(sft.messages)
    elif sft.prompt in fields and sft.completion in fields:
        held = f"{sft.prompt!r}/{sft.completion!r}"
    else:
        return ""
    return f", but has {held}: fine-tuning records are read with --format sft"


def _jsonl(path: str) -> Iterator[tuple[str, dict]]:
    """(where, record) of each non-blank line: where is path:line, for messages."""
    try:
        with open(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:  # JSON text is UTF-8 (RFC 8259)
                    raise UserError(
                        f"{path}:{n}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                        "JSON lines must be UTF-8 text"
                    ) from None
                if line.strip():
                    try:
                        record = json.loads(line)
                    except ValueError as e:
                        raise UserError(f"{path}:{n}: not a JSON object ({e})") from None
                    if not isinstance(record, dict):
                        raise UserError(f"{path}:{n}: not a JSON object (a {type(record).__name__})")
                    yield f"{path}:{n}", record
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}") from None


def _parquet(path: str, wanted: tuple[str, ...]) -> Iterator[tuple[str, dict]]:
    """(where, row) of each row, with the columns of `wanted` the file has (where: path:row)."""
    try:
        import pyarrow.parquet as pq  # deferred: pyarrow, optional (the data extra): Parquet files only
    except ImportError:
        raise UserError(f"{path}: Parquet needs the pyarrow package (pip install pyarrow)") from None
    try:
        table = pq.ParquetFile(path)
        columns = [c for c in wanted if c in table.schema_arrow.names]
        if not columns:
            raise UserError(
                f"{path}: no column {' or '.join(map(repr, wanted))} "
                f"(columns: {', '.join(table.schema_arrow.names)}){_sft_hint(table.schema_arrow.names)}"
            )
        n = 0
        for batch in table.iter_batches(columns=columns):
            for row in batch.to_pylist():
                n += 1
                yield f"{path}:row {n}", row
    except (OSError, ValueError) as e:  # pyarrow's errors derive from these
        raise UserError(f"cannot read {path} as Parquet: {str(e).splitlines()[0]}") from None


def records(files: list[str], wanted: tuple[str, ...]) -> Iterator[tuple[str, dict]]:
    """(where, record) of every JSON line and Parquet row of `files` (their `wanted` columns for Parquet)."""
    for path in files:
        if path.endswith(".jsonl"):
            yield from _jsonl(path)
        elif path.endswith(".parquet"):
            yield from _parquet(path, wanted)
        else:
            raise UserError(f"{path}: prompt/response records come from .jsonl or .parquet files")


def documents(files: list[str], text_field: str = "text") -> Iterator[bytes]:
    for path in files:
        if path.endswith((".jsonl", ".parquet")):
            for where, record in records([path], (text_field,)):
                if text_field not in record:
                    raise UserError(f"{where}: no field {text_field!r} (--text-field names it){_sft_hint(record)}")
                yield _text(record[text_field], where, text_field)
        else:
            yield read_bytes(path)
