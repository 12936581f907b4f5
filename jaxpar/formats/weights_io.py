"""Weights and training states in every format the converter knows: read, write, and whole states through a file.

`python -m jaxpar.tools.convert` is the command line over these; `python -m jaxpar.generate --hf/--weights` reads
with `read`. The torchpar side of a whole state runs as `python -m torchpar.tools.convert` in a subprocess (jaxpar
does not import torch).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import numpy as np

from jaxpar.core.config.schema import config_for_weights, config_from_dict
from jaxpar.core.errors import UserError
from jaxpar.core.run.resume import read_run_config
from jaxpar.core.weights.names import (
    SETTINGS,
    flatten,
    model_dims,
    read_settings,
    read_weights,
    save_weights,
    unflatten,
)
from jaxpar.formats import hf_deepseek_v3, hf_gpt2, hf_gpt_oss, hf_llama, hf_mixtral, hf_qwen3, hf_tokenizer
from jaxpar.core.weights.state_file import read_state, writing_run

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
    from jaxpar.checkpoint import Checkpointer  # deferred: orbax, jax (~1 s): hf and shared conversions skip it
    from jaxpar.formats.train_state import single_device_layout  # deferred: imports jax: hf/shared conversions skip it
    from jaxpar.state import restore_latest  # deferred: imports jax: hf/shared conversions skip it

    cfg = read_run_config(src)
    if cfg.model.attention == "dilated" or cfg.model.linear != "dense":  # (gpt2's mla: model_dims refuses it)
        raise UserError(
            f"{src} trains model.attention={cfg.model.attention}, model.linear={cfg.model.linear}; "
            "conversion supports only mha attention (llama's mla too) and dense layers"
        )
    restored = restore_latest(Checkpointer(src, cfg.checkpoint.keep), single_device_layout(cfg), params_only=True)
    if restored is None:
        raise UserError(f"no checkpoint in {src}/checkpoints")
    flat = {k: np.asarray(v) for k, v in flatten(restored[0]["params"]).items()}
    return flat, model_dims(flat, {k: getattr(cfg.model, k) for k in SETTINGS})


def _state_weights(fmt: str, src: str) -> tuple[dict[str, np.ndarray], dict]:
    """The parameters of a training-state file, or of a torchpar run's latest checkpoint.

    A DCP run's through a weights file (torchpar.tools.convert --to shared: a DiLoCo run's synchronised parameters), a
    DeepSpeed run's through a state file.
    """
    if fmt == "torchpar":
        with tempfile.TemporaryDirectory() as tmp:
            if not os.path.exists(os.path.join(src, "checkpoints", "latest")):  # DCP: the parameters alone
                weights = os.path.join(tmp, "weights.safetensors")
                torchpar_convert("--from", "torchpar", src, "--to", "shared", weights)
                flat, settings = read_weights(weights), read_run_config(src).model
                return flat, model_dims(flat, {k: getattr(settings, k) for k in SETTINGS})
            state = os.path.join(tmp, "state.safetensors")  # DeepSpeed's, through its state
            export_run_state(fmt, src, state)
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
    modules = {
        "gpt2": hf_gpt2,
        "llama": hf_llama,
        "mixtral": hf_mixtral,
        "deepseek_v3": hf_deepseek_v3,
        "qwen3": hf_qwen3,
        "qwen3_moe": hf_qwen3,
        "gpt_oss": hf_gpt_oss,
    }
    if model_type not in modules:
        raise UserError(f"{path}: model_type {model_type!r} is not one of {', '.join(modules)}")
    return modules[model_type]


def without_mtp(flat: dict[str, np.ndarray], model: dict) -> tuple[dict[str, np.ndarray], dict, str]:
    """(the main model's tensors, its config, what was left out) of weights with multi-token prediction's modules.

    No Hugging Face causal-LM class holds those modules (DeepSeek's checkpoints keep them as an extra layer that
    transformers skips): a Hugging Face export is the main model, which is all that sampling runs. "" when none.
    """
    mtp = {k: v for k, v in flat.items() if k.startswith("mtp.")}
    if not mtp:
        return flat, model, ""
    n = sum(v.size for v in mtp.values())
    depth = mtp["mtp.proj.kernel"].shape[0]
    note = (
        f"multi-token prediction's {depth} module(s) ({n:,} parameters; model.mtp_depth={depth}): Hugging Face's "
        "models have none and sampling does not run them; --to shared, jaxpar or state keeps them"
    )
    return {k: v for k, v in flat.items() if k not in mtp}, {**model, "mtp_depth": 0}, note


def hf_family(flat: dict[str, np.ndarray], model: dict):
    """The module of the Hugging Face family whose checkpoints hold these tensors."""
    if model.get("family") != "llama":
        return hf_gpt2
    if model.get("attention") == "mla":
        return hf_deepseek_v3
    if "blocks.attn.sinks" in flat or "blocks.moe.gate_bias" in flat:  # gpt-oss's sinks and expert biases
        return hf_gpt_oss
    if "blocks.attn.k_norm.scale" in flat:  # model.qk_norm: Qwen3 (with experts, Qwen3-MoE)
        return hf_qwen3
    return hf_mixtral if "blocks.moe.gate" in flat else hf_llama


def write(fmt: str, dst: str, flat: dict[str, np.ndarray], model: dict, src: str = "") -> None:
    if fmt == "hf" and model.get("mtp_depth") and model.get("attention") != "mla":
        raise UserError(
            f"the Hugging Face GPT-2, Llama, Mixtral and Qwen3 formats have no place for multi-token prediction's "
            f"modules (model.mtp_depth={model['mtp_depth']}); convert to shared, jaxpar or state instead"
        )
    if fmt == "shared":
        save_weights(dst, unflatten(flat), model)
    elif fmt == "hf":
        family = hf_family(flat, model)
        if model.get("sliding_window") and family not in (hf_qwen3, hf_mixtral, hf_gpt_oss):
            raise UserError(
                f"model.sliding_window={model['sliding_window']}: Hugging Face's {family.__name__.split('_', 1)[1]} "
                "has no sliding window (Qwen3, Qwen3-MoE, Mixtral and gpt-oss have one); convert to shared, jaxpar or "
                "state"
            )
        mixed = model.get("sliding_window") and model.get("full_attention_every")
        if mixed and (family not in (hf_qwen3, hf_gpt_oss) or (family is hf_qwen3 and "blocks.moe.gate" in flat)):
            raise UserError(
                f"model.full_attention_every={model['full_attention_every']}: Hugging Face's "
                f"{family.__name__.split('_', 1)[1]} slides every layer or none (Qwen3 and gpt-oss list each layer's "
                "type); convert to shared, jaxpar or state"
            )
        if family is hf_gpt2:
            hf_gpt2.shared_to_hf(flat, dst, model.get("layernorm_eps", 1e-5))
        else:
            family.shared_to_hf(flat, dst, model)
    else:
        from jaxpar.checkpoint import Checkpointer  # deferred: orbax, jax (~1 s): hf and shared conversions skip it
        from jaxpar.formats.train_state import single_device_layout  # deferred: imports jax
        from jaxpar.state import state_from_params  # deferred: imports jax: hf/shared conversions skip it

        own = hf_tokenizer.source_tokenizer(src) if src and os.path.isdir(src) else None  # an HF source's
        cfg = config_for_weights(model, f"run.dir={dst}", *([f"data.tokenizer={own}"] if own else []))
        state = state_from_params(single_device_layout(cfg), unflatten(flat))
        with writing_run(dst):
            with open(os.path.join(dst, "config.json"), "w") as f:
                json.dump({**cfg.to_dict(), "converted_from": os.path.abspath(src)}, f, indent=2)
            ckpt = Checkpointer(dst, cfg.checkpoint.keep)
            ckpt.save(0, state, {"step": 0, "data_step": 0, "mesh": "dp=1"})
            ckpt.close()


def export_run_state(fmt: str, run_dir: str, state: str) -> int:
    from jaxpar.formats.train_state import export_state  # deferred: imports jax: hf/shared conversions skip it

    return (
        export_state(run_dir, state)
        if fmt == "jaxpar"
        else torchpar_convert("--from", "torchpar", run_dir, "--to", "state", state)
    )


def import_run_state(state: str, fmt: str, run_dir: str, zero_stage: str | None) -> int:
    from jaxpar.formats.train_state import import_state  # deferred: imports jax: hf/shared conversions skip it

    if fmt == "jaxpar":
        return import_state(state, run_dir)
    return torchpar_convert(
        "--from", "state", state, "--to", fmt, run_dir, *(("--zero-stage", zero_stage) if zero_stage else ())
    )


def torchpar_convert(*args: str) -> int:
    """python -m torchpar.tools.convert ARGS: the step it converted, or its error line as ours."""
    proc = subprocess.run([sys.executable, "-m", "torchpar.tools.convert", *args], capture_output=True, text=True)
    done = re.search(r"converted the (?:training state|weights) of step (\d+)", proc.stdout)
    if proc.returncode or not done:
        line = next((ln for ln in reversed(proc.stderr.splitlines()) if ln.startswith("error:")), None)
        if line is None:  # not a refusal: a bug, whose traceback is the report
            raise RuntimeError(
                f"torchpar.tools.convert {' '.join(args)} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
            )
        raise UserError(f"torchpar.tools.convert {' '.join(args)} failed: {line.removeprefix('error: ')}")
    return int(done.group(1))
