"""One sampled train step's time in collectives per mesh axis, from a jax profiler trace.

jaxpar/core/run/stragglers.py's CommShare asks for it once per run start.

The compiled step's optimized HLO names each collective instruction and its replica groups
(parsed by jaxpar/cost/hlo_collectives.py), which give the mesh axes it spans; the profiler's trace events carry the
instruction (`hlo_op`) and program (`hlo_module`) they ran, per device. A collective over several axes is counted
under their names joined by "_" (e.g. dp_fsdp).
"""

from __future__ import annotations

import glob
import gzip
import json
import re
import shutil
import tempfile

import jax

from jaxpar.core.run.stragglers import in_flight_s
from jaxpar.cost.hlo_collectives import group_axes, parse


def collective_axes(hlo_text: str, mesh) -> dict[str, str]:
    """{instruction name: axis name} for every collective of a compiled program over more than one device."""
    out = {}
    for c in parse(hlo_text, mesh.devices.size):
        axes = group_axes(c.groups, mesh)
        if axes:
            out[c.name] = "_".join(axes)
    return out


class CommTrace:
    """jax.profiler around one step, written to a scratch directory and read back."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="jaxpar-comm-")
        jax.profiler.start_trace(self.dir)

    def stop(self, compiled, mesh) -> dict[str, float]:
        """Seconds the step's collectives were in flight per axis (`compiled` None: stop and discard)."""
        try:
            jax.profiler.stop_trace()
            if compiled is None:
                return {}
            text = compiled.as_text()
            module = re.match(r"HloModule\s+([\w.\-]+)", text)
            return in_flight_s(spans(self.dir, module[1] if module else None, collective_axes(text, mesh)))
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


def spans(trace_dir: str, module: str | None, axes: dict[str, str]):
    """(device, axis, start, end) in seconds for each traced run of one of `axes`' instructions in `module`.

    On a device's own timeline (GPU), or on the host's threads that run each CPU device (`device_ordinal`).
    """
    for path in glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True):
        with gzip.open(path) as f:
            events = json.load(f).get("traceEvents", [])
        devices = {
            e["pid"]
            for e in events
            if e.get("ph") == "M"
            and e.get("name") == "process_name"
            and str((e.get("args") or {}).get("name", "")).startswith("/device:")
        }
        for e in events:
            args = e.get("args") or {}
            op = args.get("hlo_op")
            if e.get("ph") != "X" or op not in axes or (module and args.get("hlo_module") not in (None, module)):
                continue
            if e.get("pid") not in devices and "device_ordinal" not in args:  # a GPU host's launch, not the run
                continue
            start = float(e["ts"]) * 1e-6
            yield (e["pid"], args.get("device_ordinal")), axes[op], start, start + float(e.get("dur", 0)) * 1e-6
