"""Process groups from the launcher's environment: nccl on GPU, gloo on CPU; always torn down.

torchrun and DeepSpeed's launcher set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT;
under SLURM's `srun` without them, `adopt_slurm_env` derives them from SLURM_*; a plain `python -m
torchpar.train` process is rank 0 of 1 (an in-memory store, no port).

`teardown` must run in a `finally`, and must leave no process group alive: a gloo group's worker threads
free each finished collective's tensors themselves, taking the GIL where Python dropped a tensor first.
One still waiting for the GIL when the interpreter starts finalizing is ended by CPython with
pthread_exit, inside a noexcept destructor: std::terminate ("terminate called without an active
exception") and SIGABRT after a run that trained correctly. Destroying a group frees it only once nothing
references it, so the engine's reference cycles are collected and the backends release what their
libraries hold (`before_teardown`); then the groups' destructors join those threads, in teardown.
torch.distributed.nn is imported here, before any group: its functions take `group.WORLD` as a default
argument when first imported (torch._dynamo imports it, DDP imports torch._dynamo), which would hold the
default group for good.

Under torchrun's elastic agent with the c10d rendezvous, the workers' store is by default one the agent keeps
for its whole life (TORCHELASTIC_USE_AGENT_STORE=True): the keys of the worker group it restarted are still
there, and a restarted rank reading a peer's old gloo address before the peer wrote its new one fails in
"Gloo connectFullMesh ... Connection refused". Each group therefore works under a prefix of its own
(`group_token`). The agent itself does not recover from that store when a node joins later (the joining agent
waits for an address the first one wrote once): elastic runs start torchrun with
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which gives every worker group a fresh store on rank 0.
"""

from __future__ import annotations

import gc
import os
import re
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.nn.functional  # noqa: F401 - before any group exists (see teardown)

from jaxpar.core.run import peers


@dataclass
class Env:
    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def first_host(nodelist: str) -> str:
    """The first host of SLURM's compressed node list ('gpu[003-005,9],cpu1' -> 'gpu003'): rank 0's."""
    prefix, ranges = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?", nodelist).groups()
    return prefix + ranges.split(",")[0].split("-")[0] if ranges else prefix


def adopt_slurm_env() -> None:
    """`srun python -m torchpar.train` (one task per process, no torchrun).

    Rank, world and local rank from SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID, the master on the first node of the
    step; a MASTER_ADDR or MASTER_PORT already set wins. Nothing changes under torchrun (it sets RANK).
    """
    if "RANK" in os.environ or int(os.environ.get("SLURM_NTASKS", "1")) < 2:
        return
    os.environ.update(
        RANK=os.environ.get("SLURM_PROCID", "0"),
        WORLD_SIZE=os.environ["SLURM_NTASKS"],
        LOCAL_RANK=os.environ.get("SLURM_LOCALID", "0"),
    )
    nodes = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST") or "localhost"
    os.environ.setdefault("MASTER_ADDR", first_host(nodes))
    os.environ.setdefault("MASTER_PORT", str(29500 + int(os.environ.get("SLURM_JOB_ID", "0")) % 20000))


def launched() -> bool:
    """Whether a launcher started this process as one of several.

    torchrun's or DeepSpeed's variables, or srun's tasks, which adopt_slurm_env (called first) turns into
    torchrun's; not a plain `python -m` (nor one srun task).
    """
    return any(key in os.environ for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def launch_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) as torchrun set them; (0, 1, 0) for a plain process."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def init(distributed: bool, peer_timeout_s: float) -> Env:
    """The process group, its timeout above run.peer_timeout_s (the shared loop names lost peers first)."""
    rank, world, local_rank = launch_env()
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if distributed and not dist.is_initialized():
        timeout = timedelta(seconds=peers.library_timeout_s(peer_timeout_s))
        if "MASTER_ADDR" in os.environ:  # torchrun (or any launcher exporting its variables)
            dist.init_process_group(
                backend,
                rank=rank,
                world_size=world,
                timeout=timeout,
                store=agent_store(timeout),
                device_id=device if device.type == "cuda" else None,
            )
        else:  # a plain process: rank 0 of 1 (DeepSpeed also reads these variables)
            for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
                os.environ.setdefault(key, value)
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return Env(rank, world, local_rank, device)


def agent_store(timeout: timedelta) -> dist.Store | None:
    """torchrun's shared store (module docstring) under this worker group's own prefix.

    None for any other launcher (init_process_group then reads MASTER_ADDR and MASTER_PORT itself).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    rank, world, _ = launch_env()
    if (
        rank == 0
        and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
        and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    ):
        print(
            "note: torchrun shares its rendezvous store with the workers (torch's default), so a node that joins "
            "later waits in vain: for elastic runs start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
            file=sys.stderr,
            flush=True,
        )
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"torchpar/{group_token(store, rank, world, timeout.total_seconds())}", store)


def group_token(store: dist.Store, rank: int, world: int, timeout_s: float) -> str:
    """A name that this worker group alone holds, agreed over a store that keeps earlier groups' keys.

    The earlier groups' workers are gone: the agent stops them before it forms a new group. Rank 0 draws the name and
    hands it to each rank that asks with a fresh random key, until every rank has confirmed under the new name; an
    earlier group's request is answered too, and no one reads that answer.
    """
    if rank != 0:
        ask = uuid.uuid4().hex
        store.set(f"torchpar/ask/{rank}", ask)
        token = store.get(f"torchpar/answer/{ask}").decode()  # blocks until rank 0 answers (or the timeout)
        store.set(f"torchpar/{token}/has/{rank}", "1")
        return token
    token, answered = uuid.uuid4().hex, set()
    waiting, deadline = set(range(1, world)), time.monotonic() + timeout_s
    while waiting:
        for r in sorted(waiting):
            if store.check([f"torchpar/{token}/has/{r}"]):
                waiting.discard(r)
            elif store.check([f"torchpar/ask/{r}"]) and (ask := store.get(f"torchpar/ask/{r}")) not in answered:
                store.set(f"torchpar/answer/{ask.decode()}", token)
                answered.add(ask)
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"process {', '.join(map(str, sorted(waiting)))} of {world} did not join the "
                f"process group within {timeout_s:g} s"
            )
        time.sleep(0.01)
    return token


def any_rank(flag: bool, env: Env) -> bool:
    """Whether `flag` is true on any rank (every rank gets the same answer): one tiny all-reduce."""
    return all_sum([float(flag)], env)[0] > 0


def all_sum(values: list[float], env: Env) -> list[float]:
    """Sum of small host values over ranks (logging and stop agreement only, never gradients)."""
    if not dist.is_initialized() or env.world == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=env.device)
    dist.all_reduce(t)
    return t.tolist()


def roll_call(env: Env, wait_s: float) -> list[int]:
    """Each rank sets its key in the process group's store (torchrun's agent, or rank 0 without torchrun).

    The ranks missing after `wait_s` (every other rank if the store itself is gone).
    """
    if not store_answers(min(10.0, wait_s)):
        return [r for r in range(env.world) if r != env.rank]
    store = dist.distributed_c10d._get_default_store()  # the group's own store: no public handle
    key = "torchpar/present/{}".format
    return peers.roll_call(
        lambda: store.set(key(env.rank), "1"),
        lambda: {r for r in range(env.world) if store.check([key(r)])},
        env.rank,
        env.world,
        wait_s,
    )


def store_answers(wait_s: float = 10.0) -> bool:
    """Whether the store's server at MASTER_ADDR:MASTER_PORT still takes connections, asked with a plain socket.

    A TCPStore call on a lost server (rank 0's, lost with its node) prints a page of C++ stack before it raises.
    """
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return True  # one process: its store is in memory
    try:
        socket.create_connection((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])), timeout=wait_s).close()
    except OSError:
        return False
    return True


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


_releases: list[Callable[[], None]] = []


def before_teardown(release: Callable[[], None]) -> None:
    """`release()` runs first in `teardown`, the last registered first.

    It drops what a library keeps of the process groups. A release registered again runs once, in its first place.
    """
    if release not in _releases:
        _releases.append(release)


def teardown() -> None:
    """Destroy the process groups and free them now, while the interpreter is whole.

    Their gloo threads are joined (module docstring). Safe to call again.
    """
    try:
        while _releases:
            _releases.pop()()
        forget_meshes()
    finally:  # a release that fails (another library version) must not keep the groups alive
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()  # engines in reference cycles (DDP's reducer, FSDP2's modules) hold the last references


def forget_meshes() -> None:
    """DTensor (FSDP2) caches redistribution plans and shardings by device mesh, and a mesh holds its groups."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor import _collective_utils, _redistribute, debug  # deferred: DTensor internals (~1 s)

    _redistribute.clear_redistribute_planner_cache()
    _redistribute._gen_transform_infos.cache_clear()
    _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear()
    debug._clear_sharding_prop_cache()


PRECISION = {"default": "high", "high": "high", "highest": "highest"}  # jaxpar's default on GPU is TF32 too


def setup(cfg, backend: str) -> Env:
    """Matmul precision and determinism, then the process group; the rank's Env."""
    torch.set_float32_matmul_precision(PRECISION[cfg.train.matmul_precision])
    if torch.cuda.is_available():
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS; before first use
    if cfg.run.debug:  # c10d's own consistency checks and logs (before the group exists)
        os.environ.setdefault("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    env = init(backend != "none", cfg.run.peer_timeout_s)
    if env.device.type == "cuda":  # CPU kernels used here are deterministic already (and the call costs ~1 s)
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = False  # DeepSpeed allocates large empty buckets
    return env
