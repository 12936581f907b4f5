"""Sample text from a trained torchpar model.

    python -m torchpar.generate --run runs/torchpar/gpt2-tiny --prompt "def " [--max-new-tokens N
        --temperature 0.8 --top-k 40 --top-p 0.95 --seed 0 --num-samples 1]

Samples from a trained torchpar model: the latest checkpoint of a none / ddp / fsdp run (`--run`, loaded on
one process: DCP reshards) or a shared-weights file (`--weights`, e.g. written by jaxpar). Decoding uses a
KV cache (torchpar/decode.py); temperature 0 is greedy and gives jaxpar.generate's tokens on the same weights.
"""

from __future__ import annotations

import sys

import torch

from jaxpar.core.config.schema import config_for_weights
from jaxpar.core.errors import UserError, cli
from jaxpar.core.run.resume import read_run_config
from jaxpar.core.run.directory import check_framework
from jaxpar.core.sampling_cli import check_sampling, decodable_tokens, print_samples, sampling_parser
from jaxpar.core.data.tokens import document_token, text_codec
from jaxpar.core.weights.names import model_dims, read_settings, read_weights
from torchpar import dist
from torchpar.decode import generate
from torchpar.models.decoder import Decoder
from torchpar.parallelize import parallelize
from torchpar.weights import from_shared


def load_model(args, doing: str = "sample"):
    """(model, tokenizer, step) of the source the user named (step: the checkpoint's, 0 for a weights file)."""
    if args.run:
        check_framework(args.run, "torchpar", doing)
        cfg = read_run_config(args.run)
        cfg.run.dir = args.run  # where the run is now (config.json holds where it was trained)
        model = Decoder(cfg.model, document_token(cfg))
        env = dist.init(False, cfg.run.peer_timeout_s)
        # the none backend's engine restores the run's checkpoint; decoding compiles nothing and, without gradients,
        # recomputes nothing
        engine = parallelize(model, cfg, env, "none", compile_model=False)[0]
        meta = engine.checkpointer.restore(params_only=True)
        if meta is None:
            raise UserError(f"no checkpoint in {args.run}/checkpoints")
        return model, args.tokenizer or cfg.data.tokenizer, int(meta["step"])
    flat = read_weights(args.weights)
    cfg = config_for_weights(model_dims(flat, read_settings(args.weights)))
    model = Decoder(cfg.model)
    model.load_state_dict(from_shared(flat, cfg.model.n_layer))
    return model, args.tokenizer or "byte", 0


# where the weights come from (torchpar.eval's too): option -> help
SOURCES = {
    "run": "a torchpar run directory (none, ddp or fsdp): its latest checkpoint and config",
    "weights": "a .safetensors file in the shared weight format",
}


def parse_args(argv):
    return sampling_parser("python -m torchpar.generate", __doc__, SOURCES).parse_args(argv)


def sample_rows(args) -> tuple[list[list[int]], object]:
    """(the continuations' token ids, the tokenizer's decoder) of the command's arguments."""
    check_sampling(args)
    model, tokenizer, _ = load_model(args)
    encode, decode = text_codec(tokenizer)
    ids = encode(args.prompt)
    new_tokens = decodable_tokens(model.cfg, len(ids), args.max_new_tokens)
    prompt = torch.tensor([ids] * args.num_samples, device=next(model.parameters()).device)
    rows = generate(model.eval(), prompt, new_tokens, args.seed, args.temperature, args.top_k, args.top_p)
    return rows.tolist(), decode


@cli
def main(argv=None) -> int:
    args = parse_args(argv)
    rows, decode = sample_rows(args)
    print_samples(args.prompt, rows, decode)
    return 0


if __name__ == "__main__":
    sys.exit(main())
