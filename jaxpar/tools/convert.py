"""python -m jaxpar.tools.convert --from FORMAT SRC --to FORMAT DST

Formats:
  shared  a .safetensors file in the shared weight format (what torchpar and model.init_from read)
  hf      a Hugging Face GPT-2, Llama, Mixtral or DeepSeek-V3 directory (config.json + safetensors; model_type gpt2,
          llama, mixtral or deepseek_v3)
  jaxpar  a jaxpar run directory: reads the parameters of its latest checkpoint; as a target,
          writes a step-0 checkpoint (fresh optimizer state) and its config.json, which fine-tuning
          starts from: `jaxpar.train --config DST/config.json [data/train overrides]` (the model keys
          must stay; data and batch keys may change until the run has trained)
  state   the shared training-state file (jaxpar/core/state_file.py): the whole training state (parameters,
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
import json
import os
import sys

import numpy as np

from jaxpar.core.errors import UserError, cli
from jaxpar.core.state_file import refuse_mixing, writing_run
from jaxpar.core.weights import SETTINGS, flatten, model_dims, read_settings, read_weights, save_weights, unflatten
from jaxpar.tools import hf_deepseek_v3, hf_gpt2, hf_llama, hf_mixtral, hf_tokenizer
from jaxpar.tools.convert_state import single_device_layout

FORMATS = ("shared", "hf", "jaxpar", "state", "torchpar", "deepspeed")
RUNS = ("jaxpar", "torchpar", "deepspeed")  # formats a whole training state converts between, with "state"


def read(fmt: str, src: str) -> tuple[dict[str, np.ndarray], dict]:
    """-> (flat shared tensors, model config overrides)."""
    if fmt == "hf":
        return _hf_module(src).hf_to_shared(src)
    if fmt == "shared":
        flat = read_weights(src)
        return flat, model_dims(flat, read_settings(src))
    if fmt in ("state", "torchpar"):
        return _state_weights(fmt, src)
    from jaxpar.checkpoint import Checkpointer
    from jaxpar.core.resume import read_run_config
    from jaxpar.state import restore_latest

    cfg = read_run_config(src)
    if cfg.model.attention == "dilated" or cfg.model.linear != "dense":  # (gpt2's mla: model_dims refuses it)
        raise UserError(f"{src} trains model.attention={cfg.model.attention}, model.linear={cfg.model.linear}; "
                        "conversion supports only mha attention (llama's mla too) and dense layers")
    restored = restore_latest(Checkpointer(src, cfg.checkpoint.keep), single_device_layout(cfg))
    if restored is None:
        raise UserError(f"no checkpoint in {src}/checkpoints")
    flat = {k: np.asarray(v) for k, v in flatten(restored[0]["params"]).items()}
    return flat, model_dims(flat, {k: getattr(cfg.model, k) for k in SETTINGS})


def _state_weights(fmt: str, src: str) -> tuple[dict[str, np.ndarray], dict]:
    """The parameters of a training-state file, or of a torchpar run's latest checkpoint (through a state file)."""
    import tempfile

    from jaxpar.core.config import config_from_dict
    from jaxpar.core.state_file import read_state

    if fmt == "torchpar":
        with tempfile.TemporaryDirectory() as tmp:
            state = os.path.join(tmp, "state.safetensors")
            _export(fmt, src, state)
            return _state_weights("state", state)
    tensors, meta = read_state(src)
    cfg = config_from_dict(meta["config"])
    flat = tensors["param"]
    return flat, model_dims(flat, {k: getattr(cfg.model, k) for k in SETTINGS})


def _hf_module(src: str):
    path = os.path.join(src, "config.json")
    if not os.path.exists(path):
        raise UserError(f"not a Hugging Face model directory: {path} is missing")
    with open(path) as f:
        model_type = json.load(f).get("model_type")
    modules = {"gpt2": hf_gpt2, "llama": hf_llama, "mixtral": hf_mixtral, "deepseek_v3": hf_deepseek_v3}
    if model_type not in modules:
        raise UserError(f"{path}: model_type {model_type!r} is not one of {', '.join(modules)}")
    return modules[model_type]


def write(fmt: str, dst: str, flat: dict[str, np.ndarray], model: dict, src: str = "") -> None:
    if fmt == "hf" and model.get("mtp_depth") and model.get("attention") != "mla":
        raise UserError(f"the Hugging Face GPT-2, Llama and Mixtral formats have no place for multi-token prediction's "
                        f"modules (model.mtp_depth={model['mtp_depth']}); convert to shared, jaxpar or state instead")
    if fmt == "shared":
        save_weights(dst, unflatten(flat), model)
    elif fmt == "hf" and model.get("family") == "llama":
        llama = hf_mixtral if "blocks.moe.gate" in flat else hf_llama
        (hf_deepseek_v3 if model.get("attention") == "mla" else llama).shared_to_hf(flat, dst, model)
    elif fmt == "hf":
        hf_gpt2.shared_to_hf(flat, dst, model.get("layernorm_eps", 1e-5))
    else:
        from jaxpar.checkpoint import Checkpointer
        from jaxpar.core.config import config_for_weights
        from jaxpar.state import state_from_params

        own = hf_tokenizer.source_tokenizer(src) if src and os.path.isdir(src) else None  # an HF source's
        cfg = config_for_weights(model, f"run.dir={dst}", *([f"data.tokenizer={own}"] if own else []))
        state = state_from_params(single_device_layout(cfg), unflatten(flat))
        with writing_run(dst):
            with open(os.path.join(dst, "config.json"), "w") as f:
                json.dump({**cfg.to_dict(), "converted_from": os.path.abspath(src)}, f, indent=2)
            ckpt = Checkpointer(dst, cfg.checkpoint.keep)
            ckpt.save(0, state, {"step": 0, "data_step": 0, "mesh": "dp=1"})
            ckpt.close()


@cli
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxpar.tools.convert", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="src_fmt", choices=FORMATS, required=True)
    p.add_argument("src")
    p.add_argument("--to", dest="dst_fmt", choices=FORMATS, required=True)
    p.add_argument("dst")
    p.add_argument("--zero-stage", choices=("0", "1", "2", "3"), help="--to deepspeed: the new run's ZeRO stage")
    p.add_argument("--tokenizer", help="--to hf: 'byte' or a tokenizers JSON file to export with the weights "
                   "(default: the run's data.tokenizer, an HF source's own, byte for a vocabulary of 256)")
    args = p.parse_intermixed_args(argv)
    if args.zero_stage is not None and args.dst_fmt != "deepspeed":
        raise UserError("--zero-stage is for --to deepspeed")
    if args.tokenizer is not None and args.dst_fmt != "hf":
        raise UserError("--tokenizer is for --to hf")
    if args.dst_fmt == "hf" and os.path.isdir(args.dst) and os.listdir(args.dst) and not (
            args.src_fmt == "hf" and os.path.samefile(args.src, args.dst)):  # in place: its own files, read first
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
    tokenizer = _hf_tokenizer(args, model["vocab_size"]) if args.dst_fmt == "hf" else None  # before writing
    write(args.dst_fmt, args.dst, flat, model, args.src)
    print(f"converted {args.src_fmt} {args.src} -> {args.dst_fmt} {args.dst} ({len(flat)} tensors)")
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
    from jaxpar.core.run_dir import framework_of

    held_by = framework_of(src)
    if held_by not in (None, fmt):
        raise UserError(f"--from {fmt} {src}: it holds a {held_by} run; convert it with --from {held_by}")


def _hf_tokenizer(args, vocab_size: int) -> hf_tokenizer.Choice:
    """What a Hugging Face export carries (hf_tokenizer.choose) for this source and --tokenizer."""
    run_tokenizer = None
    if args.src_fmt in ("jaxpar", "torchpar"):
        from jaxpar.core.resume import read_run_config

        run_tokenizer = read_run_config(args.src).data.tokenizer
    return hf_tokenizer.choose(vocab_size, args.tokenizer, run_tokenizer, args.src if args.src_fmt == "hf" else None)


def _whole_state(args) -> int:
    """run or state file -> run or state file, through a state file beside the destination where neither is one."""
    import tempfile

    src, dst = args.src_fmt, args.dst_fmt
    if src not in (*RUNS[:2], "state") or dst not in (*RUNS, "state") or src == dst == "state" or \
            (src, dst) == ("jaxpar", "jaxpar"):
        raise UserError(f"--from {src} --to {dst}: the training state converts from a jaxpar or torchpar run or a "
                        "state file to a jaxpar, torchpar or deepspeed run or a state file")
    if dst in RUNS:  # before anything is read or written
        refuse_mixing(args.dst)
    if src != "state" and dst != "state":
        parent = os.path.dirname(os.path.abspath(args.dst))
        os.makedirs(parent, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=parent) as tmp:
            state = os.path.join(tmp, "state.safetensors")
            _export(src, args.src, state)
            step = _import(state, dst, args.dst, args.zero_stage)
    else:
        step = _export(src, args.src, args.dst) if dst == "state" else _import(args.src, dst, args.dst, args.zero_stage)
    print(f"converted the training state of step {step}: {src} {args.src} -> {dst} {args.dst}")
    return 0


def _export(fmt: str, run_dir: str, state: str) -> int:
    from jaxpar.tools.convert_state import export_state

    return export_state(run_dir, state) if fmt == "jaxpar" else _torchpar("--from", "torchpar", run_dir, "--to",
                                                                           "state", state)


def _import(state: str, fmt: str, run_dir: str, zero_stage: str | None) -> int:
    from jaxpar.tools.convert_state import import_state

    if fmt == "jaxpar":
        return import_state(state, run_dir)
    return _torchpar("--from", "state", state, "--to", fmt, run_dir, *(("--zero-stage", zero_stage) if zero_stage
                                                                        else ()))


def _torchpar(*args: str) -> int:
    """python -m torchpar.tools.convert ARGS: the step it converted, or its error line as ours."""
    import re
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "torchpar.tools.convert", *args], capture_output=True, text=True)
    done = re.search(r"converted the training state of step (\d+)", proc.stdout)
    if proc.returncode or not done:
        line = next((ln for ln in reversed(proc.stderr.splitlines()) if ln.startswith("error:")), None)
        if line is None:  # not a refusal: a bug, whose traceback is the report
            raise RuntimeError(f"torchpar.tools.convert {' '.join(args)} failed (exit {proc.returncode}):\n"
                               f"{proc.stderr[-4000:]}")
        raise UserError(f"torchpar.tools.convert {' '.join(args)} failed: {line.removeprefix('error: ')}")
    return int(done.group(1))


if __name__ == "__main__":
    sys.exit(main())
