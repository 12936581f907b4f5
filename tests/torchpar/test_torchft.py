"""torchft's mode of torchpar's DiLoCo: each group its own launch, joined by torchft's lighthouse.

Two groups of one rank each, two torchrun launches, are held to tests/jaxpar/test_diloco.py's reference from one
initial-weights file: torchft's meetings (every H steps, the groups' mean delta, the outer Nesterov SGD) are the
one-launch mode's when train.steps is a multiple of H. A group killed mid-run does not stop the other; relaunched with
the same command, it heals from the live group at its first meeting and continues from that group's step.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from jaxpar.core.config.contract import Run, check_contract
from jaxpar.core.config.schema import load_config
from jaxpar.core.weights.names import read_weights
from tests.helpers import assert_params_close, metrics, run_in_session, tiny_config, torch_command, torch_env
from jaxpar.core.errors import UserError
from tests.jaxpar.test_diloco import SETTINGS, reference
from jaxpar.core.optimizer.torchft_mode import check_torchft, launch_groups


@pytest.fixture
def lighthouse():
    """start(min_replicas) -> the address of a torchft lighthouse in this process (a dead group is seen in 1 s)."""
    from torchft._torchft import LighthouseServer

    servers = []

    def start(min_replicas: int) -> str:
        servers.append(LighthouseServer(bind="[::]:0", min_replicas=min_replicas, heartbeat_timeout_ms=1000))
        return servers[-1].address()

    yield start
    for server in servers:
        server.shutdown()


def launch(base, address: str, group: int, args: list[str], name: str, **env):
    """One group's launch (torchrun, one rank): its result, run directory and final weights file."""
    run_dir = base["tmp"] / f"{name}-{group}"
    final = f"{run_dir}.safetensors"
    mode = ["parallel.mesh=diloco=2", f"parallel.torchft_lighthouse={address}", f"parallel.torchft_group={group}"]
    command = torch_command(["--backend", "ddp", *args, *mode, f"run.dir={run_dir}", "--write-final", final], 1)
    return run_in_session(command, torch_env(**env), 240, f"torchft group {group}"), run_dir, final


def test_torchft_groups_equal_the_reference(base, lighthouse):
    """Both groups log the reference's losses (their mean) and end with its parameters, the same in both."""
    address, args = lighthouse(2), [*base["args"], *SETTINGS]  # both groups in every quorum from the first
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda g: launch(base, address, g, args, "torchft"), (0, 1)))
    for out, _, _ in runs:
        assert out.returncode == 0, out.stderr[-3000:]
        assert "DiLoCo with torchft: group" in out.stdout + out.stderr
    want = reference(load_config(None, [*args, "parallel.mesh=diloco=2"]), base["tmp"] / "tokens.bin")
    logged = [metrics(run_dir) for _, run_dir, _ in runs]
    got = [np.mean([m[s + 1]["loss"] for m in logged]) for s in range(len(want["loss"]))]
    np.testing.assert_allclose(got, want["loss"], rtol=1e-5)
    finals = [read_weights(final) for _, _, final in runs]
    assert_params_close(finals[0], want["params"])
    assert all(np.array_equal(finals[0][k], finals[1][k]) for k in finals[0])


def test_a_killed_group_comes_back_and_heals_from_the_live_one(base, lighthouse):
    """Group 1 is killed after step 3 and relaunched; group 0 trains on alone, then both end with one set of weights.

    Every step takes 0.5 s more (the fault hook), so that group 0 is still training when group 1 is back. Group 0
    logs every step. The relaunched group 1 starts from the initial weights, heals at its first meeting (the live
    group's parameters, optimizer state and step K) and continues from K: from there its learning rate is group 0's at
    every step (the schedule follows the step), it logs to the last step, and the final parameters are equal.
    """
    address, steps = lighthouse(1), 30
    args = [*base["args"], *SETTINGS, f"train.steps={steps}"]
    slow = {"TORCHPAR_FAULT_SLOW_STEP_S": "0.5"}

    def group_one():
        first, _, _ = launch(base, address, 1, args, "torchft-kill", TORCHPAR_FAULT_KILL_AFTER_STEP="3", **slow)
        assert first.returncode != 0
        return launch(base, address, 1, args, "torchft-kill", **slow)

    with ThreadPoolExecutor(2) as pool:
        survivor = pool.submit(launch, base, address, 0, args, "torchft-kill", **slow)
        back = pool.submit(group_one)
        runs = [survivor.result(), back.result()]
    for out, _, _ in runs:
        assert out.returncode == 0, out.stderr[-3000:]
    healed = re.search(r"torchft: group 1 healed from a live group at its step (\d+)", runs[1][0].stderr)
    assert healed, runs[1][0].stderr[-3000:]
    k, (live, back) = int(healed.group(1)), [metrics(run_dir) for _, run_dir, _ in runs]
    assert sorted(live) == list(range(1, steps + 1)) and 3 < k < steps
    assert [s for s in range(k, steps + 1) if s in back] == list(range(k, steps + 1))
    assert all(back[s]["lr"] == live[s]["lr"] for s in range(k + 1, steps + 1))
    finals = [read_weights(final) for _, _, final in runs]
    assert all(np.array_equal(finals[0][k], finals[1][k]) for k in finals[0])


def test_what_torchft_groups_do_not_run_with_is_refused_in_one_line():
    """Each refusal names its setting in one line; a config that runs gives the group count and this launch's mesh."""
    mode = ("parallel.torchft_lighthouse=localhost:29510", "parallel.mesh=diloco=2,dp=2", "checkpoint.every=0")
    for settings, backend, named in (
        ((), "fsdp", "--backend fsdp"),
        (("parallel.diloco_fragments=2",), "ddp", "parallel.diloco_fragments=2"),
        (("parallel.diloco_delay=1",), "ddp", "parallel.diloco_delay=1"),
        (("model.moe_experts=4", "model.moe_bias_update=0.01"), "ddp", "model.moe_bias_update"),
        (("checkpoint.every=5",), "ddp", "checkpoint.every=5"),
        (("parallel.torchft_group=2",), "ddp", "not one of the 2 groups"),
        (("parallel.mesh=dp=2",), "ddp", "needs diloco=G"),
    ):
        with pytest.raises(UserError, match=re.escape(named)) as e:
            check_torchft(tiny_config(*mode, *settings), backend)
        assert "\n" not in str(e.value)
    cfg = tiny_config(*mode, "parallel.torchft_group=1")
    assert check_torchft(cfg, "ddp") == 2
    ours, groups = launch_groups(cfg)
    assert ours.parallel.mesh == "dp=2" and groups == (1, 2)


def test_jaxpar_refuses_torchft_in_one_line():
    """jaxpar is one SPMD program: a lost group there is an elastic restart (docs/diloco.md), torchft is torchpar's."""
    cfg = tiny_config("parallel.torchft_lighthouse=localhost:29510")
    with pytest.raises(UserError, match="parallel.torchft_lighthouse") as e:
        check_contract(Run(cfg, "jaxpar", "", {"diloco": 2}))
    assert "\n" not in str(e.value)


def test_a_groups_throughput_counts_its_own_block_of_the_batch():
    """A torchft group's tokens/s and MFU count the tokens it trains: its block, 1/G of each global batch."""
    from jaxpar.core.model.flops import flops_per_token
    from jaxpar.core.run.hooks import Throughput

    one_launch = tiny_config("parallel.mesh=diloco=2,dp=2")
    group = tiny_config(
        "parallel.mesh=diloco=2,dp=2", "parallel.torchft_lighthouse=localhost:29510", "checkpoint.every=0"
    )
    per_step = {}
    for name, cfg in (("one launch", one_launch), ("group", group)):
        meter = Throughput(cfg, flops_per_token(cfg.model, cfg.data.seq_len), 1.0)
        meter.restart(0, 0.0)
        r = meter.record(3, 0.0)
        per_step[name] = (r["tokens_per_sec"] * r["step_time_s"], r["mfu"] / r["tokens_per_sec"])
    assert per_step["one launch"][0] == pytest.approx(one_launch.train.global_batch_size * one_launch.data.seq_len)
    assert per_step["group"][0] == pytest.approx(per_step["one launch"][0] / 2)
    assert per_step["group"][1] == pytest.approx(per_step["one launch"][1])  # the same FLOPs per token
