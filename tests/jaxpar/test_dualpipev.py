"""DualPipeV on the hand-scheduled executor (issue 48 item 4).

One chunk's forward and another microbatch's whole backward of the other chunk in one tick, chunks placed in a V as
zb_v's, reproduces the single-device float32 run.
"""

import jax
import numpy as np
import pytest

from jaxpar.pipeline.tick_plan import COL, FB_CODES, tick_plan
from tests.helpers import assert_params_close, run_steps, tiny_config

DEEPER = ("model.n_layer=8", "optim.lr=3e-3", "optim.min_lr=3e-4")  # pp=4: 8 chunks of one layer


@pytest.fixture(scope="module")
def reference(dataset):
    """One device's run (model.remat only moves float32 rounding, as test_pipeline.py's zero-bubble cases use)."""
    return run_steps(tiny_config(*DEEPER), "dp=1", dataset, devices=jax.devices()[:1])


@pytest.mark.parametrize(
    "mesh,n,remat", [("pp=2", 2, "none"), pytest.param("pp=4", 4, "none", marks=pytest.mark.slow), ("pp=2", 2, "full")]
)
def test_dualpipev_matches_single_device(mesh, n, remat, dataset, reference):
    """DualPipeV's backward passes sum to one device's gradients.

    BW (B, then W from the projections' inputs and output gradients B hands out) alone or beside a forward, and the
    split B/W of the drain, sum to one device's gradients; with model.remat=full B recomputes what remat dropped.
    """
    cfg = tiny_config(*DEEPER, "parallel.pipeline_schedule=dualpipev", f"model.remat={remat}")
    got = run_steps(cfg, mesh, dataset, devices=jax.devices()[:n])
    np.testing.assert_allclose(got["loss"], reference["loss"], rtol=1e-5)
    assert_params_close(got["params"], reference["params"])


def test_dualpipev_ticks_overlap():
    """DualPipeV's tables run overlapped ticks and bound the residuals kept per device.

    The tables run overlapped ticks (each of the three FB branches on pp=2) and keep no more than 2S+1
    microbatch-chunks' residuals per device.
    """
    plan = tick_plan("dualpipev", 2, 4, 1)
    assert set(FB_CODES.values()) <= set(plan.tables[..., COL["code"]].flat)
    assert plan.res_slots - 1 <= 2 * 2 + 1
