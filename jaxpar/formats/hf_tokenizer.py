"""The tokenizer and special-token ids of a Hugging Face export (`jaxpar.tools.convert --to hf`).

`AutoTokenizer` and `pipeline("text-generation")` need tokenizer files beside the weights and the end-of-document
id in config.json and generation_config.json. Which tokenizer an export carries, first that applies:
  --tokenizer (byte or a tokenizer.json)   what the user names
  the source's tokenizer files             an HF source directory's own, copied with its special-token ids
  the run's data.tokenizer                 a jaxpar run: a tokenizer.json file, or byte when the vocabulary is 256
  byte                                     a weights file or HF directory without a tokenizer, of vocabulary 256
Otherwise none is written (the command says so in one line) and config.json keeps no special-token ids.

The byte tokenizer is a `tokenizers` BPE with no merges over 256 tokens <0x00>..<0xFF> (id = byte value) and byte
fallback: every character is missing from that vocabulary, so it becomes the tokens of its UTF-8 bytes, which are
the project's byte ids (jaxpar/core/data/tokens.py); the ByteFallback decoder joins them back into UTF-8 text (GPT-2's
ByteLevel alphabet would name byte 0 "Ā", a letter, as its end-of-document token). Byte 0 (<0x00>) ends a
document, so bos = eos = pad = 0; tokenizer_config.json sets split_special_tokens so that text spelling "<0x00>"
stays its six bytes, as the project encodes it. A BPE file (python -m jaxpar.data tokenizer) is copied as
tokenizer.json; its end-of-document token is the one jaxpar.core.data.tokens.eod_token finds, and, as the project
encodes, that token's text in a string is the token.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import NamedTuple

from jaxpar.core.errors import UserError
from jaxpar.core.data.tokens import eod_token

BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]
# an HF directory's tokenizer, copied whole from a source directory that has tokenizer.json or tokenizer.model
HF_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)
ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def byte_tokenizer():
    """The byte-level tokenizer as a `tokenizers.Tokenizer`: the ids of a text are its UTF-8 bytes."""
    from tokenizers import Tokenizer, decoders, models  # deferred: tokenizers, optional (hf extra): the byte tokenizer

    tok = Tokenizer(models.BPE(vocab={t: b for b, t in enumerate(BYTE_TOKENS)}, merges=[], byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    return tok


def source_tokenizer(hf_dir: str) -> str | None:
    """What a run converted from an HF directory tokenizes with.

    "byte" for the byte tokenizer an export writes, the directory's tokenizer.json for another, None where it has
    none.
    """
    path = os.path.join(hf_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        model = json.load(f).get("model", {})
    byte_ids = {t: b for b, t in enumerate(BYTE_TOKENS)}
    return "byte" if model.get("vocab") == byte_ids and not model.get("merges") else os.path.abspath(path)


class Choice(NamedTuple):
    """What an export carries.

    Kind "byte", "file" (a tokenizers JSON at path), "hf" (the directory at path's files) or None; why (for the
    command's line); the special-token ids and, for byte and file, the token's text.
    """

    kind: str | None
    path: str
    why: str
    ids: dict = {}
    token: str = ""


def choose(
    vocab_size: int, given: str | None = None, run_tokenizer: str | None = None, hf_src: str | None = None
) -> Choice:
    """The tokenizer of an export, chosen by the order above.

    It is read before anything is written (an HF source may be the destination); one that the user or the run names but
    that cannot serve this model is refused in one line.
    """
    if given == "byte":
        if vocab_size < 256:
            raise UserError(
                f"--tokenizer byte: the byte tokenizer's 256 tokens do not fit this model's vocabulary of {vocab_size}"
            )
        return _byte("--tokenizer byte")
    if given is not None:
        return _file(given, vocab_size, "--tokenizer")
    if hf_src and any(os.path.exists(os.path.join(hf_src, f)) for f in ("tokenizer.json", "tokenizer.model")):
        with open(os.path.join(hf_src, "config.json")) as f:
            source = json.load(f)
        ids = {k: source[k] for k in ID_KEYS if source.get(k) is not None}
        return Choice("hf", hf_src, f"the tokenizer of {hf_src}", ids)
    if run_tokenizer not in (None, "byte"):
        return _file(run_tokenizer, vocab_size, "the run's data.tokenizer")
    if vocab_size == 256:  # the byte tokenizer's size; "byte" is also the default of a run converted from weights
        return _byte("the run's data.tokenizer" if run_tokenizer else "a vocabulary of 256 tokens")
    if run_tokenizer:
        return Choice(None, "", f"the run's data.tokenizer is byte but its vocabulary has {vocab_size} tokens, not 256")
    return Choice(
        None, "", f"the source names none, and its vocabulary has {vocab_size} tokens, not the byte tokenizer's 256"
    )


def _byte(why: str) -> Choice:
    return Choice("byte", "", why, dict.fromkeys(ID_KEYS, 0), BYTE_TOKENS[0])


def _file(path: str, vocab_size: int, named: str) -> Choice:
    """A tokenizers JSON file with an end-of-document token and no more tokens than the model has."""
    try:
        eod = eod_token(path)
    except UserError as e:
        raise UserError(f"{named}: {e}") from None
    from tokenizers import Tokenizer  # deferred: tokenizers, optional (hf extra): a tokenizer.json

    tok = Tokenizer.from_file(path)
    if tok.get_vocab_size() > vocab_size:
        raise UserError(
            f"{named} {path} has {tok.get_vocab_size()} tokens; this model's vocabulary has only {vocab_size}"
        )
    return Choice("file", path, named, dict.fromkeys(ID_KEYS, eod), tok.id_to_token(eod))


def write(out_dir: str, choice: Choice, max_len: int) -> None:
    """Writes the tokenizer files of `choice` to out_dir, and its special-token ids to config.json.

    The ids also go to generation_config.json, but for a copied directory's own.
    """
    if choice.kind == "hf":
        for name in HF_FILES:
            path, dst = os.path.join(choice.path, name), os.path.join(out_dir, name)
            if os.path.exists(path) and not (os.path.exists(dst) and os.path.samefile(path, dst)):
                shutil.copyfile(path, dst)
    elif choice.kind is not None:
        if choice.kind == "byte":
            byte_tokenizer().save(os.path.join(out_dir, "tokenizer.json"))
        else:
            shutil.copyfile(choice.path, os.path.join(out_dir, "tokenizer.json"))
        special = dict.fromkeys(("bos_token", "eos_token", "pad_token"), choice.token)
        _dump(out_dir, "special_tokens_map.json", special)
        _dump(
            out_dir,
            "tokenizer_config.json",
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                **special,
                "model_max_length": max_len,
                "clean_up_tokenization_spaces": False,
                "split_special_tokens": choice.kind == "byte",
            },
        )
        _dump(out_dir, "generation_config.json", choice.ids)
    with open(os.path.join(out_dir, "config.json")) as f:
        config = json.load(f)
    _dump(out_dir, "config.json", {**config, **choice.ids})


def _dump(out_dir: str, name: str, value: dict) -> None:
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(value, f, indent=2)
