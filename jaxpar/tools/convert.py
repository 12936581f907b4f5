"""Converts weights and training states between formats: shared, hf, jaxpar, state, torchpar, deepspeed.

python -m jaxpar.tools.convert --from FORMAT SRC --to FORMAT DST

Formats:
  shared  a .safetensors file in the shared weight format (what torchpar and model.init_from read)
  hf      a Hugging Face GPT-2, Llama, Mixtral, Qwen3, Qwen3-MoE, gpt-oss or DeepSeek-V3 directory (config.json +
          safetensors; model_type gpt2, llama, mixtral, qwen3, qwen3_moe, gpt_oss or deepseek_v3); as a target,
          the main model of weights with multi-token prediction (model.mtp_depth: its modules are left out, and
          the command says so)
  jaxpar  a jaxpar run directory: reads the parameters of its latest checkpoint; as a target,
          writes a step-0 checkpoint (fresh optimizer state) and its config.json, which fine-tuning
          starts from: `jaxpar.train --config DST/config.json [data/train overrides]` (the model keys
          must stay; data and batch keys may change until the run has trained)
  state   the shared training-state file (jaxpar/core/weights/state_file.py): the whole training state (parameters,
          Adam's moments and count -- with optim.name=muon Muon's momentum and count too --, the step, the loss
          scaler, the config), to or from any run format
  torchpar  a torchpar run directory (DCP or DeepSpeed checkpoints), its whole state; as a target, a DCP run
  deepspeed (target only) a DeepSpeed run of one rank (--zero-stage S, default the source config's), which
          `torchpar.train --backend deepspeed` resumes on any number of ranks

Whole-state conversions go through the state file; the torchpar side is python -m torchpar.tools.convert (run
as a subprocess: jaxpar does not import torch), so `--from jaxpar RUN --to torchpar RUN2` is one command and the
new run goes on from the source's step in the other framework.

Every conversion is a lossless reshape/transpose/rename of float32 tensors. The model family (gpt2 or
llama) follows the source; a shared file keeps what shapes cannot tell (context length, eps, rotary base)
in its metadata.

A Hugging Face export is ready for `AutoTokenizer` and `pipeline("text-generation")`: besides the weights it
writes tokenizer.json, tokenizer_config.json, special_tokens_map.json, generation_config.json and config.json's
bos/eos/pad ids, all the end-of-document token (hf_tokenizer.py). The tokenizer is --tokenizer (byte or a
tokenizers JSON file), else an HF source's own (copied), else the run's data.tokenizer, else the byte tokenizer
when the vocabulary has 256 tokens; otherwise the command says in one line that it wrote none. For the byte
tokenizer the ids are the byte values and bos = eos = pad = 0; for a BPE file, its <|endoftext|> id.

How the end-of-document token stops each generator: jaxpar.generate and torchpar.generate do not stop at it; they
decode every --max-new-tokens token (a decoded end-of-document token is a NUL character in byte-level text, left
out of a BPE tokenizer's, and with data.document_mask starts a new document that attends only to itself).
transformers' generate and pipeline stop a row at eos_token_id (0 for bytes) from generation_config.json, so their
text ends where jaxpar's next document would begin.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile


from jaxpar.core.errors import UserError, cli
from jaxpar.core.run.directory import framework_of
from jaxpar.core.run.resume import read_run_config
from jaxpar.core.weights.state_file import refuse_mixing
from jaxpar.formats import hf_tokenizer
from jaxpar.formats.weights_io import FORMATS, RUNS, export_run_state, import_run_state, read, without_mtp, write


@cli
def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jaxpar.tools.convert", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--from", dest="src_fmt", choices=FORMATS, required=True)
    p.add_argument("src")
    p.add_argument("--to", dest="dst_fmt", choices=FORMATS, required=True)
    p.add_argument("dst")
    p.add_argument("--zero-stage", choices=("0", "1", "2", "3"), help="--to deepspeed: the new run's ZeRO stage")
    p.add_argument(
        "--tokenizer",
        help="--to hf: 'byte' or a tokenizers JSON file to export with the weights "
        "(default: the run's data.tokenizer, an HF source's own, byte for a vocabulary of 256)",
    )
    args = p.parse_intermixed_args(argv)
    if args.zero_stage is not None and args.dst_fmt != "deepspeed":
        raise UserError("--zero-stage is for --to deepspeed")
    if args.tokenizer is not None and args.dst_fmt != "hf":
        raise UserError("--tokenizer is for --to hf")
    if (
        args.dst_fmt == "hf"
        and os.path.isdir(args.dst)
        and os.listdir(args.dst)
        and not (args.src_fmt == "hf" and os.path.samefile(args.src, args.dst))
    ):  # in place: its own files, read first
        raise UserError(f"--to hf {args.dst}: the directory is not empty; export into a new one (nothing written)")
    if args.src_fmt == "deepspeed":
        raise UserError("--from deepspeed: deepspeed is a target format; a DeepSpeed run is read with --from torchpar")
    if args.src_fmt in ("jaxpar", "torchpar"):
        check_source(args.src, args.src_fmt)
    if {args.src_fmt, args.dst_fmt} & {"state", "torchpar", "deepspeed"} and args.dst_fmt not in ("hf", "shared"):
        return _whole_state(args)
    if args.dst_fmt == "jaxpar":
        refuse_mixing(args.dst)
    flat, model = read(args.src_fmt, args.src)
    left_out = ""
    if args.dst_fmt == "hf":
        flat, model, left_out = without_mtp(flat, model)
    tokenizer = _hf_tokenizer(args, model["vocab_size"]) if args.dst_fmt == "hf" else None  # before writing
    write(args.dst_fmt, args.dst, flat, model, args.src)
    print(f"converted {args.src_fmt} {args.src} -> {args.dst_fmt} {args.dst} ({len(flat)} tensors)")
    if left_out:
        print(f"left out: {left_out}")
    if tokenizer is not None:
        hf_tokenizer.write(args.dst, tokenizer, model["max_seq_len"])
        if tokenizer.kind is None:
            print(f"no tokenizer written: {tokenizer.why}; name one with --tokenizer byte|FILE")
        else:
            what = {"byte": "byte-level", "file": tokenizer.path, "hf": "copied"}[tokenizer.kind]
            ids = ", ".join(f"{k} {v}" for k, v in tokenizer.ids.items()) or "no special-token ids"
            print(f"tokenizer: {what} ({tokenizer.why}); {ids}")
    return 0


def check_source(src: str, fmt: str) -> None:
    """--from jaxpar on a torchpar run (or the reverse): one line naming the format that reads it."""
    held_by = framework_of(src)
    if held_by not in (None, fmt):
        raise UserError(f"--from {fmt} {src}: it holds a {held_by} run; convert it with --from {held_by}")


def _hf_tokenizer(args, vocab_size: int) -> hf_tokenizer.Choice:
    """What a Hugging Face export carries (hf_tokenizer.choose) for this source and --tokenizer."""
    run_tokenizer = None
    if args.src_fmt in ("jaxpar", "torchpar"):
        run_tokenizer = read_run_config(args.src).data.tokenizer
    return hf_tokenizer.choose(vocab_size, args.tokenizer, run_tokenizer, args.src if args.src_fmt == "hf" else None)


def _whole_state(args) -> int:
    """run or state file -> run or state file, through a state file beside the destination where neither is one."""
    src, dst = args.src_fmt, args.dst_fmt
    if (
        src not in (*RUNS[:2], "state")
        or dst not in (*RUNS, "state")
        or src == dst == "state"
        or (src, dst) == ("jaxpar", "jaxpar")
    ):
        raise UserError(
            f"--from {src} --to {dst}: the training state converts from a jaxpar or torchpar run or a "
            "state file to a jaxpar, torchpar or deepspeed run or a state file"
        )
    if dst in RUNS:  # before anything is read or written
        refuse_mixing(args.dst)
    if src != "state" and dst != "state":
        parent = os.path.dirname(os.path.abspath(args.dst))
        os.makedirs(parent, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=parent) as tmp:
            state = os.path.join(tmp, "state.safetensors")
            export_run_state(src, args.src, state)
            step = import_run_state(state, dst, args.dst, args.zero_stage)
    else:
        step = (
            export_run_state(src, args.src, args.dst)
            if dst == "state"
            else import_run_state(args.src, dst, args.dst, args.zero_stage)
        )
    print(f"converted the training state of step {step}: {src} {args.src} -> {dst} {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
