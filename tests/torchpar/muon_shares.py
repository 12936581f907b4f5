"""Run under torchrun by tests/torchpar/test_muon.py::test_fsdp_ranks_share_the_newton_schulz_work.

FSDP2-sharded
tensors of several matrix shapes (B=1 matrices, q/k/v, an uneven band, experts) stepped by MuonAdamW, which must
equal one process's step and count how many matrices this rank's Newton-Schulz ran on. Writes OUT/rank-N.json.
python -m torch.distributed.run --nproc_per_node=W tests/torchpar/muon_shares.py OUT [DP]
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor

import torchpar.optim as optim
from torchpar.dist import teardown
from tests.helpers import tiny_config

# name -> (shape, (reduction, output) axes): fans 16x32 (4 of B=1), 16x16 (q/k/v and one of B=1), 24x16 (3 rows of
# 8 over the fsdp ranks: an uneven band), and experts (dim 0 a batch axis: whole matrices already)
SHAPES = {
    **{f"fc{i}": ((16, 32), ((0,), (1,))) for i in range(4)},
    "qkv": ((16, 3, 2, 8), ((0,), (2, 3))),
    "out": ((2, 8, 16), ((0, 1), (2,))),
    "odd": ((3, 8, 16), ((0, 1), (2,))),
    "experts": ((4, 16, 32), ((1,), (2,))),
}
MATRICES = 4 + 3 + 1 + 1 + 4


def module() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Module()
    for name, (shape, _) in SHAPES.items():
        m.register_parameter(name, torch.nn.Parameter(torch.randn(shape)))
    return m


def optimizer(m: torch.nn.Module) -> tuple[dict, optim.MuonAdamW]:
    params = dict(m.named_parameters())
    return params, optim.MuonAdamW(
        [{"params": list(params.values()), "weight_decay": 0.1, "muon": True}],
        {params[n]: axes for n, (_, axes) in SHAPES.items()},
        tiny_config("optim.name=muon"),
        lr=0.1,
    )


def step(params: dict, opt, grads: dict) -> None:
    for n, p in params.items():
        p.grad = distribute_tensor(grads[n], p.device_mesh, p.placements) if hasattr(p, "placements") else grads[n]
    opt.step()


def main(out: str, dp: int = 1) -> None:
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    shape, names = ((world,), ("fsdp",)) if dp == 1 else ((dp, world // dp), ("dp", "fsdp"))
    torch.manual_seed(1)
    grads = [{n: torch.randn(s) for n, (s, _) in SHAPES.items()} for _ in range(2)]  # the second step on momentum
    alone = optimizer(module())
    for g in grads:
        step(*alone, g)
    sharded = optimizer(fully_shard(module(), mesh=init_device_mesh("cpu", shape, mesh_dim_names=names)))
    seen, plain = [], optim.newton_schulz
    optim.newton_schulz = lambda y, steps: seen.append(y.shape[0]) or plain(y, steps)  # counts what this rank ran
    step(*sharded, grads[0])
    ran = sum(seen)
    step(*sharded, grads[1])
    worst = max(float((p.full_tensor() - alone[0][n]).detach().abs().max()) for n, p in sharded[0].items())
    with open(f"{out}/rank-{rank}.json", "w") as f:
        json.dump({"matrices": ran, "worst": worst}, f)


if __name__ == "__main__":
    try:
        main(sys.argv[1], *map(int, sys.argv[2:]))
    finally:  # after main's frame let go of the FSDP2 modules: their meshes and gloo threads freed while the
        teardown()  # interpreter is whole (a bare destroy_process_group aborted about one exit in five)
