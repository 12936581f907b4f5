"""jaxpar's data: the shared order (jaxpar/core/data/order.py) served through grain, and batches placed on the mesh.

Also the command line for token files:

  python -m jaxpar.data prepare --out data/my.bin [--tokenizer byte|tokenizer.json] [--text-field text]
      [--workers N] my_texts/ corpus.jsonl shard.parquet ...
  python -m jaxpar.data prepare --format sft --pack 512 --out data/sft.bin chats.jsonl   (fine-tuning records:
      prompt/completion or chat messages, the loss on the responses; whole documents packed per window)
  python -m jaxpar.data tokenizer --out tokenizer.json --vocab-size 8192 my_texts/ ...
  python -m jaxpar.data info data/my.bin [--seq-len 128]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from jaxpar.core.data.bpe import train_tokenizer
from jaxpar.core.data.order import GlobalBatches, Samples
from jaxpar.core.errors import UserError, cli
from jaxpar.core.data.packing import TOO_LONG, SftFields
from jaxpar.core.data.tokens import prepare, read_meta, split_range


def grain_batches(samples: Samples, global_batch_size: int, sizes=None) -> GlobalBatches:
    """Global batches whose samples are read through a grain MapDataset over the shared order."""
    import grain  # deferred: grain imports jax (~1 s), which prepare, tokenizer and info don't need

    dataset = grain.MapDataset.range(0, 2**62).map(samples.__getitem__)  # sample i, any i >= 0
    return GlobalBatches(samples, global_batch_size, read=dataset.__getitem__, sizes=sizes)


def TokenBatches(
    path: str,
    seq_len: int,
    global_batch_size: int,
    seed: int,
    split: str = "train",  # noqa: N802
    val_fraction: float = 0.01,
) -> GlobalBatches:
    """The global batches of one split of a token file, read through grain."""
    return grain_batches(Samples(path, seq_len, seed, split, val_fraction), global_batch_size)


def device_batch(data: GlobalBatches, step: int, sharding):
    """The global batch at `step` as a sharded array; this process reads only the rows it holds."""
    import jax  # deferred: jax (~1 s), which prepare, tokenizer and info don't need

    shape = data.shape(step)
    index_map = sharding.addressable_devices_indices_map(shape)
    lo = min(ix[0].start or 0 for ix in index_map.values())
    hi = max(ix[0].stop or shape[0] for ix in index_map.values())
    rows = data.rows(step, lo, hi)
    return jax.make_array_from_callback(
        shape, sharding, lambda ix: rows[(ix[0].start or 0) - lo : (ix[0].stop or shape[0]) - lo]
    )


def _prepare(args) -> None:
    if args.pack is not None and args.pack < 1:  # not packing is leaving --pack out, not --pack 0
        raise UserError(
            f"--pack {args.pack}: --pack takes the data.seq_len of the windows, at least 1 (leave it out "
            "to cut a token stream)"
        )
    if args.pack is None and args.too_long != "refuse":
        raise UserError("--too-long goes with --pack SEQ_LEN")
    sft = SftFields(args.prompt_field, args.completion_field, args.messages_field) if args.format == "sft" else None
    meta = read_meta(
        prepare(
            args.inputs, args.out, args.tokenizer, args.text_field, args.workers, sft, args.pack or 0, args.too_long
        )
    )
    print(f"wrote {args.out}: {meta['num_tokens']} tokens from {meta['num_documents']} documents")
    if "counted_tokens" in meta:
        counted = meta["counted_tokens"]
        print(f"  loss mask: {counted} tokens counted ({counted / max(meta['num_tokens'], 1):.1%})")
    if meta.get("window", 1) > 1:
        n = meta["num_tokens"] // meta["window"]
        print(
            f"  packed into {n} windows of {meta['window']} tokens (data.seq_len={meta['window'] - 1}): "
            f"{meta['padding_tokens'] / max(meta['num_tokens'], 1):.1%} padding, "
            f"{meta['split_documents']} documents split, {meta['dropped_documents']} dropped"
        )


@cli
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxpar.data", description="Prepare and inspect token files.")
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare", help="tokenize a corpus (text files, .jsonl, .parquet) into a .bin dataset")
    pp.add_argument("--out", required=True)
    pp.add_argument("--tokenizer", default="byte", help="'byte' or a Hugging Face tokenizers JSON file")
    pp.add_argument("--text-field", default="text", help="the text of a .jsonl record / .parquet row (default text)")
    pp.add_argument(
        "--workers",
        type=int,
        default=min(8, os.cpu_count() or 1),
        help="tokenizing processes for a tokenizer.json (default: the CPUs, at most 8)",
    )
    pp.add_argument(
        "--format",
        choices=("text", "sft"),
        default="text",
        help="text: documents; sft: prompt/response records, the loss counting the responses only",
    )
    pp.add_argument("--prompt-field", default="prompt")
    pp.add_argument("--completion-field", default="completion")
    pp.add_argument(
        "--messages-field",
        default="messages",
        help="a chat: a list of {role, content} messages, "
        "the assistant's counted (used where a record has it, else prompt/completion)",
    )
    pp.add_argument(
        "--pack",
        type=int,
        metavar="SEQ_LEN",
        help="pack whole documents into windows for data.seq_len=SEQ_LEN (default: cut a token stream)",
    )
    pp.add_argument(
        "--too-long",
        choices=TOO_LONG,
        default="refuse",
        help="with --pack, a document longer than a window is refused (default), split or dropped",
    )
    pp.add_argument("inputs", nargs="+")
    pt = sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer (tokenizer.json) on a corpus")
    pt.add_argument("--out", required=True)
    pt.add_argument("--vocab-size", type=int, default=8192)
    pt.add_argument("--text-field", default="text")
    pt.add_argument("inputs", nargs="+")
    pi = sub.add_parser("info", help="show a dataset's metadata and window counts")
    pi.add_argument("path")
    pi.add_argument("--seq-len", type=int, default=128)
    pi.add_argument("--val-fraction", type=float, default=0.01)
    args = p.parse_args(argv)
    if args.cmd == "prepare":
        _prepare(args)
    elif args.cmd == "tokenizer":
        size = train_tokenizer(args.inputs, args.out, args.vocab_size, args.text_field)
        print(f"wrote {args.out}: byte-level BPE, {size} tokens (use it with data.tokenizer={args.out})")
        if size < args.vocab_size:  # BPE ran out of pairs to merge: the corpus is too small for the size asked
            print(
                f"note: the corpus gave {size:,} tokens, fewer than --vocab-size {args.vocab_size}: set "
                f"model.vocab_size={size} (or more) to train with it, or give a larger corpus for "
                f"{args.vocab_size:,}",
                file=sys.stderr,
            )
    else:
        if args.seq_len < 1 or not 0 <= args.val_fraction < 1:
            raise UserError("need --seq-len >= 1 and 0 <= --val-fraction < 1")
        meta = read_meta(args.path)
        packed = meta.get("window", 1)
        w = packed if packed > 1 else args.seq_len + 1
        (a, b), (c, d) = (split_range(meta["num_tokens"], args.val_fraction, s, packed) for s in ("train", "val"))
        print(json.dumps(meta, indent=2))
        print(f"seq_len={w - 1}: {(b - a) // w} train windows, {(d - c) // w} val windows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
