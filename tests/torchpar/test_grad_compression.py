"""parallel.grad_compression in torchpar: bfloat16 on the wire and PowerSGD.

jaxpar's counterpart: tests/jaxpar/test_grad_compression.py. bfloat16 on the wire under ddp (torch's bf16 hook), fsdp
(FSDP2's reduce dtype) and deepspeed (communication_data_type); PowerSGD under ddp (torch's hook), its error-feedback
state resumed exactly after SIGKILL; what a backend does not run is refused in one line.
"""

import argparse

import numpy as np
import pytest

from jaxpar.core.config.schema import load_config
from jaxpar.core.config.contract import Run, check_contract
from jaxpar.core.errors import UserError
from tests.helpers import TINY, metrics
from tests.torchpar.runs import run

POWERSGD = ["parallel.grad_compression=powersgd", "parallel.powersgd_rank=2", "parallel.powersgd_warmup_steps=2"]


def powersgd_bytes(shapes, rank: int) -> int:
    """The issue's analytic figure.

    r(n+m) float32 elements for an n x m matrix (a tensor viewed as [shape[0], -1], r at most min(n, m)), n x m
    where that would not halve the matrix (torch's default min_compression_rate).
    """
    total = 0
    for shape in shapes:
        n, m = shape[0], int(np.prod(shape[1:], dtype=int))
        r = min(n, m, rank)
        total += r * (n + m) if 2 * r * (n + m) < n * m else n * m
    return 4 * total


def losses(run_dir) -> list[float]:
    m = metrics(run_dir)
    return [m[s]["loss"] for s in range(1, 11)]


@pytest.fixture(scope="module")
def shapes(base):
    """The model's parameter shapes (DDP's: a tied weight once), as base's config builds it."""
    from torchpar.trainer import build_model

    params = list(build_model(load_config(None, base["args"])).parameters())
    return [tuple(p.shape) for p in params], sum(p.numel() for p in params)


@pytest.fixture(scope="module")
def plain(base):
    """The uncompressed ddp run on 2 processes."""
    run(["--backend", "ddp", *base["args"], f"run.dir={base['tmp'] / 'plain-ddp'}"], nproc=2)
    return losses(base["tmp"] / "plain-ddp")


def test_bf16_on_the_wire_under_every_backend(base, plain, shapes):
    """bfloat16 on the wire changes each backend's run by its rounding only, alike on every backend.

    Each backend's run moves off the float32 one (the setting acts: step 3 on differs), by bfloat16's rounding only
    (within 1e-3 after 10 steps), and the three agree with each other within 1e-5: they reduce the same bfloat16 values.
    """
    runs = {}
    for backend, extra in (("ddp", []), ("fsdp", []), ("deepspeed", ["parallel.zero_stage=2"])):
        run_dir = base["tmp"] / f"bf16-{backend}"
        run(
            ["--backend", backend, *base["args"], *extra, "parallel.grad_compression=bf16", f"run.dir={run_dir}"],
            nproc=2,
        )
        runs[backend] = losses(run_dir)
        assert runs[backend][2:] != plain[2:], backend
        np.testing.assert_allclose(runs[backend], plain, rtol=1e-3, err_msg=backend)
    sent = {name: metrics(base["tmp"] / name)[5]["grad_comm_bytes"] for name in ("plain-ddp", "bf16-ddp")}
    assert sent["bf16-ddp"] * 2 == sent["plain-ddp"] == 4 * shapes[1]  # float32 gradients, then bfloat16
    np.testing.assert_allclose(runs["fsdp"], runs["ddp"], rtol=1e-5)
    np.testing.assert_allclose(runs["deepspeed"], runs["ddp"], rtol=1e-5)


def test_powersgd_resumes_exactly_after_sigkill(base, plain, shapes):
    """Rank-2 PowerSGD after 2 plain steps, killed after step 5 (checkpoint of step 4).

    The resumed run restores each rank's error buffers and Q factors and equals the uninterrupted one bit for bit.
    With another rank r the buffers stay and the factors start afresh; on 4 ranks each takes the mean of the 2 saved
    buffers: both say so and compress from their first step (no second warm-up). More than 2 ranks need the one
    gradient bucket ddp.one_bucket_mb gives PowerSGD over gloo.
    """
    full, half = base["tmp"] / "psgd-full", base["tmp"] / "psgd-half"
    run(["--backend", "ddp", *base["args"], *POWERSGD, f"run.dir={full}"], nproc=2)
    assert losses(full)[:3] == plain[:3] and losses(full)[3:] != plain[3:]  # the warm-up, then compressed
    sent = [metrics(full)[s]["grad_comm_bytes"] for s in range(1, 11)]
    analytic = powersgd_bytes(shapes[0], 2)
    assert sent[:2] == [4 * shapes[1]] * 2 and analytic < 4 * shapes[1] / 2
    assert all(analytic / 1.1 <= b <= 1.1 * analytic for b in sent[2:]), (sent, analytic)
    args = ["--backend", "ddp", *base["args"], *POWERSGD, "checkpoint.every=2", f"run.dir={half}"]
    run(args, nproc=2, expect_rc="nonzero", TORCHPAR_FAULT_KILL_AFTER_STEP="5")
    out = run(args, nproc=2)
    assert "resumed from" in out.stderr and "PowerSGD" not in out.stderr
    assert losses(half) == losses(full)
    for steps, nproc, extra, said in (
        (12, 2, ["parallel.powersgd_rank=1"], "rank r 2 -> 1: its factors start"),
        (14, 4, [], "error buffers of 2 ranks averaged onto 4"),
    ):
        out = run(args + [f"train.steps={steps}", *extra], nproc=nproc)
        assert "resumed from" in out.stderr and said in out.stderr and "afresh (after" not in out.stderr, out.stderr
        sent = metrics(half)
        assert max(sent) == steps and sent[steps - 1]["grad_comm_bytes"] < 4 * shapes[1] / 2  # compressed at once
    assert sent[12]["grad_comm_bytes"] < sent[14]["grad_comm_bytes"]  # rank 1 sends less than rank 2
    assert analytic / 1.1 <= sent[14]["grad_comm_bytes"] <= 1.1 * analytic


@pytest.mark.parametrize(
    "backend,key,named",
    [
        ("fsdp", "parallel.grad_compression=powersgd", "FSDP2 reduce-scatters flat shards"),
        ("deepspeed", "parallel.grad_compression=powersgd", "no 1-bit or 0/1 Adam"),
        ("none", "parallel.grad_compression=bf16", "not used by torchpar --backend none"),
        ("pipeline", "parallel.grad_compression=bf16", "not used by torchpar --backend pipeline"),
        ("ddp", "parallel.powersgd_rank=2", "applies with parallel.grad_compression=powersgd"),
        ("ddp", "parallel.grad_compression=powersgd model.compute_dtype=float16", "poison every later step"),
        ("jaxpar", "parallel.grad_compression=bf16", "applies with dp or fsdp > 1"),  # one device: nothing to reduce
    ],
)
def test_what_a_backend_does_not_run_is_refused(backend, key, named):
    cfg = load_config(None, TINY + key.split())
    with pytest.raises(UserError, match=named) as refused:
        if backend == "jaxpar":
            check_contract(Run(cfg, "jaxpar", "", {"dp": 1}))
        else:
            from torchpar.checks import check_backend_settings

            check_backend_settings(cfg, argparse.Namespace(backend=backend, cpu_offload=False, deepspeed_config=""))
    assert "\n" not in str(refused.value)


def test_powersgd_on_four_ranks_past_one_default_bucket(base):
    """3.4 MB of gradients, more than DDP's 1 MB first bucket.

    Without ddp.one_bucket_mb gloo pairs collectives of different buckets across 4 ranks and the step aborts or
    hangs after the warm-up.
    """
    run_dir = base["tmp"] / "psgd-buckets"
    out = run(
        [
            "--backend",
            "ddp",
            *base["args"],
            *POWERSGD,
            "model.d_model=128",
            "model.n_layer=4",
            "model.init_from=",
            "train.steps=4",
            "run.peer_timeout_s=60",
            f"run.dir={run_dir}",
        ],
        nproc=4,
    )
    sent = [metrics(run_dir)[s]["grad_comm_bytes"] for s in range(1, 5)]
    assert sent[2] == sent[3] < sent[0] / 4, (sent, out.stderr[-1000:])


def test_a_deepspeed_json_that_contradicts_bf16_is_refused(tmp_path):
    from torchpar.checks import check_backend_settings

    user = tmp_path / "ds.json"
    user.write_text('{"communication_data_type": "fp32"}')
    cfg = load_config(None, TINY + ["parallel.grad_compression=bf16"])
    with pytest.raises(UserError, match="communication_data_type='fp32'"):
        check_backend_settings(
            cfg, argparse.Namespace(backend="deepspeed", cpu_offload=False, deepspeed_config=str(user))
        )


class _RunsCode:
    """A pickle that would create a file when unpickled: what a hostile run directory could hold."""

    def __init__(self, target):
        self.target = str(target)

    def __reduce__(self):
        return (open, (self.target, "w"))


def test_powersgd_state_loads_no_code(tmp_path):
    """PowerSGD's saved state loads as data, executing no code.

    PowerSGD's saved state round-trips as tensors and plain numbers (numpy's generator included, so the random draws go
    on where they were), and a file holding any other object is refused in one line, unexecuted.
    """
    import torch
    from types import SimpleNamespace

    from torchpar.backends.ddp import PowerSGDCheckpoint

    env = SimpleNamespace(rank=0, world=1, device="cpu", is_main=True)
    rng = np.random.RandomState(3)
    rng.randn(5)
    state = SimpleNamespace(
        rng=rng,
        error_dict={0: torch.arange(4.0)},
        p_memory_dict={},
        q_memory_dict={},
        iter=7,
        total_numel_before_compression=10,
        total_numel_after_compression=4,
        next_stats_report=0,
        start_powerSGD_iter=2,
    )
    buckets = (1, 25, "cpu", 2)
    PowerSGDCheckpoint(state, env, buckets).save(str(tmp_path))
    expected = rng.randn(3)
    fresh = SimpleNamespace(**{**vars(state), "rng": np.random.RandomState(0), "iter": 0})
    PowerSGDCheckpoint(fresh, env, buckets).load(str(tmp_path))
    assert fresh.iter == 7 and torch.equal(fresh.error_dict[0], torch.arange(4.0))
    np.testing.assert_array_equal(fresh.rng.randn(3), expected)

    hostile = tmp_path / "hostile"
    hostile.mkdir()
    torch.save({"rng": _RunsCode(tmp_path / "ran"), "buckets": buckets}, hostile / "powersgd-rank0-of-1.pt")
    with pytest.raises(UserError, match="not unpickled"):
        PowerSGDCheckpoint(fresh, env, buckets).load(str(hostile))
    assert not (tmp_path / "ran").exists()
