"""Fine-tuning records and packed windows, for `python -m jaxpar.data prepare --format sft` / `--pack`.

A record becomes pieces of text, each counted in the loss or not: a prompt/completion pair is the
prompt (not counted) then the completion (counted); a chat `messages` list is, per message, "ROLE: "
(not counted) then "CONTENT\\n" (counted for the assistant's messages). Each piece is tokenized on its
own, so the boundary between what is counted and what is not falls between tokens. A document ends
with the end-of-document token, counted when the document has counted tokens (the model learns to stop).

Packing puts whole documents into windows of seq_len + 1 tokens, best fit over a bounded set of open
windows (as grain's packing does), and fills the rest with end-of-document tokens that the loss skips (mask
value 2: padding, which the throughput does not count as real tokens). A document longer than a window is
split into window-sized pieces (a new piece reads without the text before it), dropped, or refused, as
--too-long says.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Iterable, Iterator

import numpy as np

from jaxpar.core.errors import UserError

TOO_LONG = ("refuse", "split", "drop")
COUNTED, PADDING = 1, 2  # loss mask values: a counted target, a padding token (skipped too; not a real token)


@dataclasses.dataclass(frozen=True)
class SftFields:
    prompt: str = "prompt"
    completion: str = "completion"
    messages: str = "messages"

    @property
    def columns(self) -> tuple[str, ...]:
        return (self.messages, self.prompt, self.completion)


def _text(value, where: str, name: str) -> str:
    if not isinstance(value, str):
        raise UserError(f"{where}: {name} is {type(value).__name__}, not text")
    return value


def sft_pieces(where: str, record: dict, fields: SftFields) -> list[tuple[str, bool]]:
    """A record's (text, counted) pieces: its chat messages, else its prompt and completion."""
    chat = record.get(fields.messages)
    if chat is not None:
        if not isinstance(chat, list):
            raise UserError(f"{where}: field {fields.messages!r} is {type(chat).__name__}, not a list of messages")
        pieces = []
        for i, m in enumerate(chat):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise UserError(f"{where}: message {i} of {fields.messages!r} needs 'role' and 'content'")
            role = _text(m["role"], where, f"message {i}'s role")
            pieces += [
                (f"{role}: ", False),
                (_text(m["content"], where, f"message {i}'s content") + "\n", role == "assistant"),
            ]
        return pieces
    if record.get(fields.prompt) is None or record.get(fields.completion) is None:
        raise UserError(
            f"{where}: no {fields.messages!r} list and no {fields.prompt!r}/{fields.completion!r} "
            "fields (--messages-field, --prompt-field and --completion-field name them)"
        )
    return [
        (_text(record[fields.prompt], where, repr(fields.prompt)), False),
        (_text(record[fields.completion], where, repr(fields.completion)), True),
    ]


def document(encoded: Iterable[tuple[np.ndarray, bool]], eod: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, loss mask) of one document from its encoded pieces, ended by the end-of-document token."""
    encoded = list(encoded)
    tokens = np.concatenate([np.asarray(t, np.int64).reshape(-1) for t, _ in encoded] + [[eod]])
    mask = np.concatenate([np.full(len(t), c, np.uint8) for t, c in encoded] + [np.zeros(1, np.uint8)])
    mask[-1] = mask.any()
    return tokens, mask


@dataclasses.dataclass
class PackStats:
    num_documents: int = 0
    windows: int = 0
    split: int = 0
    dropped: int = 0
    padding: int = 0


class _Bins:
    """Open windows by free space: the best fit for n tokens is the one with the least space >= n."""

    def __init__(self, window: int, limit: int):
        self.window, self.limit, self.free, self.content, self.made = window, limit, [], {}, 0

    def place(self, item) -> Iterator[list]:
        """Places `item`; yields the windows it completes (and, over the limit, the fullest open one)."""
        n = len(item[0])
        at = bisect.bisect_left(self.free, (n, -1))
        if at < len(self.free):
            space, key = self.free.pop(at)
        else:
            space, key, self.made = self.window, self.made, self.made + 1
            self.content[key] = []
        self.content[key].append(item)
        if space - n == 0:
            yield self.content.pop(key)
        else:
            bisect.insort(self.free, (space - n, key))
        if len(self.free) > self.limit:
            yield self.content.pop(self.free.pop(0)[1])

    def rest(self) -> Iterator[list]:
        for key in sorted(self.content):
            yield self.content.pop(key)


def pack(
    docs: Iterable[tuple[str, np.ndarray, np.ndarray]],
    window: int,
    eod: int,
    too_long: str,
    stats: PackStats,
    open_windows: int = 256,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Windows (tokens, mask) of `window` tokens from (where, tokens, mask) documents; `stats` counts."""
    bins = _Bins(window, open_windows)

    def full(items):
        tokens = np.concatenate([t for t, _ in items])
        pad = window - len(tokens)
        stats.windows, stats.padding = stats.windows + 1, stats.padding + pad
        return (
            np.concatenate([tokens, np.full(pad, eod, tokens.dtype)]),
            np.concatenate([m for _, m in items] + [np.full(pad, PADDING, np.uint8)]),
        )

    for where, tokens, mask in docs:
        stats.num_documents += 1
        if len(tokens) > window:
            if too_long == "refuse":
                raise UserError(
                    f"{where}: {len(tokens)} tokens (with its end-of-document token) do not fit a window "
                    f"of {window} (seq_len {window - 1}); --too-long split or drop, or a longer --pack"
                )
            if too_long == "drop":
                stats.dropped += 1
                continue
            stats.split += 1
            cut = len(tokens) - len(tokens) % window
            for lo in range(0, cut, window):
                yield full([(tokens[lo : lo + window], mask[lo : lo + window])])
            tokens, mask = tokens[cut:], mask[cut:]
            if not len(tokens):
                continue
        for items in bins.place((tokens, mask)):
            yield full(items)
    for items in bins.rest():
        yield full(items)
