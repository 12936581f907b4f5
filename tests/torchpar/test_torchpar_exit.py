"""torchpar exits cleanly: nothing of the run's process groups is alive when main() returns (an abort at exit
would turn a correct run into a failed job)."""
import os
import sys

import pytest

from tests.helpers import TINY, run_in_session, torch_env

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
@pytest.mark.parametrize("backend,extra", [("ddp", []), ("fsdp", []), ("deepspeed", ["parallel.zero_stage=3"])])
def test_no_process_group_outlives_main(backend, extra, dataset, tmp_path):
    """When main() returns, its gloo groups are gone (their worker threads joined). A group still alive at
    interpreter exit keeps a worker that may be retiring a collective, waiting for the GIL, which CPython
    ends inside a C++ destructor: SIGABRT after a run that trained correctly (torchpar/dist.py)."""
    cmd = [sys.executable, "-c", _GROUPS_LEFT, "--backend", backend, *TINY, f"data.dataset={dataset}", *extra,
           f"run.dir={tmp_path}", "train.steps=2", "--write-final", str(tmp_path / "final.safetensors")]
    r = run_in_session(cmd, torch_env(), 120, f"{backend} run in one process")
    assert r.returncode == 0 and "gloo threads left: []" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
