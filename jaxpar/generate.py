"""python -m jaxpar.generate --run runs/gpt2-tiny --prompt "def " [--max-new-tokens 200] [--temperature 0.8
    --top-k 40 --top-p 0.95 --seed 0 --num-samples 1 --mesh tp=4]

Samples from a trained model: the latest checkpoint of a jaxpar run (`--run`, with its tokenizer), a
shared-weights file (`--weights`) or a Hugging Face GPT-2 directory (`--hf`; both with `--tokenizer`,
default byte-level). Decoding uses a KV cache in one jitted loop (jaxpar/decode.py) on any dp / fsdp / tp
mesh; temperature 0 is greedy.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from jaxpar.core.config import Config, config_from_dict, load_config
from jaxpar.core.errors import UserError, cli
from jaxpar.core.mesh_spec import parse_mesh
from jaxpar.core.tokens import text_codec
from jaxpar.mesh import setup_devices


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m jaxpar.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", help="a jaxpar run directory: its latest checkpoint and config")
    src.add_argument("--weights", help="a .safetensors file in the shared weight format")
    src.add_argument("--hf", help="a Hugging Face GPT-2 directory (config.json + model.safetensors)")
    p.add_argument("--tokenizer", help="'byte' or a tokenizer.json (default: the run's, else byte)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus: the smallest set holding this much mass")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--mesh", default="dp=1", help="dp / fsdp / tp axes (default dp=1)")
    return p.parse_args(argv)


def check(args) -> dict[str, int]:
    if args.max_new_tokens < 1 or args.num_samples < 1:
        raise UserError("--max-new-tokens and --num-samples must be at least 1")
    if args.temperature < 0 or args.top_k < 0 or not 0 < args.top_p <= 1:
        raise UserError("--temperature and --top-k must be >= 0 and --top-p in (0, 1]")
    sizes = parse_mesh(args.mesh)
    if sizes.get("pp", 1) != 1 or sizes.get("sp", 1) != 1:
        raise UserError(f"--mesh {args.mesh}: decoding runs on dp / fsdp / tp axes only")
    return sizes


def load(args) -> tuple[Config, dict, str]:
    """(config, flat shared weights, tokenizer) of the source the user named."""
    from jaxpar.tools.convert import read

    if args.run:
        path = os.path.join(args.run, "config.json")
        if not os.path.isfile(path):
            raise UserError(f"not a jaxpar run directory: {path} is missing")
        with open(path) as f:
            saved = json.load(f)
        saved.pop("resolved_mesh", None)
        cfg = config_from_dict(saved)
        return cfg, read("jaxpar", args.run)[0], args.tokenizer or cfg.data.tokenizer
    flat, model = read("hf" if args.hf else "shared", args.hf or args.weights)
    cfg = load_config(None, [f"model.{k}={v}" for k, v in model.items()] + [f"data.seq_len={model['max_seq_len']}"])
    return cfg, flat, args.tokenizer or "byte"


@cli
def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    sizes = check(args)
    setup_devices(sizes)  # before anything starts jax (reading a run's checkpoint does)
    cfg, flat, tokenizer = load(args)
    encode, decode = text_codec(tokenizer)
    prompt = encode(args.prompt)
    from jaxpar.decode import check_decodable

    check_decodable(cfg.model, len(prompt), args.max_new_tokens)
    rows = sample_rows(cfg, sizes, flat, prompt, args)
    for i, row in enumerate(rows):
        if len(rows) > 1:
            print(f"--- sample {i + 1}/{len(rows)}")
        print(args.prompt + decode(row))
    return 0


def sample_rows(cfg: Config, sizes: dict, flat: dict, prompt: list[int], args) -> list[list[int]]:
    import jax
    import jax.numpy as jnp

    from jaxpar.context import use
    from jaxpar.core.weights import unflatten
    from jaxpar.decode import make_generate
    from jaxpar.layout import Layout
    from jaxpar.mesh import make_mesh
    from jaxpar.models.gpt import abstract_model
    from jaxpar.parallelize import parallel_context

    layout = Layout(cfg, make_mesh(sizes))
    params = jax.device_put(unflatten(flat), layout.state_shardings["params"])
    with use(parallel_context(layout)):
        out = make_generate(abstract_model(cfg.model)[0])(
            params, jnp.asarray([prompt] * args.num_samples, jnp.int32), jax.random.key(args.seed),
            new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    return jax.device_get(out).tolist()


if __name__ == "__main__":
    sys.exit(main())
