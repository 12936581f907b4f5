"""The torch-side step shared by none/ddp/fsdp: accumulate, clip, AdamW; DCP checkpoints.

Gradient synchronisation is the wrapper's own (DDP's all-reduce, FSDP2's reduce-scatter); this
file only chooses on which microbatch it happens (`sync` context) and reads the clipped norm.
`full_state_dict()` returns the whole (unsharded) parameters by torch name on rank 0: the plain
module's state_dict here (none, ddp); fsdp passes its own gather.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from jaxpar.core.lr_schedule import lr_at
from torchpar.checkpoint import DCPCheckpointer
from torchpar.model import loss_fn
from torchpar.optim import make_optimizer


class TorchEngine:
    def __init__(self, module, raw, cfg, env, sync=lambda last: nullcontext(), full_state=None):
        self.module, self.raw, self.cfg, self.env, self.sync = module, raw, cfg, env, sync
        self.full_state_dict = full_state or raw.state_dict
        self.params = [p for p in raw.parameters()]
        self.optimizer = make_optimizer(raw, cfg)
        self.checkpointer = DCPCheckpointer(cfg.run.dir, cfg.checkpoint.keep, module, self.optimizer, env)
        self.step = 0  # set by the trainer after a restore
        # which share of each global batch this rank reads, and how many ranks' losses make the mean
        self.data_rank, self.data_ways = env.rank, env.world

    def eval_loss(self, batch: torch.Tensor) -> float:
        with torch.no_grad():
            return float(loss_fn(self.module(batch[:, :-1]), batch))

    def train_step(self, micro: list[torch.Tensor]):
        lr = lr_at(self.step, self.cfg.optim, self.cfg.train.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total = self.forward_backward(micro)
        norm = self.clip_gradients(self.cfg.optim.grad_clip or float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return total, norm, lr

    def forward_backward(self, micro: list[torch.Tensor]) -> torch.Tensor:
        """Gradients of the mean loss over the microbatches accumulated in .grad; returns that loss."""
        total = torch.zeros((), device=micro[0].device)
        for m, batch in enumerate(micro):
            with self.sync(m == len(micro) - 1):
                loss = loss_fn(self.module(batch[:, :-1]), batch) / len(micro)
                loss.backward()
            total += loss.detach()
        return total

    def clip_gradients(self, clip: float) -> torch.Tensor:
        """Clip to the global norm; returns the pre-clip norm."""
        norm = torch.nn.utils.clip_grad_norm_(self.params, clip)  # DTensor-aware for FSDP2
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

def build(model, cfg, env, **_):
    return TorchEngine(model.to(env.device), model, cfg, env)
