"""Backends wrap the plain Decoder (torchpar/models/decoder.py).

`none` (one process), `ddp`, `fsdp` (FSDP2), `deepspeed` (ZeRO 0-3), `pipeline` (torch.distributed.pipelining). Each
module's `build(model, cfg, env, **options)` returns an `Engine`; the trainer (torchpar/trainer.py) uses nothing else of
it; torchpar/parallelize.py builds it.
"""

from __future__ import annotations

import importlib
from typing import Protocol

from jaxpar.core.config.mesh_spec import TORCH_BACKENDS

BACKENDS = TORCH_BACKENDS  # the list lives in the shared core, where jaxpar.tools.launch checks it too


class Engine(Protocol):
    """A backend's whole training step and the state it saves."""

    module: object  # what evaluation runs (the wrapped model)
    raw: object  # the plain Decoder module (rank 0 samples from it under none and ddp)
    data_rank: int  # which share of each global batch this rank reads...
    data_ways: int  # ...of how many (the ranks whose losses make the mean)
    local_params: int | None  # parameter elements this rank holds (None where the engine does not say)
    optimizer_bytes: int | None  # bytes of optimizer state it holds (likewise)
    groups: object  # DiLoCo's groups (torchpar/diloco.py `Groups`) on ddp and fsdp, else None

    def update(self, batch, share: float = 1.0) -> object:
        """This rank's rows of the global batch.

        Microbatches, backward, clipping, the update (and float16's loss scaler); a handle on the step's
        metrics. `share`: every loss is scaled by it (the framework's token_share: 1.0 unless the data has a
        loss mask).
        """

    def read(self, handle) -> dict:
        """The step's metrics: loss, grad_norm, lr, and float16's loss_scale and skipped_steps.

        The loss is averaged over the data ranks: a collective.
        """

    def eval_loss(self, batch, share: float = 1.0) -> float:
        """This rank's loss on its rows of a validation batch, times `share`."""

    def inject_overflow(self) -> None:
        """Test fault (TORCHPAR_FAULT_OVERFLOW_AT_STEP): the next step's gradients are made non-finite."""

    def save(self, step: int, meta: dict) -> None:
        """A checkpoint of the state after `step`, `meta` in its metadata."""

    def restore(self) -> int | None:
        """The latest complete checkpoint of run.dir loaded (partial saves removed first); its data step, or None."""

    def full_state_dict(self) -> dict:
        """The whole parameters by torch name on rank 0 (a collective where they are sharded)."""


def build(name: str, model, cfg, env, **options) -> Engine:
    return importlib.import_module(f"torchpar.backends.{name}").build(model, cfg, env, **options)
