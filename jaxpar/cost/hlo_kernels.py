"""What a compiled XLA program's kernels are: its convert fusions and how its matmuls run, from the optimized HLO.

gpu_check's part (c) reads them off the compiled train step (docs/gpu.md): the casts a profile's convert kernels are,
by tensor, and whether model.float8's matmuls became float8 GEMMs.
"""

from __future__ import annotations

import re

from jaxpar.cost.hlo_collectives import shape_bytes

# a fusion (one kernel) whose name says it converts: its name and its result, one array or a tuple of them
_CONVERT = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.-]*convert[\w.-]*) = (\(.*?\)|\w+\[[\d,]*\])\S* fusion\(", re.M)
_ARRAY = re.compile(r"\w+\[[\d,]*\]")


def converts_of(hlo: str, top: int = 6) -> list[dict]:
    """The largest convert fusions (kernels, not the ops inside one): name, result type(s), MiB written."""
    rows = [
        {"name": name, "shape": ", ".join(_ARRAY.findall(result)), "mib": shape_bytes(result) / 2**20}
        for name, result in _CONVERT.findall(hlo)
    ]
    return sorted(rows, key=lambda r: -r["mib"])[:top]


def matmuls_of(hlo: str) -> dict:
    """How the matmuls run: how many there are, how many are cuBLAS float8 GEMMs, how many dots take float8 operands."""
    lines = [line for line in hlo.splitlines() if " dot(" in line or 'custom_call_target="__cublas' in line]
    f8_cublas = sum("__cublas$lt$matmul$f8" in line for line in lines)
    f8_dots = sum(" dot(" in line and "f8e" in line.split(" dot(", 1)[1] for line in lines)
    return {"matmuls": len(lines), "float8_cublas": f8_cublas, "float8_dots": f8_dots}
