"""torchpar under PyTorch's elastic agent.

Two torchrun agents of two processes each ("nodes") on loopback, with the c10d rendezvous. One node is lost -- its agent
and its workers SIGKILLed after a checkpoint --: the other agent's workers fail at once (gloo sees the closed
connections, the shared loop's roll call names the lost processes, exit 3), the agent restarts them
(TORCHELASTIC_RESTART_COUNT 1) and they resume from the last checkpoint on 2 processes (DCP reshards ddp and fsdp;
DeepSpeed through the universal checkpoint). The node is started again: the running agent sees it waiting and stops its
workers with SIGTERM (the loop stops after an agreed step, with a checkpoint), and the group grows back to 4. Every step
logged, the replayed ones included, equals the one-process run within 1e-5; both agents exit 0 and no worker is left
behind. With DiLoCo's two groups a node each, the lost node is a whole group: the survivors resume both groups, one rank
each, and every step equals the uninterrupted run of the groups.

torchrun runs with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (see torchpar/dist.py: with torch's shared store, a node
that joins later waits in vain for the store's address). Steps are slowed (TORCHPAR_FAULT_SLOW_STEP_S) so that
the kill lands mid-run and the shrunk run is still training when the node comes back.

Also here: workers restarted on torch's shared store form a new group (their own prefix, torchpar.dist.group_token),
and a mesh the re-formed group cannot hold stops each attempt with one line.
"""

import json
import os
import re
import signal
import sys
import threading
import time
import uuid

import numpy as np
import pytest

from jaxpar.tools.bench_recovery import Node, children, environment
from tests.helpers import ABORTS, free_port, run_in_session, torch_env
from tests.torchpar.runs import run

STEPS, EVERY = 24, 4
SLOW_S = "1.0"  # per step: ~20 s for the returning agent to start and be seen before the shrunk run would end
# lr 3e-3 (gpt2-tiny's): at the tiny config's 1e-2 the loss spikes near step 18 and amplifies the rounding that
# differs between 4 and 2 processes (2e-6 by step 24 here, and growing); run.peer_timeout_s=20: a roll call of 10 s
EXTRA = [
    f"train.steps={STEPS}",
    f"checkpoint.every={EVERY}",
    "optim.lr=3e-3",
    "optim.min_lr=3e-4",
    "run.peer_timeout_s=20",
]
WAIT_S = 240  # any one phase, on a loaded machine
# backend, its settings, and whether the lost node is started first: it then has the lower process id, so the
# rendezvous makes it node 0, with rank 0 and (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) the workers' store: the survivors
# find the store gone; else they hold the roll call and wait for the lost processes' answers
# DiLoCo's 2 groups, a node each: the lost node is a whole group; the survivors are both groups of one rank, from the
# checkpoint (each group's state resharded by DCP), until the node comes back (docs/diloco.md)
DILOCO = ["parallel.mesh=diloco=2,dp=-1", "parallel.diloco_inner_steps=5"]
BACKENDS = {
    "ddp": ("ddp", [], True),
    "fsdp": ("fsdp", [], False),
    "deepspeed-zero2": ("deepspeed", ["parallel.zero_stage=2"], False),
    "ddp-diloco": ("ddp", DILOCO, False),
}


@pytest.fixture(scope="module")
def uninterrupted(base):
    """The uninterrupted run of the same config: one process."""
    run_dir = base["tmp"] / "elastic-reference"
    run(["--backend", "none", *base["args"], *EXTRA, f"run.dir={run_dir}"])
    return {r["step"]: r for r in records(run_dir)}


@pytest.fixture(scope="module")
def uninterrupted_groups(base):
    """DiLoCo's uninterrupted run of the same config: its 2 groups of one process each."""
    run_dir = base["tmp"] / "elastic-groups-reference"
    run(["--backend", "ddp", *base["args"], *EXTRA, *DILOCO, f"run.dir={run_dir}"], nproc=2)
    return {r["step"]: r for r in records(run_dir)}


def records(run_dir) -> list[dict]:
    """Every step record of metrics.jsonl in order, a step logged again after a resume included."""
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return [r for r in map(json.loads, f) if "loss" in r]
    except FileNotFoundError:
        return []


def node(args: list[str], port: int, rdzv_id: str, host: bool, log: str, restarts: int = 3) -> Node:
    """One torchrun agent with two workers (bench_recovery's); `log` collects every node's output."""
    return Node(
        "torchpar.train",
        args,
        environment("TORCHPAR", float(SLOW_S)),
        port,
        rdzv_id,
        host,
        log,
        restarts=restarts,
        join_s=WAIT_S,
    )


def all_pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return dict(kv.decode().split("=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        return {}


def of_run(rdzv_id: str) -> list[int]:
    """Processes left of this run: workers carry the rendezvous id in TORCHELASTIC_RUN_ID."""
    return [pid for pid in all_pids() if environ(pid).get("TORCHELASTIC_RUN_ID") == rdzv_id]


def wait_for(what: str, ready, log: str, timeout: float = WAIT_S):
    deadline = time.monotonic() + timeout
    while not (result := ready()):
        if time.monotonic() > deadline:
            pytest.fail(f"waited {timeout} s for {what}\n{tail(log)}")
        time.sleep(0.2)
    return result


def tail(log: str) -> str:
    with open(log) as f:
        return f.read()[-6000:]


def worlds(log: str) -> list[int]:
    """The group sizes of the run so far, in order (rank 0's start-up line, one per group)."""
    with open(log) as f:
        return [int(n) for n in re.findall(r"backend \w+ on (\d+) cpu processes", f.read())]


@pytest.mark.parametrize("backend,extra,lost_first", BACKENDS.values(), ids=BACKENDS.keys())
def test_a_lost_node_shrinks_the_run_and_its_return_grows_it(backend, extra, lost_first, base, request, tmp_path):
    uninterrupted = request.getfixturevalue("uninterrupted_groups" if extra is DILOCO else "uninterrupted")
    run_dir, log, rdzv_id = tmp_path / "run", str(tmp_path / "nodes.log"), f"elastic-{uuid.uuid4().hex[:8]}"
    args = ["--backend", backend, *base["args"], *EXTRA, *extra, f"run.dir={run_dir}"]
    port = free_port()
    nodes = []
    try:
        for lost in (lost_first, not lost_first):  # the survivor holds the rendezvous store
            nodes.append(node(args, port, rdzv_id, host=not lost, log=log))
        lost, survivor = nodes if lost_first else nodes[::-1]
        wait_for(
            "4 processes past a checkpoint",
            lambda: worlds(log)[-1:] == [4] and any(r["step"] > EVERY for r in records(run_dir)[-1:]),
            log,
        )
        lost.kill()
        before = len(records(run_dir))  # rank 0 logs a step only when every process has done it
        shrunk = wait_for(
            "the survivors' first step on 2 processes",
            lambda: worlds(log)[-1:] == [2] and len(records(run_dir)) > before and children(survivor.proc.pid),
            log,
        )
        assert {environ(pid).get("TORCHELASTIC_RESTART_COUNT") for pid in shrunk} == {"1"}, tail(log)
        nodes.append(node(args, port, rdzv_id, host=False, log=log))  # the node comes back
        for agent in (survivor, nodes[-1]):
            agent.proc.wait(timeout=WAIT_S)
        text = tail(log)
        assert survivor.proc.returncode == 0 and nodes[-1].proc.returncode == 0, text
        assert worlds(log)[-3:] == [4, 2, 4], (worlds(log), text)  # (a group of 2 first if the agents met late)
        assert not any(a in text for a in ABORTS), text
        wait_for("no worker left", lambda: not of_run(rdzv_id), log, timeout=10)
    finally:
        for agent in nodes:
            if agent.proc.poll() is None:
                agent.kill()
        for pid in of_run(rdzv_id):
            os.kill(pid, signal.SIGKILL)
    got = records(run_dir)
    assert sorted({r["step"] for r in got}) == list(range(1, STEPS + 1))
    assert len(got) > STEPS, "no step was replayed: the survivors did not resume from a checkpoint"
    np.testing.assert_allclose([r["loss"] for r in got], [uninterrupted[r["step"]]["loss"] for r in got], rtol=1e-5)
    np.testing.assert_allclose([r["lr"] for r in got], [uninterrupted[r["step"]]["lr"] for r in got], rtol=1e-6)


_RESTARTED = """
import os, sys, time
import torch, torch.distributed
from torchpar import dist
attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
if attempt and rank == 0:
    time.sleep(3)  # the restarted rank 1 reads the store first, where the first group's keys still are
dist.init(True, 30)
x = torch.ones(1)
torch.distributed.all_reduce(x)
print(f"attempt {attempt} rank {rank}: {x.item():g}", flush=True)
dist.teardown()
sys.exit(1 if (attempt, rank) == (0, 1) else 0)  # one restart
"""


def test_workers_restarted_on_torchruns_shared_store_form_a_new_group(tmp_path):
    """torchrun's default store outlives the worker groups it serves.

    A restarted rank that read a peer's old gloo address failed in 'Gloo connectFullMesh ... Connection refused'
    where it was the side that connects (4 runs in 5 here without torchpar.dist's prefix, rank 0 starting 3 s late;
    group_token's own test below is exact).
    """
    script = tmp_path / "restarted.py"
    script.write_text(_RESTARTED)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        str(script),
    ]
    out = run_in_session(cmd, torch_env(), 120, "torchrun with a restart")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-5000:]
    assert sorted(re.findall(r"attempt \d rank \d: \d", out.stdout)) == [  # the processes' lines may interleave
        f"attempt {a} rank {r}: 2" for a in range(2) for r in range(2)
    ], text[-5000:]
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in out.stderr  # rank 0's note: elastic runs need the agent's fix


def test_a_new_group_agrees_on_a_name_the_earlier_groups_keys_do_not_hold():
    """group_token over one store.

    Later groups of 3 agree on names of their own, the one with rank 0 a second late (the others wait for answers to
    their new requests) and the one with rank 1 late (rank 0 finds its predecessor's request and answers it in vain
    first).
    """
    from datetime import timedelta

    from torch.distributed import TCPStore

    from torchpar.dist import group_token

    timeout = timedelta(seconds=60)
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)

    def group(late: int) -> list[str]:
        names = [None] * 3

        def member(rank: int) -> None:
            time.sleep(1.0 if rank == late else 0.0)
            names[rank] = group_token(TCPStore("127.0.0.1", server.port, timeout=timeout), rank, 3, 60)

        threads = [threading.Thread(target=member, args=(rank,)) for rank in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=90)
        return names

    groups = [group(late=-1), group(late=0), group(late=1)]
    assert all(len(set(names)) == 1 and None not in names for names in groups), groups
    assert len({names[0] for names in groups}) == 3


def test_a_mesh_the_new_group_cannot_hold_stops_with_one_line(base, tmp_path):
    """parallel.mesh=dp=2,fsdp=2 needs 4 processes; an agent that forms a group of 2 gets one line per attempt."""
    log = str(tmp_path / "node.log")
    args = ["--backend", "fsdp", *base["args"], "parallel.mesh=dp=2,fsdp=2", f"run.dir={tmp_path / 'run'}"]
    agent = node(args, free_port(), f"elastic-{uuid.uuid4().hex[:8]}", host=True, log=log, restarts=1)
    assert agent.proc.wait(timeout=WAIT_S) != 0
    errors = [line for line in tail(log).splitlines() if line.startswith("error:")]
    assert (
        errors
        == [
            "error: parallel.mesh=dp=2,fsdp=2 needs 4 processes and 2 run: an elastic run's group changes "
            "size: make one axis -1, e.g. dp=-1,fsdp=2"
        ]
        * 2
    )
    assert not os.path.exists(tmp_path / "run" / "checkpoints")
