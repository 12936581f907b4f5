"""optim.name=muon in torchpar (torchpar/optim.py).

The same Newton-Schulz as jaxpar's on one matrix (and as torch.optim.Muon's, up to its bfloat16); ddp and fsdp equal one
process, and jaxpar from the same weights file, over 10 steps; an fsdp run killed and resumed equals the uninterrupted
one (the momentum in DCP); under FSDP2 each rank runs Newton-Schulz on its share of the matrices.
"""

import json
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxpar.core.optimizer import muon
from jaxpar.optim import orthogonalize as jax_orthogonalize
from tests.helpers import free_port, metrics, run_in_session, torch_env
from tests.torchpar.runs import assert_resumes_exactly_after_sigkill, assert_same_run, jaxpar_run, run
from torchpar.optim import orthogonalize

MUON = ["optim.name=muon"]


def test_one_matrix_is_orthogonalised_alike():
    rng = np.random.default_rng(0)
    for shape, axes in (
        ((32, 128), ((0,), (1,))),
        ((128, 32), ((0,), (1,))),
        ((32, 3, 4, 8), ((0,), (2, 3))),
        ((4, 8, 32), ((0, 1), (2,))),
        ((4, 32, 16), ((1,), (2,))),
    ):
        x = rng.standard_normal(shape).astype(np.float32)
        ours = orthogonalize(torch.from_numpy(x), axes, 5).numpy()
        np.testing.assert_allclose(ours, np.asarray(jax_orthogonalize(jnp.asarray(x), axes, 5)), atol=1e-5)
    # torch.optim.Muon, one step from zero momentum: the same update, but for its bfloat16 iteration (~3% here)
    x = torch.from_numpy(rng.standard_normal((32, 128)).astype(np.float32))
    w = torch.zeros(32, 128, requires_grad=True)
    w.grad = x
    torch.optim.Muon([w], lr=1.0, weight_decay=0.0, adjust_lr_fn="match_rms_adamw").step()
    ours = -muon.lr_scale("match_rms_adamw", 32, 128) * orthogonalize(x, ((0,), (1,)), 5)
    assert (w.detach() - ours).abs().max() < 0.05 * ours.abs().max()


@pytest.mark.parametrize("world,dp,share", [(2, 1, 7), (4, 2, 5)])
def test_fsdp_ranks_share_the_newton_schulz_work(tmp_path, world, dp, share):
    """tests/torchpar/muon_shares.py's 13 matrices, FSDP2-sharded, stepped twice.

    Every rank equals one process, and its Newton-Schulz ran on its share -- 7 of them on fsdp=2: 2 of the four
    16x32, 2 of the four 16x16 (q, k, v, out), 1 of the 24x16 (padded with a zero matrix), its 2 experts; on
    dp=2,fsdp=2 1+1+1 and its fsdp shard's 2 experts -- where gathering every matrix everywhere runs all 13 on each
    rank.
    """
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={world}",
        f"--master_port={free_port()}",
        "tests/torchpar/muon_shares.py",
        str(tmp_path),
        str(dp),
    ]
    out = run_in_session(command, torch_env(), 120, "the FSDP2 Muon share")
    assert out.returncode == 0 and "alltoall" not in out.stderr, out.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(world)]
    assert [r["matrices"] for r in ranks] == [share] * world
    assert max(r["worst"] for r in ranks) < 1e-5


def test_backends_equal_one_process_and_jaxpar(base, reference):
    ref = jaxpar_run(base, MUON, "muon")
    assert abs(ref[2]["loss"] - reference[2]["loss"]) > 1e-4  # AdamW's run goes elsewhere: the setting is used
    for backend, nproc in (("none", 0), ("ddp", 2), ("fsdp", 2)):
        run_dir = base["tmp"] / f"muon-{backend}"
        run(["--backend", backend, *base["args"], *MUON, f"run.dir={run_dir}"], nproc=nproc)
        assert_same_run(metrics(run_dir), ref)


def test_fsdp_resumes_exactly_after_sigkill(base):
    assert_resumes_exactly_after_sigkill(base, "fsdp", MUON, "muon")
