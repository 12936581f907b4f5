"""The fine-tuning example of docs/features.md, on a tiny Hugging Face GPT-2 and a small JSON-lines file.

Convert, prepare with a loss mask and packing, train; and what the run reads is the prepared file's windows.
"""

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import ROOT, TINY, metrics

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


def cli(*args, timeout=300):
    r = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_fine_tune_a_converted_model_on_prompt_completion_records(tmp_path):
    rng = np.random.default_rng(0)
    records = [{"prompt": f"Q: {a} plus {b}?\nA:", "completion": f" {a + b}"} for a, b in rng.integers(1, 50, (64, 2))]
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cli(
        "jaxpar.data",
        "tokenizer",
        "--out",
        str(tmp_path / "tok.json"),
        "--vocab-size",
        "300",
        "--text-field",
        "prompt",
        str(tmp_path / "qa.jsonl"),
    )
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=300, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    ).save_pretrained(tmp_path / "gpt2")
    run = tmp_path / "runs" / "sft"
    cli("jaxpar.tools.convert", "--from", "hf", str(tmp_path / "gpt2"), "--to", "jaxpar", str(run))
    out = cli(
        "jaxpar.data",
        "prepare",
        "--format",
        "sft",
        "--pack",
        "31",
        "--tokenizer",
        str(tmp_path / "tok.json"),
        "--out",
        str(tmp_path / "sft.bin"),
        str(tmp_path / "qa.jsonl"),
    )
    assert "packed into" in out and "0 documents split" in out
    cli(
        "jaxpar.train",
        "--config",
        str(run / "config.json"),
        f"run.dir={run}",
        f"data.dataset={tmp_path / 'sft.bin'}",
        f"data.tokenizer={tmp_path / 'tok.json'}",
        "data.seq_len=31",
        "data.document_mask=true",
        "train.steps=6",
        "train.global_batch_size=4",
        "data.val_fraction=0.1",
        "train.log_every=1",
        "train.eval_every=0",
        "--mesh",
        "dp=1",
    )
    losses = [m["loss"] for _, m in sorted(metrics(run).items())]
    assert len(losses) == 6 and losses[-1] < losses[0]


def test_padding_is_logged_and_left_out_of_the_throughput(tmp_path):
    """Documents of 10 bytes packed for seq_len 15.

    One per window of 16 (two would need 22), 5 tokens of padding in each, so every batch's padding share is 5/16
    whatever the order.
    """
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(40):
        (docs / f"{i:02d}.txt").write_bytes(bytes([97 + i % 26]) * 10)
    out = cli("jaxpar.data", "prepare", "--pack", "15", "--out", str(tmp_path / "p.bin"), str(docs))
    assert "31.2% padding" in out
    run = tmp_path / "run"
    cli(
        "jaxpar.train",
        *TINY,
        "data.seq_len=15",
        f"data.dataset={tmp_path / 'p.bin'}",
        f"run.dir={run}",
        "train.steps=3",
        "train.eval_every=0",
        "--mesh",
        "dp=1",
    )
    records = metrics(run)
    assert sorted(records) == [1, 2, 3] and all(r["padding_share"] == 5 / 16 for r in records.values())
