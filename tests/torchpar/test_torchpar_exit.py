"""torchpar exits cleanly.

Nothing of the run's process groups is alive when main() returns (an abort at exit would turn a correct run into a
failed job).
"""

import os
import sys

import pytest

from tests.helpers import TINY, free_port, run_in_session, torch_env

_GROUPS_LEFT = """
import os
import sys
import torchpar.train
rc = torchpar.train.main(sys.argv[1:])
tasks = "/proc/self/task"
names = [open(os.path.join(tasks, t, "comm")).read().strip() for t in os.listdir(tasks)]
print("gloo threads left:", sorted(n for n in names if "gloo" in n))
sys.exit(rc)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread names from Linux's /proc")
@pytest.mark.every_commit  # each backend's run to a clean exit, on every commit (conftest.py: test tiers)
@pytest.mark.parametrize("backend,extra", [("ddp", []), ("fsdp", []), ("deepspeed", ["parallel.zero_stage=3"])])
def test_no_process_group_outlives_main(backend, extra, dataset, tmp_path):
    """When main() returns, its gloo groups are gone (their worker threads joined).

    A group still alive at interpreter exit keeps a worker that may be retiring a collective, waiting for the GIL,
    which CPython ends inside a C++ destructor: SIGABRT after a run that trained correctly (torchpar/dist.py).
    """
    cmd = [
        sys.executable,
        "-c",
        _GROUPS_LEFT,
        "--backend",
        backend,
        *TINY,
        f"data.dataset={dataset}",
        *extra,
        f"run.dir={tmp_path}",
        "train.steps=2",
        "--write-final",
        str(tmp_path / "final.safetensors"),
    ]
    r = run_in_session(cmd, torch_env(), 120, f"{backend} run in one process")
    assert r.returncode == 0 and "gloo threads left: []" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]


_REFUSES = """
import os
import sys
import time
from jaxpar.core.errors import UserError, cli

@cli(rank=lambda: int(os.environ["RANK"]))
def main():
    if os.environ["RANK"] == "0":
        time.sleep(3)  # rank 0 meets the error last
    raise UserError("the same refusal on every rank")

sys.exit(main())
"""


def test_a_refusal_is_printed_by_rank_0_when_another_rank_meets_it_first(tmp_path):
    """torchrun stops every worker as soon as one fails.

    A rank other than 0 that refused first must not get rank 0 stopped before it says why (the line was lost in CI
    under load: a fuzz regression's refusal read as an error). The line comes once, from rank 0, and torchrun fails.
    """
    script = tmp_path / "refuses.py"
    script.write_text(_REFUSES)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        str(script),
    ]
    r = run_in_session(cmd, torch_env(), 120, "a refusal under torchrun")
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode != 0 and errors == ["error: the same refusal on every rank"], r.stderr[-3000:]
