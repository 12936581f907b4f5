"""Expert parallelism for the ddp backend: parallel.mesh=ep=N (with dp=D beside it, D x N = the world).

The ranks form a DeviceMesh (dp, ep); rank = dp index x N + ep index. Every rank reads its own share of each
batch (as under plain DDP) and keeps E/N of each mixture-of-experts layer's experts: ep rank i the experts
i E/N .. (i+1) E/N - 1. A layer's kept choices, sorted by expert (torchpar/models/moe.py), travel to the ranks
that own their experts and back by torch's all_to_all_single with uneven splits under the ep group: only the
routed rows move, none padded (jaxpar pads on the CPU, where XLA has no ragged all-to-all; the numbers are the
same). The exchange is autograd-aware: backward sends the gradients the same way back.

Gradients: one DDP over the world for everything but the experts (they are ignored by it), and per layer a
DDP of that layer's experts over the dp group (the ranks holding the same experts), whose communication hook
divides by the world size rather than by dp: an expert's gradient already sums the losses of its ep group's
rows. The clipping norm adds the experts' squares over the ep group. Checkpoints stay DCP's: the experts (and
their AdamW moments) enter the state dict as DTensors, Shard(0) over ep and replicated over dp, so a
checkpoint written on one layout loads on any other, without experts sharded too.
"""

from __future__ import annotations

import sys
from contextlib import ExitStack

import torch
import torch.distributed as tdist
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.parallel import DistributedDataParallel as DDP

from jaxpar.core.config.mesh_spec import parse_mesh, resolve_sizes


def ep_size(cfg, world: int) -> int:
    """parallel.mesh's ep (1 without it)."""
    return resolve_sizes(parse_mesh(cfg.parallel.mesh), world)["ep"] if cfg.parallel.mesh else 1


def mean_over_world(state, bucket):
    """DDP communication hook of the experts' replicas.

    The bucket summed over the dp group, divided by the world size (state: (group, world)). torch's allreduce_hook
    divides by the group's own size.
    """
    group, world = state
    buffer = bucket.buffer().div_(world)
    return tdist.all_reduce(buffer, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])


class Exchange:
    """Send a layer's kept choices to the ep ranks owning their experts, and back in the same order.

    The rows are grouped by expert, counts[e] of them expert e's; they travel through `run` (the experts' DDP).
    """

    def __init__(self, run, group, n: int):
        self.run, self.group, self.n = run, group, n

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        n, mine = self.n, counts.numel() // self.n
        received = torch.empty_like(counts)  # [source rank, my expert]: how many rows each source sends each
        tdist.all_to_all_single(received, counts, group=self.group)
        send, received = counts.view(n, mine).sum(1).tolist(), received.view(n, mine)
        recv = received.sum(1).tolist()
        pieces = all_to_all_single_autograd(rows, recv, send, self.group).split(received.flatten().tolist())
        by_expert = [pieces[s * mine + e] for e in range(mine) for s in range(n)]
        out = self.run(torch.cat(by_expert), received.sum(0).tolist()).split([p.shape[0] for p in by_expert])
        home = torch.cat([out[e * n + s] for s in range(n) for e in range(mine)])  # back to source order
        return all_to_all_single_autograd(home, send, recv, self.group)


class ExpertParallel:
    """The model's experts split over ep (build), their DDP replicas, the norm, the checkpoint views."""

    PLACEMENTS = (Replicate(), Shard(0))

    def __init__(self, model, env, ep: int):
        self.mesh = init_device_mesh(env.device.type, (env.world // ep, ep), mesh_dim_names=("dp", "ep"))
        self.ep_group, index = self.mesh.get_group("ep"), self.mesh.get_local_rank("ep")
        self.names, self.replicas = [], []
        for i, block in enumerate(model.blocks):
            if not hasattr(block, "moe"):  # one of model.moe_first_dense's dense layers
                continue
            experts = block.moe.experts
            for name, p in experts.named_parameters():
                share = p.shape[0] // ep
                p.data = p.data[index * share : (index + 1) * share].clone()
                self.names.append(f"blocks.{i}.moe.experts.{name}")
            replica = DDP(
                experts.to(env.device),
                process_group=self.mesh.get_group("dp"),
                device_ids=[env.device.index] if env.device.type == "cuda" else None,
            )
            replica.register_comm_hook((self.mesh.get_group("dp"), env.world), mean_over_world)
            block.moe.exchange = Exchange(replica, self.ep_group, ep)
            self.replicas.append(replica)
        self.params = [p for replica in self.replicas for p in replica.module.parameters()]
        DDP._set_params_and_buffers_to_ignore_for_model(model, self.names)
        if env.is_main:
            print(
                f"experts: tokens travel over ep={ep} by all_to_all_single with uneven splits (the routed rows alone)",
                file=sys.stderr,
                flush=True,
            )

    def sync(self, last: bool, ddp) -> ExitStack:
        """Accumulation: no all-reduce before the last microbatch, neither the world's DDP's nor the replicas'."""
        stack = ExitStack()
        for module in () if last else (ddp, *self.replicas):
            stack.enter_context(module.no_sync())
        return stack

    def clip(self, params: list, clip: float) -> torch.Tensor:
        """Clip every gradient to the global norm (the experts' squares summed over ep); the pre-clip norm."""
        mine = {id(p) for p in self.params}
        dense = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None and id(p) not in mine])
        experts = torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None]) ** 2
        tdist.all_reduce(experts, group=self.ep_group)
        norm = (dense**2 + experts.to(dense.device)).sqrt()
        torch.nn.utils.clip_grads_with_norm_(params, clip, norm)
        return norm

    def _expert(self, key: str) -> bool:
        return any(key == n or key.startswith(f"state.{n}.") for n in self.names)

    def views(self, state: dict) -> dict:
        """DCP's state with the experts' tensors as DTensors over (dp, ep): each rank writes and reads its slice."""
        return {
            part: {
                k: DTensor.from_local(t, self.mesh, self.PLACEMENTS, run_check=False)
                if self._expert(k) and isinstance(t, torch.Tensor) and t.dim()
                else t
                for k, t in sd.items()
            }
            for part, sd in state.items()
        }

    def unviews(self, state: dict) -> dict:
        return {
            part: {k: t.to_local() if self._expert(k) and isinstance(t, DTensor) else t for k, t in sd.items()}
            for part, sd in state.items()
        }

    @torch.no_grad()
    def full_state_dict(self, model) -> dict:
        """The whole model by torch name (the experts gathered over ep: a collective)."""
        state = model.state_dict()
        for name in self.names:
            state[name] = DTensor.from_local(state[name], self.mesh, self.PLACEMENTS, run_check=False).full_tensor()
        return state
