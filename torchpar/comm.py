"""One sampled train step's time in collectives per mesh axis, from a torch.profiler trace.

jaxpar/core/run/stragglers.py's CommShare asks for it once per run start; jaxpar/comm.py is jax's counterpart, the
same names and meaning.

A collective is gloo's own span (`gloo:all_reduce`, enqueued to completed) on the CPU, an NCCL kernel on a GPU. Neither
names its process group, so each kind is counted under the axis the backend runs that kind on: all-gather and
reduce-scatter on fsdp (FSDP2's shards), send and receive on pp, all-to-all on ep, the rest (all-reduce, broadcast)
on dp -- the first of these with more than one rank, else the backend's one axis of more than one rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile

import torch

from jaxpar.core.config.mesh_spec import parse_mesh, resolve_sizes
from jaxpar.core.run.stragglers import in_flight_s

KINDS = (
    ("reducescatter", ("fsdp", "dp")),
    ("allgather", ("fsdp", "dp")),
    ("alltoall", ("ep", "dp")),
    ("send", ("pp",)),
    ("recv", ("pp",)),
    ("", ("dp", "fsdp")),
)  # "": any other collective


def axis_sizes(cfg, backend: str, world: int) -> dict[str, int]:
    """The axes of more than one rank that `backend` runs (jaxpar/core/config/mesh_spec.py's TORCH_MESH_AXES)."""
    if world == 1 or backend == "none":
        return {}
    if cfg.parallel.mesh:
        sizes = resolve_sizes(parse_mesh(cfg.parallel.mesh), world)
    else:  # every rank on the backend's one axis (torchpar/backends/fsdp.py, pipeline.py)
        sizes = {{"fsdp": "fsdp", "pipeline": "pp"}.get(backend, "dp"): world}
    return {a: n for a, n in sizes.items() if n > 1}


def kind_axis(name: str, sizes: dict[str, int]) -> str | None:
    """The axis a collective's event (its name) is counted under; None for an event that is no collective."""
    flat = name.lower().replace("_", "")
    if not (flat.startswith("gloo:") or "nccl" in flat) or not sizes:
        return None
    for kind, axes in KINDS:
        if kind in flat:
            return next((a for a in axes if a in sizes), next(iter(sizes)))
    return None


@contextlib.contextmanager
def kineto_quiet():
    """Kineto writes a line to fd 2 at every profiler start and stop ('USDT: ...

    profiler_start') whatever its log level: not for the console. Python's own stderr is flushed first and restored
    after.
    """
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


class CommTrace:
    """torch.profiler around one step; its chrome trace read back."""

    def __init__(self, device: torch.device):
        activities = [torch.profiler.ProfilerActivity.CPU]
        self.cuda = device.type == "cuda"
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities)
        with kineto_quiet():
            self.profiler.start()

    def stop(self, sizes: dict[str, int] | None) -> dict[str, float]:
        """Seconds the step's collectives were in flight per axis (`sizes` None: stop and discard)."""
        if self.cuda:
            torch.cuda.synchronize()
        with kineto_quiet():
            self.profiler.stop()
        if sizes is None:
            return {}
        fd, path = tempfile.mkstemp(prefix="torchpar-comm-", suffix=".json")
        os.close(fd)
        try:
            self.profiler.export_chrome_trace(path)
            with open(path) as f:
                events = json.load(f).get("traceEvents", [])
        finally:
            os.remove(path)
        wanted = "kernel" if self.cuda else "user_annotation"  # a GPU's kernels; gloo's spans on the CPU
        spans = (
            (e.get("cat"), axis, e["ts"] * 1e-6, (e["ts"] + e.get("dur", 0)) * 1e-6)
            for e in events
            if e.get("ph") == "X" and e.get("cat") == wanted and (axis := kind_axis(e["name"], sizes))
        )
        return in_flight_s(spans)
