"""Run reference configs on jaxpar layouts and torchpar backends, as a user would, and read them back.

Every run of a config starts from one exported initial-weights file (`python -m jaxpar.train
--write-init` with another seed than the runs train with, then `model.init_from`), reads the same
synthetic token file, logs every step (`metrics.jsonl`) and writes its final weights in the shared
weight format (`--write-final`). Runs are subprocesses (simulated CPU devices for jaxpar,
`torch.distributed.run` over gloo for torchpar), checked for aborts and leftover processes by
tests/torchpar/test_torchpar.py's helpers, and cached by (side, resolved config), so a run several comparisons
need (the jaxpar one-device reference) runs once.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxpar.core.config.schema import load_config
from jaxpar.core.config.mesh_spec import parse_mesh
from tests.helpers import ABORTS, make_dataset, make_sft_dataset, run_in_session, torch_command, torch_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_DIR = os.path.join(ROOT, "configs", "parity")
CONFIGS = ("float32", "bfloat16", "accum", "remat")
REFERENCE = "jax:1"
INIT_SEED_OFFSET = 7  # the initial weights are drawn with train.seed + 7: no side trains with that seed
# side -> jaxpar mesh
JAX_MESHES = {
    "jax:1": "dp=1",
    "jax:dp=8": "dp=8",
    "jax:fsdp=8": "fsdp=8",
    "jax:dp=2,tp=4": "dp=2,tp=4",
    "jax:ep=4,dp=2": "ep=4,dp=2",
}  # ep: the mixture-of-experts configs only
# side -> (processes, torchpar arguments); 0 processes = one plain `python -m torchpar.train`
TORCH_BACKENDS = {
    "torch:none": (0, ["--backend", "none"]),
    "torch:ddp": (2, ["--backend", "ddp"]),
    "torch:fsdp": (2, ["--backend", "fsdp"]),
    "torch:zero2": (2, ["--backend", "deepspeed", "parallel.zero_stage=2"]),
    "torch:zero3": (2, ["--backend", "deepspeed", "parallel.zero_stage=3"]),
    "torch:pp=2": (2, ["--backend", "pipeline", "parallel.pipeline_schedule=1f1b"]),  # torch.distributed.pipelining
    "torch:ep=2": (2, ["--backend", "ddp", "parallel.mesh=ep=2"]),  # experts split over the ranks: experts only
}
SIDES = (*JAX_MESHES, *TORCH_BACKENDS)


@dataclass
class Run:
    side: str
    config: str
    loss: list[float]
    grad_norm: list[float]
    lr: list[float]
    params: dict[str, np.ndarray] = field(repr=False)
    seconds: float


def config_path(name: str) -> str:
    return os.path.join(CONFIG_DIR, f"{name}.yaml")


def devices_needed(side: str) -> int:
    if side in JAX_MESHES:
        return math.prod(parse_mesh(JAX_MESHES[side]).values())
    return max(TORCH_BACKENDS[side][0], 1)


class Runner:
    """Runs in `workdir`; device "cpu" (simulated jax devices, gloo) or "gpu" (the machine's GPUs)."""

    def __init__(self, workdir: str, device: str = "cpu", steps: int = 50, timeout: int = 600):
        if device not in ("cpu", "gpu"):
            raise ValueError(f"device must be cpu or gpu, not {device!r}")
        self.workdir, self.device, self.steps, self.timeout = str(workdir), device, steps, timeout
        self.cache: dict[str, Run] = {}
        self._inits: dict[str, str] = {}
        self._datasets: dict[str, str] = {}

    def unavailable(self, side: str) -> str | None:
        """Why `side` cannot run on this device, or None. On CPU everything runs (simulated devices)."""
        if self.device == "cpu":
            return None
        import torch

        gpus = torch.cuda.device_count()
        if gpus < devices_needed(side):
            return f"{side} needs {devices_needed(side)} GPUs, this machine has {gpus}"
        return None

    def env(self) -> dict:
        env = torch_env()
        if self.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""  # CPU means CPU for torch too, even on a GPU machine
        else:
            for key in ("JAX_PLATFORMS", "DS_ACCELERATOR", "JAXPAR_CPU_DEVICES"):
                env.pop(key, None)
        return env

    def launch(self, cmd: list[str], what: str) -> str:
        """Run a command in its own session; fail on timeout, non-zero exit, an abort or a leftover process."""
        proc = run_in_session(cmd, self.env(), self.timeout, what)
        text = proc.stdout + proc.stderr
        if proc.returncode != 0 or any(a in text for a in ABORTS):
            pytest.fail(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n{text[-5000:]}")
        return text

    def dataset(self, kind: str = "tokens") -> str:
        """The synthetic token file of a kind.

        Tokens, documents (short packed documents, for data.document_mask), or sft (prompt/completion records
        with a loss mask, packed for seq_len 16).
        """
        if kind not in self._datasets:
            os.makedirs(self.workdir, exist_ok=True)
            path = os.path.join(self.workdir, f"{kind}.bin")
            self._datasets[kind] = (
                make_sft_dataset(path)
                if kind == "sft"
                else make_dataset(path, document_length=8 if kind == "documents" else 0)
            )
        return self._datasets[kind]

    @staticmethod
    def data_kind(config: str, overrides=()) -> str:
        """Which synthetic file a config trains on (see `dataset`)."""
        d = load_config(config_path(config), list(overrides)).data
        return "sft" if config == "sft" else "documents" if d.document_mask or d.batching == "buckets" else "tokens"

    def base_args(self, config: str, overrides=()) -> list[str]:
        kind = self.data_kind(config, overrides)
        return [
            "--config",
            config_path(config),
            f"data.dataset={self.dataset(kind)}",
            f"train.steps={self.steps}",
            "train.log_every=1",
            "train.eval_every=0",
            "checkpoint.every=0",
            *overrides,
        ]

    def init_weights(self, config: str, overrides=()) -> str:
        """One exported initial-weights file per model section and seed (shared by every config that has them).

        The file is drawn with another seed than the one the sides train with (INIT_SEED_OFFSET): a side
        that ignored model.init_from would start from its own seed's draw, not the file's, and fail its
        comparison. (torchpar's own draw comes from torch's generator and differs anyway; a jaxpar side's
        would equal a file drawn with its training seed, and hide the fault.)"""
        cfg = load_config(config_path(config), list(overrides))
        # every model key shapes the weights (variants too), and the seed draws them
        model = json.dumps({**cfg.to_dict()["model"], "seed": cfg.train.seed}, sort_keys=True)
        key = hashlib.sha1(model.encode()).hexdigest()[:12]
        if key not in self._inits:
            path = os.path.join(self.workdir, "init", f"{key}.safetensors")
            cmd = [
                sys.executable,
                "-m",
                "jaxpar.train",
                *self.base_args(config, overrides),
                "--mesh",
                "dp=1",
                f"train.seed={cfg.train.seed + INIT_SEED_OFFSET}",
                "parallel.grad_compression=none",  # one device
                f"run.dir={os.path.join(self.workdir, 'init', key)}",
                "--write-init",
                path,
            ]
            self.launch(cmd, f"export of initial weights for {config}")
            self._inits[key] = path
        return self._inits[key]

    def run(self, config: str, side: str, overrides=()) -> Run:
        """Train `config` (+ overrides) on `side` for `steps` steps; cached by (side, resolved config)."""
        overrides = list(overrides)
        resolved = load_config(config_path(config), overrides + [f"train.steps={self.steps}"]).to_dict()
        resolved.pop("run")  # the data file too: two configs alike but for it are two runs (sft and accum)
        resolved["data"]["dataset"] = self.data_kind(config, overrides)
        key = hashlib.sha1(json.dumps([side, resolved], sort_keys=True).encode()).hexdigest()[:12]
        if key in self.cache:
            return self.cache[key]
        slug = side.replace(":", "-").replace(",", "-").replace("=", "")
        run_dir = os.path.join(self.workdir, "runs", f"{config}-{slug}-{key}")
        final = os.path.join(run_dir, "final.safetensors")
        args = [
            *self.base_args(config, overrides),
            f"model.init_from={self.init_weights(config, overrides)}",
            f"run.dir={run_dir}",
            "--write-final",
            final,
        ]
        if side in JAX_MESHES:
            cmd = [sys.executable, "-m", "jaxpar.train", *args, "--mesh", JAX_MESHES[side]]
        else:
            nproc, backend = TORCH_BACKENDS[side]
            cmd = torch_command([*backend, *args], nproc)
        t0 = time.perf_counter()
        self.launch(cmd, f"{config} on {side}")
        seconds = time.perf_counter() - t0
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            records = {r["step"]: r for r in map(json.loads, f)}
        steps = range(1, self.steps + 1)
        if sorted(records) != list(steps):
            pytest.fail(f"{config} on {side}: logged steps {sorted(records)[:5]}..., expected 1..{self.steps}")
        value = lambda v: float("nan") if v is None else float(v)  # null: a non-finite (float16) step
        run = Run(
            side,
            config,
            *([value(records[s][k]) for s in steps] for k in ("loss", "grad_norm", "lr")),
            params=load_file(final),
            seconds=seconds,
        )
        self.cache[key] = run
        return run
