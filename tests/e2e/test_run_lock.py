"""One writer per run directory (jaxpar/core/run/lock.py).

A second trainer on a run.dir in use is refused in one line naming the holder and touches nothing; a holder's death
leaves a lock the next run takes over; a conversion writing a run takes it too; a file system that cannot lock warns (or
refuses) in one line.

Multi-process runs share the lock (only rank 0 / jax process 0 takes it): the torchrun runs of tests/torchpar
(e.g. tests/torchpar/test_torchpar.py::test_fsdp_resume_after_sigkill_and_on_one_process: 2 ranks killed by
SIGKILL, then resumed under torchrun) and jax.distributed's in tests/e2e/test_multiprocess.py pass through it.
"""

import datetime
import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from jaxpar.core.run import lock as run_lock
from jaxpar.core.errors import UserError
from jaxpar.core.run.loop import claim_run_dir
from jaxpar.core.run.lock import RunLock
from tests.helpers import ROOT, TINY, metrics, run_cli, tiny_config, torch_env

STEPS = 6
JAX_ARGS = ["--mesh", "dp=1", f"train.steps={STEPS}", "checkpoint.every=2"]


def start(run_dir, dataset, module: str, *args: str, env=None) -> subprocess.Popen:
    """`python -m module` on the tiny config, in its own session (its pid is the trainer's)."""
    cmd = [sys.executable, "-m", module, *TINY, f"data.dataset={dataset}", f"run.dir={run_dir}", *args]
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=torch_env(**(env or {})),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def wait_for_step(proc: subprocess.Popen, run_dir, step: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not (os.path.exists(run_dir / "metrics.jsonl") and step in metrics(run_dir)):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"no step {step} in {timeout} s"
        time.sleep(0.05)


def files(path) -> dict:
    """Every file and directory under `path`: size and modification time (what a writer would change)."""
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.rglob("*"))}


def assert_names_holder(stderr: str, pid: int, not_before: float) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert "is in use by another run" in lines[0] and f"host {socket.gethostname()}, pid {pid}, since " in lines[0]
    since = re.search(r"since (\S+ \S+ [+-]\d{4})", lines[0]).group(1)
    took = datetime.datetime.strptime(since, "%Y-%m-%d %H:%M:%S %z").timestamp()
    assert not_before - 1 <= took <= time.time(), (since, not_before)  # the holder's start, to the second


def test_a_second_trainer_on_a_run_dir_in_use_is_refused_and_touches_nothing(dataset, tmp_path):
    """A second trainer on a run dir in use is refused and leaves the first run untouched.

    Started while the first holds run.dir (stopped by SIGSTOP after step 2, its steps slowed so that it is still mid-run
    then): the same command, and one with checkpoint.resume=false (which would move the run aside), exit 2 with the
    holder's host, pid and start; the first then completes with one metrics row per step.
    """
    run_dir, t0 = tmp_path / "run", time.time()
    first = start(run_dir, dataset, "jaxpar.train", *JAX_ARGS, env={"JAXPAR_FAULT_SLOW_STEP_S": "1"})
    try:
        wait_for_step(first, run_dir, 2)
        os.kill(first.pid, signal.SIGSTOP)
        assert max(metrics(run_dir)) < STEPS, "the first run ended before it was stopped"
        before = files(tmp_path)
        for extra in ([], ["checkpoint.resume=false"]):
            second = run_cli(run_dir, dataset, *JAX_ARGS, *extra)
            assert second.returncode == 2, second.stderr
            assert_names_holder(second.stderr, first.pid, t0)
            assert files(tmp_path) == before  # nothing written, nothing moved aside
        os.kill(first.pid, signal.SIGCONT)
        out, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            os.kill(first.pid, signal.SIGCONT)
    assert first.returncode == 0, err
    with open(run_dir / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == list(range(1, STEPS + 1))


def test_a_killed_holder_leaves_its_lock_and_the_next_run_takes_it_over(dataset, tmp_path):
    """torchpar (the run sequence is shared) killed by SIGKILL after step 3: the lock file names the dead process.

    The same command then resumes from step 2's checkpoint and completes.
    """
    args = ["--backend", "none", "train.steps=4", "checkpoint.every=2"]
    killed = start(tmp_path, dataset, "torchpar.train", *args, env={"TORCHPAR_FAULT_KILL_AFTER_STEP": "3"})
    _, err = killed.communicate(timeout=300)
    assert killed.returncode == -signal.SIGKILL, err
    assert json.loads((tmp_path / "lock").read_text())["pid"] == killed.pid
    resumed = run_cli(tmp_path, dataset, *args, module="torchpar.train")
    assert resumed.returncode == 0 and "resumed from" in resumed.stderr, resumed.stderr
    assert sorted(metrics(tmp_path)) == [1, 2, 3, 4]
    RunLock(str(tmp_path)).acquire().release()  # and let go at its end


def test_resume_false_moves_the_old_run_aside_and_locks_the_new_run_dir(tmp_path):
    """The lock file goes aside with the old run: the new run.dir is locked again, the old lock let go."""

    class Agreement:
        def any_of(self, flag):
            return flag

    class OneProcess:
        is_main, processes = True, Agreement()

    run_dir = tmp_path / "run"
    os.makedirs(run_dir / "checkpoints")
    (run_dir / "config.json").write_text("{}")
    cfg = tiny_config(f"run.dir={run_dir}", "checkpoint.resume=false")
    with RunLock(str(run_dir)) as lock:
        claim_run_dir(cfg, OneProcess(), lock)
        assert (tmp_path / "run.prev-1" / "config.json").exists() and os.listdir(run_dir) == ["lock"]
        with pytest.raises(UserError, match=f"pid {os.getpid()}, since"):
            RunLock(str(run_dir)).acquire()
        RunLock(str(tmp_path / "run.prev-1")).acquire().release()


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EIO], ids=["ENOLCK", "EIO"])
def test_a_file_system_that_cannot_lock(code, tmp_path, monkeypatch, capsys):
    """No lock support (ENOLCK, EOPNOTSUPP, ENOSYS): one warning, the run goes on; any other failure: one line."""

    def fail(*_):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(run_lock.fcntl, "flock", fail)
    if code == errno.ENOLCK:
        with RunLock(str(tmp_path)).acquire() as lock:
            lock.acquire()  # again (after a move aside): no second warning
        warned = capsys.readouterr().err.strip().splitlines()
        assert len(warned) == 1 and warned[0].startswith("warning: ") and os.strerror(code) in warned[0], warned
    else:
        with pytest.raises(UserError, match=f"cannot lock .*: {os.strerror(code)}$"):
            RunLock(str(tmp_path)).acquire()


def test_a_conversion_into_a_run_dir_in_use_is_refused(tmp_path, capsys):
    """jaxpar.tools.convert writing a run takes the lock while it writes.

    Refused, nothing written, while a trainer holds run.dir; done, and the lock let go, once it is free.
    """
    import jax

    from jaxpar.core.weights.names import save_weights
    from jaxpar.state import init_state
    from jaxpar.tools import convert
    from jaxpar.formats.train_state import single_device_layout

    cfg = tiny_config()
    weights, run_dir = str(tmp_path / "w.safetensors"), tmp_path / "run"
    save_weights(weights, jax.device_get(init_state(single_device_layout(cfg))["params"]), vars(cfg.model))
    argv = ["--from", "shared", weights, "--to", "jaxpar", str(run_dir)]
    with RunLock(str(run_dir)).acquire():
        assert convert.main(argv) == 2
        assert os.listdir(run_dir) == ["lock"]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"is in use by another run: host {socket.gethostname()}, pid {os.getpid()}" in err[0]
    assert convert.main(argv) == 0
    RunLock(str(run_dir)).acquire().release()
