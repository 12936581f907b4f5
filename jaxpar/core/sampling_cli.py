"""The command line shared by `python -m jaxpar.generate` and `python -m torchpar.generate`: where the weights
come from, the prompt, the sampling settings, their checks and how samples are printed."""
from __future__ import annotations

import argparse

from jaxpar.core.config import ModelConfig
from jaxpar.core.errors import UserError


def sampling_parser(prog: str, doc: str, sources: dict[str, str]) -> argparse.ArgumentParser:
    """`sources`: option name -> help, one of which the user must give (e.g. run, weights)."""
    p = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    for name, help_text in sources.items():
        src.add_argument(f"--{name}", help=help_text)
    p.add_argument("--tokenizer", help="'byte' or a tokenizer.json (default: the run's, else byte)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus: the smallest set holding this much mass")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-samples", type=int, default=1)
    return p


def check_sampling(args) -> None:
    if args.max_new_tokens < 1 or args.num_samples < 1:
        raise UserError("--max-new-tokens and --num-samples must be at least 1")
    if args.temperature < 0 or args.top_k < 0 or not 0 < args.top_p <= 1:
        raise UserError("--temperature and --top-k must be >= 0 and --top-p in (0, 1]")


def check_decodable(cfg: ModelConfig, prompt_len: int, new_tokens: int) -> None:
    """What both decoders (jaxpar/decode.py, torchpar/decode.py; every family and variant) need: a prompt, the
    context."""
    if prompt_len < 1:
        raise UserError("the prompt is empty: give at least one token")
    if prompt_len + new_tokens > cfg.max_seq_len:
        raise UserError(f"prompt ({prompt_len} tokens) + {new_tokens} new tokens exceed the model's "
                        f"max_seq_len {cfg.max_seq_len}")


def print_samples(prompt: str, rows: list[list[int]], decode) -> None:
    for i, row in enumerate(rows):
        if len(rows) > 1:
            print(f"--- sample {i + 1}/{len(rows)}")
        print(prompt + decode(row))
