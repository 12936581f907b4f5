"""`--mesh dp=2,tp=4` -> jax.sharding.Mesh, CPU device simulation, multi-process start-up.

Call `setup_devices` before anything touches a jax backend: the simulated CPU device count
and `jax.distributed.initialize` must both happen before jax initialises.
"""

from __future__ import annotations

import math
import os
import re

from absl import logging as absl_logging

from jaxpar.core.errors import UserError
from jaxpar.core.config.mesh_spec import AXES, format_mesh, resolve_sizes
from jaxpar.core.run.peers import library_timeout_s
from jaxpar.xla_flags import set_gpu_flags

DEFAULT_CPU_DEVICES = 8  # simulated devices for a -1 mesh axis without accelerator (or JAXPAR_CPU_DEVICES)
MAX_CPU_DEVICES = 4096  # more simulated devices take jax minutes to create (4096: ~8 s): refuse, don't hang


def _env(*names: str) -> str | None:
    for n in names:
        if os.environ.get(n):
            return os.environ[n]
    return None


def distributed_env() -> tuple[dict | None, int]:
    """(jax.distributed.initialize arguments or None for one process, the process count): JAXPAR_* or JAX_* variables.

    Else a worker of torchrun's elastic agent (elastic_env); under `srun` (SLURM_NTASKS > 1) jax reads SLURM_*
    itself (one process per GPU).
    """
    addr = _env("JAXPAR_COORDINATOR", "JAX_COORDINATOR_ADDRESS")
    nproc = _env("JAXPAR_NUM_PROCESSES", "JAX_NUM_PROCESSES")
    pid = _env("JAXPAR_PROCESS_ID", "JAX_PROCESS_ID")
    if addr and nproc and pid is not None:
        return {"coordinator_address": addr, "num_processes": int(nproc), "process_id": int(pid)}, int(nproc)
    if os.environ.get("TORCHELASTIC_RUN_ID") and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return elastic_env(), int(os.environ["WORLD_SIZE"])
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return {}, int(os.environ["SLURM_NTASKS"])
    return None, 1


def elastic_env() -> dict:
    """jax.distributed's arguments for a worker of torchrun's agent, read afresh at every (re)start.

    The agent gives each group its RANK and WORLD_SIZE and MASTER_ADDR, the first worker's host, and MASTER_PORT, a
    port free there for the workers' store -- jax's coordinator (process 0) here -- unless the agent shares its own
    store (TORCHELASTIC_USE_AGENT_STORE; then one port above; JAXPAR_COORDINATOR_PORT to choose). With several
    workers per host each takes the GPU of its LOCAL_RANK.
    """
    port = int(os.environ["MASTER_PORT"]) + (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True")
    port = os.environ.get("JAXPAR_COORDINATOR_PORT") or str(port)
    dist = {
        "coordinator_address": f"{os.environ['MASTER_ADDR']}:{port}",
        "num_processes": int(os.environ["WORLD_SIZE"]),
        "process_id": int(os.environ["RANK"]),
    }
    if _has_accelerator() and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:
        dist["local_device_ids"] = [int(os.environ["LOCAL_RANK"])]
    return dist


def process_id() -> int:
    """This process's index among the run's processes, before jax.distributed starts (which would tell).

    The launcher's variables, as distributed_env reads them (srun: SLURM_PROCID); 0 for one process.
    """
    dist, _ = distributed_env()
    return int(dist["process_id"]) if dist and "process_id" in dist else int(os.environ.get("SLURM_PROCID", "0"))


def _has_accelerator() -> bool:
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0] not in ("cpu", "")
    return os.path.exists("/dev/nvidiactl") or any(os.path.exists(f"/dev/accel{i}") for i in range(8))


def _has_gpu() -> bool:
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0] in ("cuda", "gpu", "rocm")
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/kfd")


def cpu_devices_for_elastic_axis(sizes: dict[str, int], processes: int) -> int:
    """Simulated devices for a mesh with a -1 axis: one process, DEFAULT_CPU_DEVICES (or the fixed axes' product).

    Several, the fewest per process that hold the fixed axes -- one per process like a GPU each, so the -1 axis
    grows and shrinks with the processes an elastic agent gives the run.
    """
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if processes == 1:
        return max(fixed, DEFAULT_CPU_DEVICES)
    return -(-fixed // processes) * processes


FORCED_COUNT = "xla_force_host_platform_device_count"


def forced_cpu_devices() -> int | None:
    """The simulated CPU devices per process that the user set in XLA_FLAGS, or None.

    Read from --xla_force_host_platform_device_count=N, the last one winning as in XLA.
    """
    found = re.findall(rf"--{FORCED_COUNT}=(\d+)", os.environ.get("XLA_FLAGS", ""))
    return int(found[-1]) if found else None


def check_forced_count(sizes: dict[str, int], forced: int, processes: int) -> int:
    """The simulated devices of all processes where XLA_FLAGS sets their count (the user's machine: kept as set).

    A mesh of fixed axes that needs another count is refused, naming both numbers.
    """
    total = forced * processes
    needed = math.prod(sizes.values())
    if -1 not in sizes.values() and needed != total:
        per = f" per process, {total} over {processes} processes" if processes > 1 else ""
        raise UserError(
            f"the mesh {format_mesh(sizes)} needs {needed} device{'s' * (needed > 1)}; XLA_FLAGS sets "
            f"--{FORCED_COUNT}={forced}{per}: choose a mesh of {total} devices, or drop the flag (jaxpar "
            "then simulates the mesh's devices itself)"
        )
    return total


POOL_THREADS_PER_DEVICE = 4  # XLA:CPU's pool for simulated devices (PJRT_NPROC): size_cpu_pool
MAX_POOL_THREADS = 256


def size_cpu_pool(devices: int) -> None:
    """Give XLA:CPU's thread pool POOL_THREADS_PER_DEVICE threads per simulated device, where the user set no size.

    XLA:CPU runs a program's independent operations on one pool that all of a process's simulated devices share,
    sized by the cores (PJRT_NPROC overrides). A collective there blocks its thread until every device of its group
    arrives; with more devices than cores, the collectives waiting can hold every thread while a device's other
    collective, the one its peers wait on, sits queued behind them: a deadlock XLA aborts after 40 s (docs/fuzz.md).
    """
    threads = min(MAX_POOL_THREADS, max(os.cpu_count() or 1, POOL_THREADS_PER_DEVICE * devices))
    os.environ.setdefault("PJRT_NPROC", str(threads))


def setup_devices(sizes: dict[str, int], peer_timeout_s: float | None = None) -> None:
    """Before jax starts: XLA's GPU options on a GPU.

    Simulate the mesh's devices on CPU if no accelerator (as many as JAXPAR_CPU_DEVICES or XLA_FLAGS's device count
    says, where set; else the mesh's), with threads for their collectives (size_cpu_pool); join processes (the
    coordination service's heartbeat and shutdown timeouts sit above run.peer_timeout_s: core/run/peers.py).
    """
    import jax  # deferred: jax (~1 s): command lines import this before parsing

    dist, nproc = distributed_env()
    if _has_gpu():
        set_gpu_flags()
    if not _has_accelerator():
        forced = forced_cpu_devices()
        if os.environ.get("JAXPAR_CPU_DEVICES"):  # a fixed simulated machine, whatever the mesh
            total = int(os.environ["JAXPAR_CPU_DEVICES"])
        elif forced is not None:  # the user's count in XLA_FLAGS, which jax_num_cpu_devices would override
            total = check_forced_count(sizes, forced, nproc)
        elif -1 in sizes.values():
            total = cpu_devices_for_elastic_axis(sizes, nproc)
        else:
            total = math.prod(sizes.values())
        if total > MAX_CPU_DEVICES:
            raise UserError(
                f"mesh {format_mesh(sizes)} needs {total} devices; without an accelerator they are "
                f"simulated on the CPU, at most {MAX_CPU_DEVICES}"
            )
        if total % nproc:
            raise UserError(f"{total} simulated CPU devices cannot be split over {nproc} processes")
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", total // nproc)
        size_cpu_pool(total // nproc)
        if dist is not None:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if dist is not None:
        limits = (
            {}
            if peer_timeout_s is None
            else dict.fromkeys(
                ("heartbeat_timeout_seconds", "shutdown_timeout_seconds"), library_timeout_s(peer_timeout_s)
            )
        )
        jax.distributed.initialize(**dist, **limits)


def make_mesh(sizes: dict[str, int], devices=None):
    """A Mesh over `devices` (default: all, across processes) with Auto axis types.

    With Auto axes GSPMD propagates shardings from the ones we pin.
    """
    import jax  # deferred: jax (~1 s): command lines import this before parsing
    from jax.sharding import AxisType  # deferred: jax (~1 s): command lines import this before parsing

    devices = jax.devices() if devices is None else list(devices)
    full = resolve_sizes(sizes, len(devices))
    return jax.make_mesh(tuple(full[a] for a in AXES), AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)


def device_memory(device) -> dict:
    """Memory in use on `device` now and at its peak (GiB), where the backend reports it (GPUs; not the CPU)."""
    stats = device.memory_stats() or {}
    gib = lambda key: stats[key] / 2**30 if key in stats else None
    return {"memory_in_use_gib": gib("bytes_in_use"), "memory_gib": gib("peak_bytes_in_use")}


def show_library_logs() -> None:
    """run.debug: jax's and orbax's (absl's) logs at INFO on stderr; otherwise warnings and up only."""
    import jax  # deferred: jax (~1 s): command lines import this before parsing

    jax.config.update("jax_logging_level", "INFO")
    absl_logging.set_verbosity(absl_logging.INFO)
