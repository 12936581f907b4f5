"""The command line shared by `python -m jaxpar.generate` and `python -m torchpar.generate`.

Where the weights come from (the eval commands' too), the prompt, the sampling settings, their checks and how samples
are printed.
"""

from __future__ import annotations

import argparse

from jaxpar.core.config.schema import ModelConfig
from jaxpar.core.errors import UserError


DEFAULT_NEW_TOKENS = 200


def source_parser(
    prog: str, doc: str, sources: dict[str, str], run_alias: str | None = None
) -> argparse.ArgumentParser:
    """A parser with where the weights come from and their tokenizer (the sampling and evaluation commands').

    `sources`: option name -> help, one of which the user must give (e.g. run, weights); `run_alias`: a second name
    for --run.
    """
    p = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    for name, help_text in sources.items():
        aliases = [run_alias] if name == "run" and run_alias else []
        src.add_argument(f"--{name}", *aliases, dest=name, help=help_text)
    p.add_argument("--tokenizer", help="'byte' or a tokenizer.json (default: the run's, else byte)")
    return p


def sampling_parser(prog: str, doc: str, sources: dict[str, str]) -> argparse.ArgumentParser:
    """`sources`: option name -> help, one of which the user must give (e.g. run, weights)."""
    p = source_parser(prog, doc, sources)
    p.add_argument("--prompt", required=True)
    p.add_argument(
        "--max-new-tokens",
        type=int,
        help=f"default: what the model's context leaves after the prompt, at most {DEFAULT_NEW_TOKENS}",
    )
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus: the smallest set holding this much mass")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-samples", type=int, default=1)
    return p


def check_sampling(args) -> None:
    if (args.max_new_tokens is not None and args.max_new_tokens < 1) or args.num_samples < 1:
        raise UserError("--max-new-tokens and --num-samples must be at least 1")
    if args.temperature < 0 or args.top_k < 0 or not 0 < args.top_p <= 1:
        raise UserError("--temperature and --top-k must be >= 0 and --top-p in (0, 1]")


def decodable_tokens(cfg: ModelConfig, prompt_len: int, asked: int | None) -> int:
    """How many tokens to decode.

    --max-new-tokens, else as many as the context leaves after the prompt (at most DEFAULT_NEW_TOKENS), so that a
    small model samples by default. Checked for what both decoders (jaxpar/decode.py, torchpar/decode.py; every
    family and variant) need: a prompt, the context.
    """
    if prompt_len < 1:
        raise UserError("the prompt is empty: give at least one token")
    room = cfg.max_seq_len - prompt_len
    if room < 1:
        raise UserError(
            f"the prompt ({prompt_len} tokens) fills the model's max_seq_len {cfg.max_seq_len}: no room "
            "for new tokens; shorten it"
        )
    new_tokens = min(DEFAULT_NEW_TOKENS, room) if asked is None else asked
    if new_tokens > room:
        raise UserError(
            f"prompt ({prompt_len} tokens) + {new_tokens} new tokens exceed the model's max_seq_len "
            f"{cfg.max_seq_len}: ask for at most --max-new-tokens {room} (or leave it out)"
        )
    return new_tokens


def print_samples(prompt: str, rows: list[list[int]], decode) -> None:
    for i, row in enumerate(rows):
        if len(rows) > 1:
            print(f"--- sample {i + 1}/{len(rows)}")
        print(prompt + decode(row))
