"""Sample text from a trained jaxpar model, a shared-weights file or a Hugging Face directory.

python -m jaxpar.generate --run runs/jaxpar/gpt2-tiny --prompt "def " [--max-new-tokens N] [--temperature 0.8
    --top-k 40 --top-p 0.95 --seed 0 --num-samples 1 --mesh tp=4]

Samples from a trained model: the latest checkpoint of a jaxpar run (`--run`, any family or variant, with its
tokenizer), a shared-weights file (`--weights`) or a Hugging Face directory that convert reads (`--hf`: GPT-2, Llama,
Mixtral, DeepSeek-V3); `--tokenizer` names the tokenizer, by default the run's, an HF directory's own
tokenizer.json, else byte-level. Decoding uses a KV cache in one jitted loop (jaxpar/decode.py) on any dp / fsdp /
tp mesh; temperature 0 is greedy.
"""

from __future__ import annotations

import sys

from jaxpar.core.config.schema import Config, config_for_weights
from jaxpar.core.errors import UserError, cli
from jaxpar.core.config.mesh_spec import parse_mesh
from jaxpar.core.run.resume import read_run_config
from jaxpar.core.run.directory import check_framework
from jaxpar.core.sampling_cli import check_sampling, decodable_tokens, print_samples, sampling_parser
from jaxpar.core.data.tokens import document_token, text_codec
from jaxpar.core.weights.names import unflatten
from jaxpar.formats.hf_tokenizer import source_tokenizer
from jaxpar.formats.weights_io import read
from jaxpar.mesh import make_mesh, setup_devices


# where the weights come from (jaxpar.eval's too): option -> help
SOURCES = {
    "run": "a jaxpar run directory: its latest checkpoint and config",
    "weights": "a .safetensors file in the shared weight format",
    "hf": "a Hugging Face GPT-2, Llama, Mixtral or DeepSeek-V3 directory (config.json + safetensors)",
}


def parse_args(argv):
    p = sampling_parser("python -m jaxpar.generate", __doc__, SOURCES)
    p.add_argument("--mesh", default="dp=1", help="dp / fsdp / tp axes (default dp=1)")
    return p.parse_args(argv)


def check_decoding(args) -> dict[str, int]:
    """The sampling flags, and a mesh decoding runs on: its sizes."""
    check_sampling(args)
    sizes = parse_mesh(args.mesh)
    if sizes.get("pp", 1) != 1 or sizes.get("sp", 1) != 1:
        raise UserError(f"--mesh {args.mesh}: decoding runs on dp / fsdp / tp axes only")
    return sizes


def load(args) -> tuple[Config, dict | None, str]:
    """(config, flat shared weights, tokenizer) of the source the user named.

    A run's weights (None here) are restored by sample_rows straight onto the decoding mesh, whatever the model's
    variant (the shared format holds GPT-2's and llama's parameters only).
    """
    if args.run:
        cfg = read_run_config(args.run)
        return cfg, None, args.tokenizer or cfg.data.tokenizer
    flat, model = read("hf" if args.hf else "shared", args.hf or args.weights)
    cfg = config_for_weights(model)
    return cfg, flat, args.tokenizer or (source_tokenizer(args.hf) if args.hf else None) or "byte"


@cli
def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    sizes = check_decoding(args)
    if args.run:
        check_framework(args.run, "jaxpar", "sample")
    setup_devices(sizes)  # before anything starts jax (reading a run's checkpoint does)
    cfg, flat, tokenizer = load(args)
    encode, decode = text_codec(tokenizer)
    prompt = encode(args.prompt)
    args.max_new_tokens = decodable_tokens(cfg.model, len(prompt), args.max_new_tokens)  # what sample_rows reads
    print_samples(args.prompt, sample_rows(cfg, sizes, flat, prompt, args), decode)
    return 0


def sample_rows(cfg: Config, sizes: dict, flat: dict, prompt: list[int], args) -> list[list[int]]:
    import jax  # deferred: jax (~1 s), after setup_devices
    import jax.numpy as jnp  # deferred: jax (~1 s), after setup_devices

    from jaxpar.context import use  # deferred: imports jax, after setup_devices
    from jaxpar.decode import make_generate  # deferred: imports jax, after setup_devices
    from jaxpar.layout import Layout  # deferred: imports jax, after setup_devices
    from jaxpar.models.decoder import abstract_model  # deferred: imports jax, after setup_devices
    from jaxpar.parallelize import parallel_context  # deferred: imports jax, after setup_devices

    layout = Layout(cfg, make_mesh(sizes))
    params = restore_params(args.run, layout)[0] if flat is None else unflatten(flat)
    params = jax.device_put(params, layout.device_shardings["params"])  # on the devices even if the run offloaded
    with use(parallel_context(layout)):
        out = make_generate(abstract_model(cfg.model)[0], document_token(cfg))(
            params,
            jnp.asarray([prompt] * args.num_samples, jnp.int32),
            jax.random.key(args.seed),
            new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
        )
    return jax.device_get(out).tolist()


def restore_params(run: str, layout) -> tuple[dict, int]:
    """(parameters, step) of a run's latest checkpoint, the parameters in the layout's shardings (orbax reshards)."""
    from jaxpar.checkpoint import Checkpointer  # deferred: orbax, jax (~1 s), after setup_devices
    from jaxpar.state import restore_latest  # deferred: imports jax, after setup_devices

    restored = restore_latest(Checkpointer(run, layout.cfg.checkpoint.keep), layout, params_only=True)
    if restored is None:
        raise UserError(f"no checkpoint in {run}/checkpoints")
    return restored[0]["params"], int(restored[1]["step"])


if __name__ == "__main__":
    sys.exit(main())
