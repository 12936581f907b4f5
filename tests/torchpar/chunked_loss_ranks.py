"""Run under torchrun (or as one process for --backend none) by tests/torchpar/test_chunked_loss.py.

Two updates of
the tiny model on a backend's engine, once with the whole logits (model.loss_chunks=1) and once in 4 chunks, from
the same weights, on rows with packed documents and a loss mask. Rank 0 writes OUT/result.json (both runs' losses,
how often the ranks ran the head and loss in more than one chunk) and each run's final parameters (OUT/whole.npz,
OUT/chunked.npz).
python -m torch.distributed.run --nproc_per_node=2 tests/torchpar/chunked_loss_ranks.py BACKEND OUT [OVERRIDE...]
"""

import json
import sys

import numpy as np
import torch

from tests.helpers import tiny_config
from torchpar import dist
from torchpar.models import head
from torchpar.parallelize import parallelize
from torchpar.trainer import build_model

CALLS = []  # the chunk count of each chunked loss this process ran (the pipeline's last stage runs one chunk too)
plain = head._Chunked.forward
head._Chunked.forward = staticmethod(
    lambda ctx, x, table, targets, n, step: CALLS.append(n) or plain(ctx, x, table, targets, n, step)
)


def rows(cfg) -> torch.Tensor:
    """The global batch: random tokens, a tenth of them 0 (a document starts), a third of the targets skipped."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, cfg.model.vocab_size, (cfg.train.global_batch_size, cfg.data.seq_len + 1))
    tokens[rng.random(tokens.shape) < 0.1] = 0
    return torch.as_tensor(np.where(rng.random(tokens.shape) < 0.3, ~tokens, tokens))


def trained(backend: str, overrides: list[str], n: int) -> dict:
    cfg = tiny_config("data.document_mask=true", *overrides, f"model.loss_chunks={n}")
    env = dist.setup(cfg, backend)
    engine = parallelize(build_model(cfg), cfg, env, backend)[0]
    batch, calls = rows(cfg), len(CALLS)
    share = batch[:, 1:].numel() / int((batch[:, 1:] >= 0).sum())  # the trainer's token share
    mine = batch[engine.data_rank :: engine.data_ways]
    losses = [engine.read(engine.update(mine, share))["loss"] for _ in range(2)]
    chunked = int(dist.all_sum([sum(c > 1 for c in CALLS[calls:])], env)[0])  # over the ranks: the last stage's
    return {
        "losses": losses,
        "params": {k: v.detach().float().numpy() for k, v in engine.full_state_dict().items()},
        "calls": chunked,
        "rank": env.rank,
    }


def main(backend: str, out: str, *overrides: str) -> None:
    whole, chunks = (trained(backend, list(overrides), n) for n in (1, 4))
    if whole["rank"] == 0:
        for run, name in ((whole, "whole"), (chunks, "chunked")):
            np.savez(f"{out}/{name}.npz", **run["params"])
        with open(f"{out}/result.json", "w") as f:
            calls = [whole["calls"], chunks["calls"]]
            json.dump({"whole": whole["losses"], "chunked": chunks["losses"], "calls": calls}, f)


if __name__ == "__main__":
    try:
        main(*sys.argv[1:])
    finally:  # after main's frame let go of the engines: their groups and gloo threads freed while the interpreter
        dist.teardown()  # is whole (left to exit, a gloo thread aborted it now and then: "terminate called ...")
