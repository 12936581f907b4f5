"""Fine-tuning records and packed windows: the loss mask, whole documents and one-line refusals.

Covers jaxpar/core/data/packing.py and `python -m jaxpar.data prepare --format sft / --pack`: what the loss mask counts,
that packing keeps documents whole, and bad records in one line.
"""

import json

import numpy as np
import pytest

from jaxpar.core.data.order import Samples, unmasked
from jaxpar.core.errors import UserError
from jaxpar.data import main as data_main

PAIRS = [
    {"prompt": "What is 2+2?", "completion": " 4"},
    {"prompt": "Name a colour.", "completion": " Blue, like the sky."},
]
CHAT = {
    "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello there"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "goodbye"},
    ]
}


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def prepared(tmp_path, inputs, *args):
    out = tmp_path / "out.bin"
    assert data_main(["prepare", "--out", str(out), *args, *map(str, inputs)]) == 0
    meta = json.loads((tmp_path / "out.bin.json").read_text())
    tokens = np.fromfile(out, np.dtype(meta["dtype"]))
    mask = np.fromfile(str(out) + ".mask", np.uint8) if meta.get("loss_mask") else None
    return tokens, mask, meta


def test_the_loss_mask_counts_the_responses_and_their_ends(tmp_path):
    tokens, mask, meta = prepared(tmp_path, [write_jsonl(tmp_path / "a.jsonl", PAIRS + [CHAT])], "--format", "sft")
    # byte tokenizer: the counted bytes are each response and the end-of-document token (0) after it
    counted = b" 4\0" + b" Blue, like the sky.\0" + b"hello there\ngoodbye\n\0"
    skipped = b"What is 2+2?" + b"Name a colour." + b"user: hi\nassistant: user: bye\nassistant: "
    assert bytes(tokens[mask == 1].astype(np.uint8)) == counted
    assert bytes(tokens[mask == 0].astype(np.uint8)) == skipped
    assert meta["counted_tokens"] == len(counted) and meta["num_documents"] == 3


def test_parquet_records_read_as_json_lines_do(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(
        pa.table({"q": [r["prompt"] for r in PAIRS], "a": [r["completion"] for r in PAIRS]}), tmp_path / "a.parquet"
    )
    fields = ("--format", "sft", "--prompt-field", "q", "--completion-field", "a")
    got = prepared(tmp_path, [tmp_path / "a.parquet"], *fields)[:2]
    want = prepared(tmp_path, [write_jsonl(tmp_path / "a.jsonl", PAIRS)], "--format", "sft")[:2]
    assert all((g == w).all() for g, w in zip(got, want))


def test_packing_keeps_each_document_whole_in_one_window(tmp_path):
    lengths = [9, 5, 5, 9, 11, 3]  # with their end-of-document tokens 10, 6, 6, 10, 12, 4: three full windows of 16
    docs = [bytes([65 + i]) * n for i, n in enumerate(lengths)]
    for i, d in enumerate(docs):
        (tmp_path / f"d{i}.txt").write_bytes(d)
    tokens, mask, meta = prepared(tmp_path, [tmp_path / f"d{i}.txt" for i in range(6)], "--pack", "15")
    windows = tokens.reshape(-1, 16)
    assert len(windows) == 3 and meta["padding_tokens"] == 0 and mask.all()
    found = sorted(part for w in windows for part in bytes(w.astype(np.uint8)).split(b"\0") if part)
    assert found == sorted(docs)  # each document inside one window, none cut at a window's edge

    # an uneven set: the rest of each window is end-of-document tokens the loss skips
    tokens, mask, meta = prepared(tmp_path, [tmp_path / "d0.txt", tmp_path / "d4.txt"], "--pack", "15")
    assert tokens.size == 32 and meta["padding_tokens"] == 32 - 22
    assert (tokens[mask == 2] == 0).all() and (mask == 2).sum() == 10 and (mask == 1).sum() == 22  # 2: padding


@pytest.mark.parametrize("choice", ["refuse", "split", "drop"])
def test_a_document_longer_than_a_window(tmp_path, choice, capsys):
    corpus = write_jsonl(tmp_path / "a.jsonl", PAIRS)  # the second pair is 35 tokens with its end
    args = [
        "prepare",
        "--out",
        str(tmp_path / "out.bin"),
        "--format",
        "sft",
        "--pack",
        "15",
        "--too-long",
        choice,
        corpus,
    ]
    if choice == "refuse":
        assert data_main(args) == 2
        assert f"{corpus}:2: 35 tokens" in capsys.readouterr().err
        assert not (tmp_path / "out.bin").exists()
        return
    tokens, mask, meta = prepared(tmp_path, [corpus], "--format", "sft", "--pack", "15", "--too-long", choice)
    text = bytes(tokens.astype(np.uint8))
    if choice == "drop":
        assert meta["dropped_documents"] == 1 and b"Blue" not in text and tokens.size == 16
    else:  # two whole windows of it, its last 3 tokens in a third (the first record's 15 leave no room)
        assert meta["split_documents"] == 1 and tokens.size == 64
        assert sorted(bytes(tokens[mask == 1].astype(np.uint8))) == sorted(b" 4\0" + b" Blue, like the sky.\0")


def test_packed_data_is_read_at_its_own_seq_len(tmp_path):
    lengths = [9, 5, 5, 9, 11, 3, 7, 7]
    for i, n in enumerate(lengths):
        (tmp_path / f"d{i}.txt").write_bytes(bytes([65 + i]) * n)
    prepared(tmp_path, sorted(tmp_path.glob("d*.txt")), "--pack", "15")
    path = str(tmp_path / "out.bin")
    with pytest.raises(UserError, match=r"packed into windows of 16 tokens: it needs data.seq_len=15, not 16"):
        Samples(path, 16, seed=0)
    train, val = (Samples(path, 15, 0, split, val_fraction=0.25) for split in ("train", "val"))
    windows = np.fromfile(path, np.uint16).reshape(-1, 16)
    assert train.num_windows + val.num_windows == len(windows) and val.num_windows == 1
    assert (val[0] == windows[-1]).all()  # whole windows, not shifted by a cut inside one
    read = sorted(tuple(unmasked(train[i])) for i in range(train.num_windows))
    assert read == sorted(tuple(w) for w in windows[:-1].astype(np.int32))


def test_a_skipped_target_reads_as_its_complement(tmp_path):
    tokens, mask, _ = prepared(tmp_path, [write_jsonl(tmp_path / "a.jsonl", PAIRS[:1])], "--format", "sft")
    row = Samples(str(tmp_path / "out.bin"), tokens.size - 1, 0, val_fraction=0.0)[0]
    assert ((row < 0) == (mask == 0)).all() and (unmasked(row) == tokens).all()


@pytest.mark.parametrize(
    "record,phrase",
    [
        ({"text": "x"}, "a.jsonl:2: no 'messages' list and no 'prompt'/'completion' fields"),
        ({"prompt": "x", "completion": 3}, "a.jsonl:2: 'completion' is int, not text"),
        ({"messages": "hi"}, "a.jsonl:2: field 'messages' is str, not a list of messages"),
        ({"messages": [{"role": "user"}]}, "a.jsonl:2: message 0 of 'messages' needs 'role' and 'content'"),
    ],
)
def test_a_record_without_the_named_fields_gets_one_line(tmp_path, capsys, record, phrase):
    corpus = write_jsonl(tmp_path / "a.jsonl", [PAIRS[0], record])
    assert data_main(["prepare", "--out", str(tmp_path / "out.bin"), "--format", "sft", corpus]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and phrase in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl"]  # nothing half-written
