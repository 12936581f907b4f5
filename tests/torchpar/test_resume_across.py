"""A torchpar run moves between the DCP backends and world sizes (DCP reshards on load).

None, ddp, fsdp and pipeline each write a checkpoint that another resumes, and the run stays the one-process run.
DeepSpeed's checkpoints and DCP's do not mix: each refuses the other's in one line.
"""

import pytest

from tests.helpers import metrics
from tests.torchpar.runs import assert_same_run, run

# (backend, processes: 0 = one plain process, the step it stops after): every backend is written and resumed; the
# second chain takes the other 8 ordered pairs, so that all 12 of none/ddp/fsdp/pipeline are held to one process
CHAIN = [("fsdp", 2, 2), ("pipeline", 2, 4), ("ddp", 2, 6), ("none", 0, 8), ("fsdp", 2, None)]
EVERY_OTHER_PAIR = [
    ("fsdp", 2, 1),
    ("ddp", 2, 2),
    ("pipeline", 2, 3),
    ("fsdp", 2, 4),
    ("none", 0, 5),
    ("pipeline", 2, 6),
    ("none", 0, 7),
    ("ddp", 2, 8),
    ("fsdp", 2, None),
]


@pytest.mark.parametrize(
    "chain",
    [
        pytest.param(CHAIN, id="chain"),  # each backend writes and resumes
        pytest.param(EVERY_OTHER_PAIR, id="every-other-pair"),
    ],
)
def test_a_run_moves_across_every_dcp_backend(base, reference, chain):
    run_dir = base["tmp"] / f"across-{len(chain)}"
    for i, (backend, nproc, stop) in enumerate(chain):
        env = {"TORCHPAR_FAULT_SIGTERM_AFTER_STEP": str(stop)} if stop else {}
        out = run(["--backend", backend, *base["args"], "checkpoint.every=0", f"run.dir={run_dir}"], nproc=nproc, **env)
        assert i == 0 or "resumed from" in out.stderr, (backend, out.stderr[-2000:])
        assert max(metrics(run_dir)) == (stop or 10)
    assert_same_run(metrics(run_dir), reference)


def test_the_chains_hold_every_ordered_pair():
    pairs = {(a[0], b[0]) for chain in (CHAIN, EVERY_OTHER_PAIR) for a, b in zip(chain, chain[1:])}
    backends = ("none", "ddp", "fsdp", "pipeline")
    assert pairs == {(a, b) for a in backends for b in backends if a != b}


@pytest.mark.parametrize(
    "first,then,named",
    [("ddp", "deepspeed", "torch.distributed.checkpoint"), ("deepspeed", "fsdp", "DeepSpeed checkpoints")],
)
def test_deepspeed_and_dcp_checkpoints_refuse_each_other(first, then, named, base):
    run_dir = base["tmp"] / f"mix-{first}"
    run(["--backend", first, *base["args"], "train.steps=2", f"run.dir={run_dir}"], nproc=2)
    out = run(["--backend", then, *base["args"], "train.steps=4", f"run.dir={run_dir}"], nproc=2, expect_rc="nonzero")
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and named in errors[0], out.stderr[-2000:]
