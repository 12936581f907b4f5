"""torchft's DiLoCo: each group of ranks its own launch, joined by torchft's lighthouse (docs/diloco.md "torchft").

parallel.torchft_lighthouse=HOST:PORT beside diloco=G in parallel.mesh makes this launch group
parallel.torchft_group of the G; its ranks are the mesh's other axes (DDP inside), and it reads the group's block of
every global batch, as in the one-launch mode. torchft's Manager joins the lighthouse's quorum, and torchft's DiLoCo
(torchft.local_sgd) meets from the inner optimizer's step hook: after every H-th step the groups present average
their deltas over torchft's own process group and the outer SGD applies the mean.

A group that leaves does not stop the others: the quorum goes on without it. A group that comes back heals at its
first meeting: torchft hands it a live group's parameters, inner optimizer state and step (`healed_to`), and the run
continues from that step. torchft meets every H steps and not after the last step (train.steps a multiple of H makes
its run the one-launch mode's).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch

from torchpar import dist
from torchpar.diloco import holding


class TorchftGroups:
    """torchft's Manager and DiLoCo around this launch's model and inner optimizer (the engine's)."""

    def __init__(self, raw, engine, cfg, env, index: int, count: int):
        from torchft import Manager  # deferred: torchft's mode alone needs it (an optional dependency)
        from torchft.local_sgd import DiLoCo  # deferred: likewise
        from torchft.process_group import ProcessGroupGloo  # deferred: likewise

        self.raw, self.engine, self.cfg, self.env, self.index, self.count = raw, engine, cfg, env, index, count
        self.size, self.healed_to = env.world, None
        timeout = timedelta(seconds=max(60.0, cfg.run.peer_timeout_s))
        # a group that comes back waits at its first meeting for the live groups' next: up to H steps
        waiting = timedelta(seconds=max(3600.0, cfg.run.peer_timeout_s))
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            load_state_dict=self._load,
            state_dict=self._save,
            min_replica_size=1,
            use_async_quorum=False,
            init_sync=False,  # every group starts from the same weights (the seed's or model.init_from's)
            replica_id=f"group{index}",
            lighthouse_addr=_address(cfg.parallel.torchft_lighthouse),
            store_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
            store_port=int(os.environ["MASTER_PORT"]) if "MASTER_PORT" in os.environ else None,
            rank=env.rank,
            world_size=env.world,
            timeout=timeout,
            quorum_timeout=waiting,
        )
        dist.before_teardown(lambda: self.manager.shutdown(wait=False))
        o = cfg.optim
        outer = torch.optim.SGD(
            raw.parameters(),
            lr=o.outer_lr,
            momentum=o.outer_momentum,
            nesterov=o.outer_nesterov and o.outer_momentum > 0,
        )
        self.diloco = DiLoCo(self.manager, [raw], engine.optimizer, outer, sync_every=cfg.parallel.diloco_inner_steps)
        self.diloco.__enter__()  # its hooks on the inner optimizer, for the run

    # what torchft sends a group that heals, and loads into one
    def _save(self) -> dict:
        return {"model": self.raw.state_dict(), "optim": self.engine.optimizer.state_dict(), "step": self.engine.step}

    def _load(self, state: dict) -> None:
        """A live group's state, inside the optimizer step of the sender's step `state["step"]` (0-based)."""
        self.raw.load_state_dict(state["model"])
        self.engine.optimizer.load_state_dict(state["optim"])
        self.engine.step = int(state["step"])  # the engine's update counts it on, as the sender's does
        self.healed_to = int(state["step"]) + 1
        if self.env.is_main:
            print(
                f"torchft: group {self.index} healed from a live group at its step {self.healed_to}; continuing from "
                "there",
                file=sys.stderr,
                flush=True,
            )

    def sum_within(self, values: list[float]) -> list[float]:
        return dist.all_sum(values, self.env)

    def after(self, step: int) -> None:
        """Nothing: torchft's DiLoCo met inside the step's optimizer step."""

    def synchronised(self):
        """The model holds the last meeting's parameters inside (torchft's backup of them); its own again after."""
        synced = self.diloco._fragments[0].original_parameters  # torchft keeps them for its next meeting
        return holding(dict(self.raw.named_parameters()), synced)

    def views(self, state: dict) -> dict:
        return state

    def unviews(self, state: dict) -> dict:
        return state

    def describe(self) -> str:
        o = self.cfg.optim
        return (
            f"DiLoCo with torchft: group {self.index} of {self.count} ({self.size} rank{'s' * (self.size > 1)}), "
            f"lighthouse {self.cfg.parallel.torchft_lighthouse}, meeting every {self.cfg.parallel.diloco_inner_steps} "
            f"steps; outer SGD lr {o.outer_lr:g}, momentum {o.outer_momentum:g}{' (Nesterov)' * o.outer_nesterov}"
        )


def _address(lighthouse: str) -> str:
    return lighthouse if "://" in lighthouse else f"http://{lighthouse}"
