"""torchpar's pipeline backend with a mixture of experts equals the one-process run.

The shape is configs/moe-tiny.yaml's at the tiny size: llama, 8 experts, 2 chosen, a shared one, the balance loss at
0.01 and the balance bias moved. Each stage passes the experts' per-row statistics on beside its activations, the last
stage's loss weighs in the balance loss (its gradient back through every stage's routers), and each stage moves its own
layers' bias by every layer's loads.
Held to the one-process run: losses, gradient norms, the experts' records and the final weights, bias included.
"""

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.helpers import metrics
from tests.torchpar.runs import assert_same_run, run

MOE = [
    "model.family=llama",
    "model.n_layer=4",
    "model.n_kv_head=2",
    "model.moe_experts=8",
    "model.moe_top_k=2",
    "model.moe_shared_experts=1",
    "model.moe_d_ff=16",
    "model.moe_aux_loss=0.01",
    "model.moe_bias_update=0.001",
    "optim.lr=3e-3",
    "optim.min_lr=3e-4",
    "train.microbatches=2",
]


def _args(base, *extra):
    return [a for a in base["args"] if not a.startswith("model.init_from=")] + MOE + list(extra)


@pytest.fixture(scope="module")
def one_process(base):
    run_dir, final = base["tmp"] / "pipeline-moe-one", base["tmp"] / "pipeline-moe-one.safetensors"
    run(["--backend", "none", *_args(base), f"run.dir={run_dir}", "--write-final", str(final)])
    return metrics(run_dir), load_file(str(final))


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_experts_on_a_pipeline_equal_one_process(schedule, base, one_process, tmp_path):
    """pp=2: each stage two expert layers.

    The balance loss is 0.01 x ~1 on a loss of ~5 (2e-3, far over the 1e-5 band) and the bias moves every layer's
    routing from step 2 on: a stage that dropped either would differ.
    """
    final = tmp_path / "final.safetensors"
    run(
        [
            "--backend",
            "pipeline",
            *_args(base),
            f"parallel.pipeline_schedule={schedule}",
            f"run.dir={tmp_path}",
            "--write-final",
            str(final),
        ],
        nproc=2,
    )
    got, (ref, weights) = metrics(tmp_path), one_process
    assert_same_run(got, ref)
    for key in ("moe_max_load", "moe_dropped", "moe_balance"):
        np.testing.assert_allclose(
            [got[s][key] for s in range(1, 11)], [ref[s][key] for s in range(1, 11)], rtol=1e-5, atol=1e-7
        )
    assert 0.01 * ref[1]["moe_balance"] / ref[1]["loss"] > 100 * 1e-5  # the balance loss counts
    have = load_file(str(final))
    assert np.all(np.abs(weights["blocks.moe.router.bias"]).max(-1) > 0)  # every layer's bias moved
    for name, want in weights.items():
        np.testing.assert_allclose(have[name], want, rtol=1e-4, atol=1e-5, err_msg=name)


def test_pp_by_fsdp_refuses_the_balance_bias():
    """FSDP2 inside the stages shards the bias each stage moves on whole parameters: one line; pp x dp runs it."""
    from jaxpar.core.errors import UserError
    from tests.helpers import tiny_config
    from torchpar.backends.pipeline import check_torch_pipeline

    moe = [a for a in MOE if not a.startswith("train.microbatches")]
    with pytest.raises(UserError, match="model.moe_bias_update with fsdp=2"):
        check_torch_pipeline(tiny_config(*moe, "parallel.mesh=pp=2,fsdp=2", "parallel.pipeline_schedule=1f1b"), 4)
    assert check_torch_pipeline(tiny_config(*moe, "parallel.mesh=pp=2,dp=2", "parallel.pipeline_schedule=1f1b"), 4)
