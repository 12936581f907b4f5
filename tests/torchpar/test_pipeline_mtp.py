"""torchpar's pipeline backend with multi-token prediction (model.mtp_depth=2).

The last stage's loss function runs the prediction modules on its output (the state before the final norm) and the
microbatch's rows (the schedule's target), the depths' lookups in its copy of the embedding table, whose gradient is
summed with the first stage's. Held to the one-process run: the loss, each depth's loss and the final weights.
"""

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.helpers import assert_params_close, metrics
from tests.torchpar.runs import assert_same_run, run

MTP = ["model.mtp_depth=2", "model.mtp_loss_weight=0.5", "train.steps=4", "train.microbatches=2"]
STEPS = range(1, 5)


def _args(base, family):
    return [a for a in base["args"] if not a.startswith("model.init_from=")] + MTP + family


@pytest.mark.parametrize("family", [[], ["model.family=llama", "model.n_kv_head=2"]], ids=["gpt2-tied", "llama"])
def test_mtp_on_a_pipeline_equals_one_process(family, base, tmp_path):
    """pp=2 on 1f1b.

    The weighted depths are ~0.5 x 5 on a loss of ~5: a last stage that dropped them, or a depth's lookups missing
    from the table's gradient, would differ far past 1e-5.
    """
    one, final_one = tmp_path / "one", tmp_path / "one.safetensors"
    run(["--backend", "none", *_args(base, family), f"run.dir={one}", "--write-final", str(final_one)])
    pp, final_pp = tmp_path / "pp", tmp_path / "pp.safetensors"
    run(
        [
            "--backend",
            "pipeline",
            *_args(base, family),
            "parallel.pipeline_schedule=1f1b",
            f"run.dir={pp}",
            "--write-final",
            str(final_pp),
        ],
        nproc=2,
    )
    got, ref = metrics(pp), metrics(one)
    assert_same_run(got, ref, steps=STEPS)
    for key in ("mtp_loss_1", "mtp_loss_2"):
        assert ref[1][key] > 1.0
        np.testing.assert_allclose([got[s][key] for s in STEPS], [ref[s][key] for s in STEPS], rtol=1e-5)
    have, want = load_file(str(final_pp)), load_file(str(final_one))
    assert any(name.startswith("mtp.") for name in want)
    # the project's bound for weights after Adam (tests/helpers.py): an element whose gradient is near float32
    # rounding moves by amplified noise (llama's down projection: one of 16,384 at 1.1e-5, 4.8e-3 relative)
    assert_params_close(have, want)


def test_what_the_pipeline_refuses_with_mtp_is_one_line():
    """Zero-bubble's split backward and FSDP2 inside the stages are refused in one line.

    1f1b runs, pp x dp too (measured equal to one process alike).
    """
    from jaxpar.core.errors import UserError
    from tests.helpers import tiny_config
    from torchpar.backends.pipeline import check_torch_pipeline

    mtp = ["model.mtp_depth=2", "model.n_layer=4"]
    with pytest.raises(UserError, match=r"model.mtp_depth runs on gpipe, .*got zb_h1\)") as refused:
        check_torch_pipeline(tiny_config(*mtp, "parallel.pipeline_schedule=zb_h1"), 2)
    assert "\n" not in str(refused.value)
    with pytest.raises(UserError, match="got 1f1b, fsdp=2"):
        check_torch_pipeline(tiny_config(*mtp, "parallel.mesh=pp=2,fsdp=2", "parallel.pipeline_schedule=1f1b"), 4)
    assert check_torch_pipeline(tiny_config(*mtp, "parallel.pipeline_schedule=1f1b"), 2)
    assert check_torch_pipeline(tiny_config(*mtp, "parallel.mesh=pp=2,dp=2", "parallel.pipeline_schedule=1f1b"), 4)
