"""Run K training steps of a config on a given layout, in-process: what the layout-equivalence
tests compare (the parity suite runs the trainers themselves). Same state, step and data code as `jaxpar.train`."""
from __future__ import annotations

import jax
import numpy as np

from jaxpar.compat.weights import flatten
from jaxpar.config import Config
from jaxpar.data import TokenBatches
from jaxpar.mesh import make_mesh, parse_mesh
from jaxpar.sharding import rules_for
from jaxpar.state import Layout, device_batch, init_state, make_train_step


def run_steps(cfg: Config, mesh: str, dataset: str, steps: int | None = None, devices=None) -> dict:
    """Per-step loss / grad_norm / lr (lists of floats) and the final parameters (flat numpy)."""
    layout = Layout(cfg, make_mesh(parse_mesh(mesh), devices), rules_for(cfg.parallel.zero_stage))
    data = TokenBatches(dataset, cfg.data.seq_len, cfg.train.global_batch_size, cfg.train.seed,
                        "train", cfg.data.val_fraction)
    state, train_step = init_state(layout), make_train_step(layout)
    shape = (cfg.train.global_batch_size, cfg.data.seq_len + 1)
    history = []
    for step in range(cfg.train.steps if steps is None else steps):
        state, metrics = train_step(state, device_batch(data, step, layout.batch_sharding, shape))
        history.append(metrics)
    history = jax.device_get(history)
    out = {k: [float(m[k]) for m in history] for k in ("loss", "grad_norm", "lr")}
    out["params"] = {k: np.asarray(v) for k, v in flatten(jax.device_get(state["params"])).items()}
    return out
