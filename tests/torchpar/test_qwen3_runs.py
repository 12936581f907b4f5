"""Qwen3, Qwen3-MoE, Qwen3 with a sliding window and gpt-oss on torchpar's backends, under torchrun.

From one initial-weights file, ddp, fsdp and the pipeline (1f1b over 2 stages), and ddp with the experts split over ep
for Qwen3-MoE and gpt-oss, equal the one-process run, which equals jaxpar's on one device. jaxpar's layouts:
tests/jaxpar/test_qwen3.py and tests/jaxpar/test_gpt_oss.py.
"""

import pytest

from tests.helpers import metrics
from tests.jaxpar.test_gpt_oss import GPT_OSS
from tests.jaxpar.test_qwen3 import FAMILIES as QWEN3_FAMILIES
from tests.torchpar.runs import assert_same_run, jaxpar_run, run

# the slow tier as a whole: each family's fixture trains two runs before its first test (every commit holds torchpar
# to these families through the twins in tests/jaxpar/test_variants.py and test_sliding_window.py, and the oracle)
pytestmark = pytest.mark.slow
# gpt-oss: biases, sinks, experts with biases and the clamp, a window on layers 0 and 2 and none on 1 and 3
FAMILIES = {**QWEN3_FAMILIES, "gpt_oss": GPT_OSS}
EXPERTS = ("qwen3_moe", "gpt_oss")


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, base):
    """(name, its args from its own initial weights, the one-process run's metrics)."""
    name = request.param
    args = [a for a in base["args"] if not a.startswith("model.init_from=")] + list(FAMILIES[name])
    init = base["tmp"] / f"{name}-init.safetensors"
    run(["--backend", "none", "--write-init", str(init), *args])
    args.append(f"model.init_from={init}")
    run(["--backend", "none", *args, f"run.dir={base['tmp'] / name}"])
    return name, args, metrics(base["tmp"] / name)


def test_one_process_equals_jaxpar_from_the_same_weights(family, base):
    name, args, ref = family
    got = jaxpar_run({**base, "args": args}, [], name)
    assert ref[10]["loss"] < ref[1]["loss"] - 0.1, "the run should learn something"
    assert_same_run(got, ref)


@pytest.mark.parametrize(
    "backend,mesh",
    [("ddp", ""), ("fsdp", ""), ("ddp", "parallel.mesh=ep=2"), ("pipeline", "parallel.pipeline_schedule=1f1b")],
    ids=["ddp", "fsdp", "ddp-ep=2", "pipeline-1f1b"],
)
def test_each_backend_equals_one_process(family, base, backend, mesh):
    name, args, ref = family
    if "ep=" in mesh and name not in EXPERTS:
        pytest.skip("expert parallelism splits experts: a dense model has none")
    run_dir = base["tmp"] / f"{name}-{backend}{'-ep' if 'ep=' in mesh else ''}"
    run(["--backend", backend, *args, *([mesh] if mesh else []), f"run.dir={run_dir}"], nproc=2)
    assert_same_run(metrics(run_dir), ref)
