"""Issue 57's "say what happens": what a command does that its user may not expect is said in one line.

A multi-process backend started as one plain process, a device count the user fixed in XLA_FLAGS. (The other points are
tested beside their subjects: unknown config keys in tests/core/test_config.py, the learning rate a resume moves in
tests/jaxpar/test_resume_settings.py, a tokenizer smaller than asked in tests/core/test_data.py, the planner's progress
in tests/jaxpar/test_plan.py.)
"""

import os
import subprocess
import sys

import pytest

from jaxpar.core.errors import UserError
from tests.helpers import ROOT, TINY, torch_env

pytest.importorskip("torch")


def plain_torchpar(run_dir, dataset, *args: str) -> subprocess.CompletedProcess:
    """`python -m torchpar.train` on the tiny config as one plain process.

    No launcher's variables (torchrun's, srun's) in its environment.
    """
    env = {k: v for k, v in torch_env().items() if not k.startswith("SLURM_")}
    cmd = [sys.executable, "-m", "torchpar.train", *TINY, f"data.dataset={dataset}", f"run.dir={run_dir}", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)


def test_ddp_as_one_plain_process_says_so_and_trains(dataset, tmp_path):
    """The run goes on as one process (tests and smoke runs use it), with one line saying how to start more."""
    r = plain_torchpar(tmp_path, dataset, "--backend", "ddp", "train.steps=2", "model.n_layer=1")
    assert r.returncode == 0, r.stderr[-3000:]
    said = [line for line in r.stderr.splitlines() if "without a launcher" in line]
    assert said == [
        (
            "torchpar: --backend ddp without a launcher runs as one process; to run N, start torchrun "
            "--nproc_per_node=N -m torchpar.train --backend ddp ... (or srun, one task each)"
        )
    ], r.stderr


def test_a_pipeline_as_one_plain_process_is_refused_in_one_line(dataset, tmp_path):
    """One process is a pipeline of one stage: refused before run.dir is written."""
    r = plain_torchpar(tmp_path, dataset, "--backend", "pipeline", "train.steps=2")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        (
            "error: --backend pipeline without a launcher is one process, a pipeline of one stage: start one "
            "process per stage with torchrun --nproc_per_node=N -m torchpar.train --backend pipeline ... (or srun, "
            "one task each), or "
            "run one process with --backend none"
        )
    ], r.stderr
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize(
    "flags, count",
    [
        ("", None),
        ("--xla_force_host_platform_device_count=8", 8),
        (("--xla_cpu_foo=1 --xla_force_host_platform_device_count=4 --xla_force_host_platform_device_count=2"), 2),
    ],
)
def test_the_users_device_count_is_read_from_xla_flags(flags, count, monkeypatch):
    """XLA_FLAGS's --xla_force_host_platform_device_count, the last one where it is given twice (as XLA reads it)."""
    from jaxpar.mesh import forced_cpu_devices

    monkeypatch.setenv("XLA_FLAGS", flags)
    assert forced_cpu_devices() == count


def test_a_mesh_needing_another_count_than_xla_flags_sets_is_refused():
    """The user's count is kept: a mesh of fixed axes needing another is refused naming both numbers."""
    from jaxpar.mesh import check_forced_count

    with pytest.raises(
        UserError,
        match="the mesh dp=4,tp=4 needs 16 devices; XLA_FLAGS sets "
        "--xla_force_host_platform_device_count=8: choose a mesh of 8 devices",
    ):
        check_forced_count({"dp": 4, "tp": 4}, 8, 1)
    with pytest.raises(UserError, match="=4 per process, 8 over 2 processes"):
        check_forced_count({"dp": 4}, 4, 2)
    assert check_forced_count({"dp": 2, "tp": 4}, 8, 1) == 8 and check_forced_count({"dp": -1, "tp": 2}, 4, 2) == 8


def test_a_fill_axis_takes_the_count_xla_flags_sets():
    """--mesh dp=-1 (the default mesh) spans the devices the user simulated, not jaxpar's default of 8."""
    code = "from jaxpar.mesh import setup_devices; setup_devices({'dp': -1}); import jax; print(len(jax.devices()))"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    env.pop("JAXPAR_CPU_DEVICES", None)
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert r.returncode == 0 and r.stdout.split() == ["2"], r.stdout + r.stderr[-3000:]


POOL_CODE = """
from jaxpar.mesh import setup_devices; setup_devices({'dp': 4})
import collections, glob, os, jax
jax.numpy.ones(3).sum().block_until_ready()
names = collections.Counter(open(t).read().strip() for t in glob.glob('/proc/self/task/*/comm'))
print(os.environ.get('PJRT_NPROC'), names['tf_XLAEigen'])
"""


@pytest.mark.parametrize("users", [None, "3"])
def test_xla_cpu_pool_grows_with_the_simulated_devices(users):
    """4 simulated devices: XLA:CPU's pool has 4 threads per device (not one per core); a PJRT_NPROC the user set stays.

    With one per core, collectives waiting for their peers held every thread of a 2-core machine while a peer's
    collective sat queued: a deadlock (jaxpar/mesh.py size_cpu_pool).
    """
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "JAXPAR_CPU_DEVICES", "XLA_FLAGS")}
    env.update({"JAX_PLATFORMS": "cpu", **({"PJRT_NPROC": users} if users else {})})
    r = subprocess.run(
        [sys.executable, "-c", POOL_CODE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert r.returncode == 0, r.stderr[-2000:]
    setting, threads = r.stdout.split()
    expected = max(os.cpu_count() or 1, 16)
    if users:
        assert setting == users and int(threads) < expected, r.stdout
    else:
        assert setting == str(expected) and int(threads) == expected, r.stdout
