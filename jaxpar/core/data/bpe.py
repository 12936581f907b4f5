"""Train a byte-level BPE tokenizer on a corpus with Hugging Face `tokenizers` (offline).

Every text round-trips exactly (bytes are the base alphabet), and <|endoftext|> is its end-of-document token.
"""

from __future__ import annotations

import os

from jaxpar.core.data.corpus import collect, documents
from jaxpar.core.errors import UserError

EOD = "<|endoftext|>"


def train_tokenizer(inputs: list[str], out: str, vocab_size: int, text_field: str = "text") -> int:
    """Writes `out` (tokenizer.json); returns its vocabulary size."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # deferred: tokenizers, optional
    except ImportError:
        raise UserError("training a tokenizer needs the 'tokenizers' package (pip install tokenizers)") from None
    if vocab_size < 257:
        raise UserError(f"--vocab-size {vocab_size}: a byte-level BPE needs at least 257 (256 bytes + {EOD})")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    docs = (d.decode("utf-8", "replace") for d in documents(collect(inputs), text_field))
    tok.train_from_iterator(docs, trainer=trainer)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tok.save(out)
    return tok.get_vocab_size()
