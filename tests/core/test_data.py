import os
import subprocess
import sys

import numpy as np
import pytest

from jaxpar.core.data import corpus, tokens as data
from jaxpar.core.config.schema import DataConfig
from jaxpar.core.data.tokens import prepare, read_meta, resolve_dataset, write_tokens
from jaxpar.data import TokenBatches
from jaxpar.core.errors import UserError
from tests.helpers import ROOT


def _arange_dataset(tmp_path, n, name="seq.bin"):
    """Token i at position i: every window is identifiable by its first token."""
    return write_tokens(str(tmp_path / name), np.arange(n), vocab_size=n)


def _is_window(row, width):
    return row[0] % width == 0 and np.array_equal(row, np.arange(row[0], row[0] + width))


def test_byte_roundtrip_and_directory_walk(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    texts = {"b.py": "print('hi')\n", "a.txt": "héllo wörld ✓", "sub/c.md": "# title\n\nbody", "z.bin": "skip me"}
    for name, text in texts.items():
        (src / name).write_text(text, encoding="utf-8")
    extra = tmp_path / "extra.dat"  # explicit files are taken whatever their suffix
    extra.write_bytes(b"\xff\x00raw")
    out = prepare([str(src), str(extra)], str(tmp_path / "ds.bin"))
    tokens = np.fromfile(out, dtype="<u2")
    want = [(src / n).read_bytes() for n in ("a.txt", "b.py", "sub/c.md")] + [extra.read_bytes()]
    assert bytes(tokens.astype(np.uint8)) == b"\0".join(want)  # byte 0: the end-of-document token
    meta = read_meta(out)
    assert meta == {
        "dtype": "uint16",
        "vocab_size": 256,
        "num_tokens": len(tokens),
        "tokenizer": "byte",
        "num_documents": 4,
        "eod_token": 0,
    }


def test_prepare_is_deterministic(tmp_path):
    for i in range(5):
        (tmp_path / f"f{i}.txt").write_text(f"doc {i}\n" * (i + 1))
    a = prepare([str(tmp_path)], str(tmp_path / "a.bin"))
    b = prepare([str(tmp_path)], str(tmp_path / "b.bin"))  # a.bin/.json are not inputs (suffix)
    assert open(a, "rb").read() == open(b, "rb").read()


def test_prepare_failure_keeps_old_output(tmp_path, monkeypatch):
    good = tmp_path / "good.txt"
    good.write_text("original contents")
    out = str(tmp_path / "ds.bin")
    prepare([str(good)], out)
    old_bin, old_meta = open(out, "rb").read(), open(out + ".json").read()
    before = sorted(os.listdir(tmp_path))

    with pytest.raises(UserError, match="missing.txt"):
        prepare([str(good), str(tmp_path / "missing.txt")], out)

    # A failure mid-write (after the first document reached the temp file).
    (tmp_path / "other.txt").write_text("other")
    calls = []

    def flaky_open(path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            raise PermissionError(13, "Permission denied")
        return open(path, *args, **kwargs)

    monkeypatch.setattr(corpus, "open", flaky_open, raising=False)  # the module's `open` before the builtin
    with pytest.raises(UserError, match="cannot read"):
        prepare([str(good), str(tmp_path / "other.txt")], out)
    assert len(calls) == 2
    assert open(out, "rb").read() == old_bin and open(out + ".json").read() == old_meta
    assert sorted(os.listdir(tmp_path)) == sorted(before + ["other.txt"])  # no temp files left


def test_same_seed_same_batches_different_seed_differs(tmp_path):
    path = _arange_dataset(tmp_path, 5000)
    a, b = (TokenBatches(path, 15, 8, seed=1) for _ in range(2))
    c = TokenBatches(path, 15, 8, seed=2)
    steps = range(6)
    assert all(np.array_equal(a.global_batch(s), b.global_batch(s)) for s in steps)
    assert any(not np.array_equal(a.global_batch(s), c.global_batch(s)) for s in steps)
    batch = a.global_batch(0)
    assert batch.dtype == np.int32 and batch.shape == (8, 16)
    assert all(_is_window(r, 16) for r in batch)


def test_process_shares_concatenate_to_global_batch(tmp_path):
    path = _arange_dataset(tmp_path, 3000)
    full = TokenBatches(path, 7, 8, seed=3)
    for step in (0, 1, 17, 1000):  # 1000 is many epochs in
        # Each "process" builds its own loader and loads only its rows.
        shares = [TokenBatches(path, 7, 8, seed=3).rows(step, a, b) for a, b in ((0, 3), (3, 3), (3, 5), (5, 8))]
        assert shares[1].shape == (0, 8)
        assert np.array_equal(np.concatenate(shares), full.global_batch(step))


def test_train_val_split_disjoint(tmp_path):
    n, width = 4000, 10
    path = _arange_dataset(tmp_path, n)
    train = TokenBatches(path, width - 1, 4, seed=0, split="train", val_fraction=0.1)
    val = TokenBatches(path, width - 1, 4, seed=0, split="val", val_fraction=0.1)
    n_train_tok = n - int(n * 0.1)
    assert train.num_windows == n_train_tok // width and val.num_windows == (n - n_train_tok) // width
    train_tok = np.concatenate([train.global_batch(s) for s in range(-(-train.num_windows // 4))])
    val_rows = np.concatenate([val.global_batch(s) for s in range(-(-val.num_windows // 4))])
    assert train_tok.max() < n_train_tok <= val_rows.min()
    assert not set(train_tok.ravel()) & set(val_rows.ravel())
    # val is not shuffled: consecutive windows starting at the split point
    assert all(
        np.array_equal(r, np.arange(n_train_tok + i * width, n_train_tok + (i + 1) * width))
        for i, r in enumerate(val_rows[: val.num_windows])
    )


def test_each_window_once_per_epoch(tmp_path):
    width = 10
    path = _arange_dataset(tmp_path, 23 * width + 5)  # 23 windows with val_fraction tiny -> not a multiple of B
    tb = TokenBatches(path, width - 1, 4, seed=7, val_fraction=0.001)
    nw = tb.num_windows
    assert nw == 23
    flat = np.concatenate([tb.global_batch(s) for s in range(2 * nw // 4 + 1)])
    assert all(_is_window(r, width) for r in flat)
    ids = flat[:, 0] // width
    epoch1, epoch2 = ids[:nw], ids[nw : 2 * nw]
    assert sorted(epoch1) == list(range(nw)) and sorted(epoch2) == list(range(nw))
    assert list(epoch1) != list(range(nw))  # shuffled
    assert list(epoch1) != list(epoch2)  # reshuffled each epoch


def test_missing_dataset_and_sidecar(tmp_path):
    missing = str(tmp_path / "nope.bin")
    with pytest.raises(UserError, match="nope.bin"):
        resolve_dataset(DataConfig(dataset=missing))
    with pytest.raises(UserError, match="nope.bin"):
        TokenBatches(missing, 8, 2, seed=0)
    lonely = tmp_path / "lonely.bin"
    lonely.write_bytes(b"\0" * 10)
    with pytest.raises(UserError, match="lonely.bin"):
        resolve_dataset(DataConfig(dataset=str(lonely)))
    path = _arange_dataset(tmp_path, 100)
    with open(path + ".json", "w") as f:
        f.write("{not json")
    with pytest.raises(UserError, match="seq.bin.json"):
        resolve_dataset(DataConfig(dataset=path))
    path = _arange_dataset(tmp_path, 100, "trunc.bin")
    with open(path, "r+b") as f:
        f.truncate(50)
    with pytest.raises(UserError, match="trunc.bin"):
        resolve_dataset(DataConfig(dataset=path))
    assert resolve_dataset(DataConfig(dataset=_arange_dataset(tmp_path, 100, "ok.bin"))).endswith("ok.bin")


def test_too_short_dataset(tmp_path):
    path = _arange_dataset(tmp_path, 100)
    with pytest.raises(UserError, match=r"train split .* 99 tokens.* needs 129"):
        TokenBatches(path, 128, 2, seed=0)
    with pytest.raises(UserError, match=r"val split .* 1 tokens.* needs 9"):
        TokenBatches(path, 8, 2, seed=0, split="val")
    TokenBatches(path, 98, 2, seed=0)  # exactly one window fits


def test_rows_out_of_range(tmp_path):
    tb = TokenBatches(_arange_dataset(tmp_path, 1000), 9, 4, seed=0)
    for start, stop in ((-1, 2), (0, 5), (3, 2)):
        with pytest.raises(UserError, match="global_batch_size=4"):
            tb.rows(0, start, stop)


@pytest.fixture(scope="module")
def stdlib_dataset(tmp_path_factory):
    cfg = DataConfig(cache_dir=str(tmp_path_factory.mktemp("cache")))
    return cfg, resolve_dataset(cfg)


def test_stdlib_prepared_once_and_reused(stdlib_dataset, capsys):
    cfg, path = stdlib_dataset
    v = sys.version_info
    assert os.path.dirname(path) == cfg.cache_dir and f"py{v.major}.{v.minor}" in path and "byte" in path
    files = data.stdlib_files()
    assert files and all(f.endswith(".py") for f in files)
    assert not any(set(f.split(os.sep)) & {"site-packages", "test", "tests", "idlelib"} for f in files)
    meta = read_meta(path)
    assert meta["num_documents"] == len(files)
    assert meta["num_tokens"] == sum(os.path.getsize(f) for f in files) + len(files) - 1
    mtime = os.stat(path).st_mtime_ns
    assert resolve_dataset(cfg) == path
    assert os.stat(path).st_mtime_ns == mtime and "preparing" not in capsys.readouterr().err
    tb = TokenBatches(path, 64, 4, seed=0)
    assert tb.vocab_size == 256 and tb.global_batch(3).max() < 256


def test_cli(tmp_path):
    (tmp_path / "t.txt").write_text("hello cli " * 100)
    out = str(tmp_path / "cli.bin")
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))}
    run = lambda *a: subprocess.run([sys.executable, "-m", "jaxpar.data", *a], capture_output=True, text=True, env=env)
    r = run("prepare", "--out", out, str(tmp_path / "t.txt"))
    assert r.returncode == 0, r.stderr
    r = run("info", out, "--seq-len", "9")
    assert r.returncode == 0 and '"num_tokens": 1000' in r.stdout and "99 train windows, 1 val windows" in r.stdout
    r = run("info", str(tmp_path / "absent.bin"))
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "absent.bin" in r.stderr


def test_hf_tokenizer_branch_with_fake_library(tmp_path, monkeypatch):
    """Exercises the `tokenizers` path without the optional package: word ids offset past 65536 -> uint32."""
    import types

    class FakeTokenizer:
        def encode(self, text, add_special_tokens=True):
            assert not add_special_tokens  # no BOS/EOS per document
            return types.SimpleNamespace(ids=[70000 + ord(c) for c in text])

        def get_vocab_size(self):
            return 70000 + 0x110000

        def token_to_id(self, name):
            return 69999 if name == "<|endoftext|>" else None

    monkeypatch.setitem(
        sys.modules,
        "tokenizers",
        types.SimpleNamespace(Tokenizer=types.SimpleNamespace(from_file=lambda path: FakeTokenizer())),
    )
    tok = tmp_path / "tok.json"
    tok.write_text("{}")
    (tmp_path / "a.txt").write_text("hé")
    (tmp_path / "b.txt").write_text("yo")
    out = prepare([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], str(tmp_path / "hf.bin"), str(tok))
    meta = read_meta(out)
    assert meta["dtype"] == "uint32" and meta["tokenizer"] == str(tok)
    assert list(np.fromfile(out, dtype="<u4")) == [
        70000 + ord("h"),
        70000 + ord("é"),
        69999,
        70000 + ord("y"),
        70000 + ord("o"),
    ]


@pytest.mark.parametrize("n,seed", [(1, 0), (23, 7), (279, 0), (70_000, 2**32 - 1)])
def test_shared_order_is_grains_shuffle(n, seed):
    """The shared data order is grain's shuffle, epoch after epoch.

    The order defined in jaxpar/core/data/order.py (pure Python; what torchpar reads) is, epoch after epoch, the one
    grain's MapDataset.shuffle(seed).repeat() gives, so runs keep their data order.
    """
    import grain

    from jaxpar.core.data.shuffle import shuffled_index

    ds = grain.MapDataset.source(range(n)).shuffle(seed=seed).repeat()
    idx = [i for e in range(3) for i in range(e * n, e * n + min(n, 300))]
    assert [shuffled_index(i % n, n, (seed + i // n) % 2**32) for i in idx] == [ds[i] for i in idx]


DOCS = [f"document {i}: " + "héllo wörld ✓ def f(x): return x\n" * (i % 5 + 1) for i in range(60)]


@pytest.fixture
def corpus_files(tmp_path):
    """The documents split over a JSON-lines file (text under "body") and a Parquet file."""
    import json

    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    with open(tmp_path / "a.jsonl", "w") as f:
        for d in DOCS[:30]:
            f.write(json.dumps({"id": 1, "body": d}) + "\n")
    pq.write_table(pa.table({"body": DOCS[30:]}), tmp_path / "b.parquet")
    return [str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet")]


def test_jsonl_and_parquet_documents_with_end_of_document_tokens(corpus_files, tmp_path):
    out = prepare(corpus_files, str(tmp_path / "c.bin"), text_field="body")
    tokens = bytes(np.fromfile(out, dtype="<u2").astype(np.uint8))
    assert tokens.split(b"\0") == [d.encode() for d in DOCS] and read_meta(out)["num_documents"] == len(DOCS)
    with pytest.raises(UserError, match="no field 'text'"):
        prepare(corpus_files, str(tmp_path / "d.bin"))


def test_trained_bpe_round_trips_and_parallel_prepare_matches_one_worker(corpus_files, tmp_path):
    pytest.importorskip("tokenizers")
    from jaxpar.core.data.bpe import train_tokenizer
    from jaxpar.core.data.tokens import eod_token, text_codec

    tok = str(tmp_path / "tokenizer.json")
    assert train_tokenizer(corpus_files, tok, vocab_size=320, text_field="body") == 320
    encode, decode = text_codec(tok)
    for text in DOCS[:3] + ["  spaces\tand tabs\r\n", "日本語 and emoji 🚀", ""]:
        assert decode(encode(text)) == text
    assert len(encode(DOCS[0])) < len(DOCS[0].encode())  # merges were learned
    one = prepare(corpus_files, str(tmp_path / "one.bin"), tok, "body", workers=1)
    two = prepare(corpus_files, str(tmp_path / "two.bin"), tok, "body", workers=2)
    assert open(one, "rb").read() == open(two, "rb").read()
    ids = np.fromfile(one, dtype="<u2")
    cuts = np.flatnonzero(ids == eod_token(tok))  # <|endoftext|> between documents, nowhere else
    parts = np.split(ids, cuts)
    assert len(cuts) == len(DOCS) - 1 and (
        [decode(parts[0].tolist())] + [decode(p[1:].tolist()) for p in parts[1:]] == DOCS
    )


def test_parallel_prepare_ends_where_sigterm_is_ignored(corpus_files, tmp_path):
    """A parent that ignores SIGTERM (a finished run ignores late stop signals) hands that on to the workers.

    The pool must still end them (it hung in Pool.terminate's join).
    """
    pytest.importorskip("tokenizers")
    from jaxpar.core.data.bpe import train_tokenizer

    tok = str(tmp_path / "tokenizer.json")
    train_tokenizer(corpus_files, tok, vocab_size=320, text_field="body")
    code = (
        "import signal, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "from jaxpar.core.data.tokens import prepare; "
        f"prepare({corpus_files!r}, {str(tmp_path / 'two.bin')!r}, {tok!r}, 'body', workers=2)"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and (tmp_path / "two.bin").exists(), r.stderr


def test_a_tokenizer_smaller_than_asked_is_said(tmp_path, capsys):
    """BPE stops merging where a small corpus has no pairs left.

    The vocabulary it wrote is smaller than --vocab-size, and one line on stderr gives the model.vocab_size that
    goes with it.
    """
    pytest.importorskip("tokenizers")
    from jaxpar.data import main

    corpus = tmp_path / "small.txt"
    corpus.write_text("def f(x):\n    return x + 1\n")
    out = tmp_path / "tokenizer.json"
    assert main(["tokenizer", "--out", str(out), "--vocab-size", "1000", str(corpus)]) == 0
    from tokenizers import Tokenizer

    size = Tokenizer.from_file(str(out)).get_vocab_size()
    err = capsys.readouterr().err.strip().splitlines()
    assert size < 1000 and err == [
        f"note: the corpus gave {size:,} tokens, fewer than --vocab-size 1000: set "
        f"model.vocab_size={size} (or more) to train with it, or give a larger corpus "
        "for 1,000"
    ], err
    assert main(["tokenizer", "--out", str(out), "--vocab-size", str(size), str(corpus)]) == 0
    assert capsys.readouterr().err == ""  # the size asked: nothing to say
