"""A Hugging Face export is ready to use.

`--to hf` writes the run's tokenizer and its end-of-document id, so transformers' pipeline decodes what jaxpar.generate
decodes and AutoTokenizer gives the project's token ids.
"""

import json

import jax
import numpy as np
import pytest

from jaxpar.core.data.tokens import eod_token, text_codec
from jaxpar.core.weights.names import save_weights
from jaxpar.tools import convert

from tests.helpers import tiny_config

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")

PROMPT, NEW = "def f(x):", 20
TEXTS = ["def f(x):\n    return x , y .", "héllo wörld ✓ 日本語 Ā", "a <0x00> b <|endoftext|> c", " \t\n  "]


def make_run(tmp_path, name: str, *overrides: str) -> str:
    """Write a one-layer jaxpar run of random weights and return its directory.

    The run holds a step-0 checkpoint and config.json; its weights are large enough that greedy decoding does not settle
    on one token; its weights file is tmp_path/NAME.safetensors.
    """
    from jaxpar.core.weights.names import flatten, unflatten
    from jaxpar.models.decoder import abstract_model

    rng = np.random.default_rng(0)
    shapes = flatten(abstract_model(tiny_config("model.n_layer=1", *overrides).model)[2])
    weights, run = str(tmp_path / f"{name}.safetensors"), str(tmp_path / name)
    flat = {
        k: np.ones(v.shape, np.float32) if k.endswith("scale") else rng.normal(0, 0.5, v.shape).astype(np.float32)
        for k, v in shapes.items()
    }  # norms as initialised, the rest as model.init_std=0.5 would
    save_weights(weights, unflatten(flat))
    assert convert.main(["--from", "shared", weights, "--to", "jaxpar", run]) == 0
    return run


def jaxpar_greedy(run: str, monkeypatch, prompt: str = PROMPT, new: int = NEW) -> list[int]:
    """Return the token ids jaxpar.generate decodes greedily for the prompt.

    The token ids `python -m jaxpar.generate --run RUN --prompt PROMPT --temperature 0 --max-new-tokens NEW` decodes,
    through its own functions on one of the test's devices.
    """
    from jaxpar import generate

    mesh = generate.make_mesh
    monkeypatch.setattr(generate, "make_mesh", lambda sizes, devices=None: mesh(sizes, jax.devices()[:1]))
    args = generate.parse_args(["--run", run, "--prompt", prompt, "--temperature", "0", "--max-new-tokens", str(new)])
    sizes = generate.check_decoding(args)
    cfg, flat, tokenizer = generate.load(args)
    return generate.sample_rows(cfg, sizes, flat, text_codec(tokenizer)[0](prompt), args)[0]


def test_byte_level_run_exports_a_ready_pipeline(tmp_path, monkeypatch, capsys):
    run, out = make_run(tmp_path, "run"), tmp_path / "hf"
    assert convert.main(["--from", "jaxpar", run, "--to", "hf", str(out)]) == 0
    assert "tokenizer: byte-level (the run's data.tokenizer)" in capsys.readouterr().out
    ids = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    config = json.loads((out / "config.json").read_text())
    assert json.loads((out / "generation_config.json").read_text()) == ids
    assert {k: config[k] for k in ids} == ids

    pipe = transformers.pipeline("text-generation", model=str(out), device="cpu")
    greedy = lambda **how: pipe(PROMPT, do_sample=False, max_new_tokens=NEW, return_tensors=True, **how)[0][
        "generated_token_ids"
    ][len(PROMPT.encode()) :]
    want = jaxpar_greedy(run, monkeypatch)
    assert len(set(want)) > 3, want  # a degenerate continuation would prove little
    assert greedy(eos_token_id=None) == want
    # jaxpar.generate decodes all NEW tokens; transformers stops after the end-of-document token 0, which these
    # weights decode early
    assert 0 in want[:-1], want
    assert greedy() == want[: want.index(0) + 1]

    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, len(tok)) == (0, 0, 0, 256)
    assert convert.main(["--from", "hf", str(out), "--to", "jaxpar", str(tmp_path / "back")]) == 0  # bytes again
    assert json.loads((tmp_path / "back" / "config.json").read_text())["data"]["tokenizer"] == "byte"
    encode = text_codec("byte")[0]
    for text in TEXTS:
        assert tok(text)["input_ids"] == encode(text) == list(text.encode()), text
        assert tok.decode(encode(text)) == text
    batch = tok(TEXTS[:2], padding=True)["input_ids"]
    assert batch[1][len(TEXTS[1].encode()) :] == [0] * (len(batch[0]) - len(TEXTS[1].encode()))

    # an HF source keeps its own tokenizer and ids, converted in place too (read before the weights are written)
    assert convert.main(["--from", "hf", str(out), "--to", "hf", str(out)]) == 0
    assert "tokenizer: copied" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert {k: config[k] for k in ids} == ids and (out / "tokenizer.json").exists()


def test_bpe_run_exports_its_tokenizer_and_end_of_document_id(tmp_path, capsys):
    """A run with a BPE tokenizer (python -m jaxpar.data tokenizer): the file and its <|endoftext|> id.

    AutoTokenizer encodes as jaxpar.core.data.tokens.text_codec does (the special token's text is the token).
    """
    from jaxpar.core.data.bpe import train_tokenizer

    corpus, path = tmp_path / "corpus.txt", str(tmp_path / "tokenizer.json")
    corpus.write_text("def f(x):\n    return x + 1\n" * 50 + "héllo wörld, the quick brown fox\n" * 20)
    size = train_tokenizer([str(corpus)], path, 300)
    run, out = make_run(tmp_path, "run", f"model.vocab_size={size}"), tmp_path / "hf"
    config_path = tmp_path / "run" / "config.json"  # as if the run had trained with data.tokenizer=path
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "data": {**config["data"], "tokenizer": path}}))
    assert convert.main(["--from", "jaxpar", run, "--to", "hf", str(out)]) == 0
    eod = eod_token(path)
    assert json.loads((out / "generation_config.json").read_text()) == dict.fromkeys(
        ("bos_token_id", "eos_token_id", "pad_token_id"), eod
    )
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token_id) == ("<|endoftext|>", eod, eod)
    encode, decode = text_codec(path)
    for text in TEXTS:
        assert tok(text)["input_ids"] == encode(text), text
        assert tok.decode(encode(text), skip_special_tokens=True) == decode(encode(text))  # tokenizers' default
    assert eod in tok(TEXTS[2])["input_ids"]

    # read back: sampling from the directory and a run converted from it use its tokenizer, not bytes
    from jaxpar import generate

    args = generate.parse_args(["--hf", str(out), "--prompt", "x"])
    assert generate.load(args)[2] == str(out / "tokenizer.json")
    assert convert.main(["--from", "hf", str(out), "--to", "jaxpar", str(tmp_path / "back")]) == 0
    assert json.loads((tmp_path / "back" / "config.json").read_text())["data"]["tokenizer"] == str(
        out / "tokenizer.json"
    )

    # the same weights from a shared file name no tokenizer: none is written (not the byte tokenizer's 256)
    capsys.readouterr()
    assert convert.main(["--from", "shared", str(tmp_path / "run.safetensors"), "--to", "hf", str(tmp_path / "x")]) == 0
    assert (
        f"no tokenizer written: the source names none, and its vocabulary has {size} tokens" in capsys.readouterr().out
    )
    assert not (tmp_path / "x" / "tokenizer.json").exists()
    assert "eos_token_id" not in json.loads((tmp_path / "x" / "config.json").read_text())
    assert (
        convert.main(
            [
                "--from",
                "shared",
                str(tmp_path / "run.safetensors"),
                "--to",
                "hf",
                str(tmp_path / "y"),
                "--tokenizer",
                path,
            ]
        )
        == 0
    )
    assert json.loads((tmp_path / "y" / "generation_config.json").read_text())["eos_token_id"] == eod


@pytest.mark.parametrize(
    "argv,named",
    [
        (["--to", "shared", "x.safetensors", "--tokenizer", "byte"], "--tokenizer is for --to hf"),
        (["--to", "hf", "x", "--tokenizer", "missing.json"], "--tokenizer: tokenizer must be 'byte' or"),
    ],
)
def test_tokenizer_refusals_are_one_line_and_write_nothing(argv, named, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = make_run(tmp_path, "run")
    capsys.readouterr()
    assert convert.main(["--from", "jaxpar", run, *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0], err
    assert not (tmp_path / argv[1]).exists()
