"""Mesh specs as users write them (`dp=2,tp=4`): parsing, filling the -1 axis, the product check.

No jax: torchpar checks its `parallel.mesh` with the same rules, and which axes each of its backends runs.
"""

from __future__ import annotations

import math
import os

from jaxpar.core.errors import UserError

# mesh order: tp innermost (fastest links), diloco outermost (DiLoCo's groups: the slowest links, used every H steps)
AXES = ("diloco", "dp", "fsdp", "pp", "ep", "sp", "tp")


def parse_mesh(spec: str) -> dict[str, int]:
    """'dp=2,tp=4' -> {'dp': 2, 'tp': 4}; at most one size may be -1 (fill)."""
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in (spec or "").split(","))):
        name, eq, value = part.partition("=")
        name = name.strip()
        if not eq or name not in AXES:
            raise UserError(f"mesh entry {part!r}: expected AXIS=SIZE with AXIS one of {', '.join(AXES)}")
        if name in sizes:
            raise UserError(f"mesh axis {name!r} given twice in {spec!r}")
        try:
            size = int(value)
        except ValueError:
            raise UserError(f"mesh entry {part!r}: size must be an integer") from None
        if size == 0 or size < -1:
            raise UserError(f"mesh entry {part!r}: size must be positive or -1")
        sizes[name] = size
    if sum(v == -1 for v in sizes.values()) > 1:
        raise UserError(f"mesh {spec!r}: at most one axis may be -1")
    return sizes or {"dp": -1}


def resolve_sizes(sizes: dict[str, int], n_devices: int) -> dict[str, int]:
    """Fill the -1 axis and check the product against the device count; every axis present."""
    known = math.prod(v for v in sizes.values() if v != -1)
    out = {a: sizes.get(a, 1) for a in AXES}
    fill = [a for a, v in sizes.items() if v == -1]
    if fill:
        if n_devices % known:
            raise UserError(f"mesh {format_mesh(sizes)}: {n_devices} devices are not divisible by {known}")
        out[fill[0]] = n_devices // known
    product = math.prod(out.values())
    if product != n_devices:
        raise UserError(f"mesh {format_mesh(sizes)} has {product} devices but {n_devices} are available")
    return out


def format_mesh(sizes: dict[str, int]) -> str:
    return ",".join(f"{a}={v}" for a, v in sizes.items() if v != 1 or len(sizes) == 1) or "dp=1"


TORCH_BACKENDS = ("none", "ddp", "fsdp", "deepspeed", "pipeline")  # torchpar/backends/
# the parallel.mesh axes each torchpar backend implements (tp and sp are jaxpar's alone)
TORCH_MESH_AXES = {
    "none": (),
    "ddp": ("diloco", "dp", "ep"),
    "fsdp": ("diloco", "dp", "fsdp"),
    "deepspeed": ("dp",),
    "pipeline": ("pp", "dp", "fsdp"),
}


def _elastic_hint(sizes: dict[str, int]) -> str:
    """The mesh with its first data axis as the one that follows the group."""
    first = next((a for a in ("dp", "fsdp") if a in sizes), next(iter(sizes)))
    return format_mesh({**sizes, first: -1})


def check_torch_mesh(mesh: str, backend: str, world: int) -> None:
    """torchpar's parallel.mesh is honoured, not ignored: a known backend, axes it runs, over all `world` ranks."""
    if backend not in TORCH_BACKENDS:
        raise UserError(f"unknown backend {backend!r}; choose one of {', '.join(TORCH_BACKENDS)}")
    if not mesh:
        return
    sizes = parse_mesh(mesh)
    unsupported = [a for a, n in sizes.items() if n != 1 and a not in TORCH_MESH_AXES[backend]]
    if unsupported:
        runs = "/".join(TORCH_MESH_AXES[backend]) or "nothing but one process"
        raise UserError(
            f"parallel.mesh={mesh}: --backend {backend} does not implement {', '.join(unsupported)} "
            f"(it runs {runs}; jaxpar.train runs every axis)"
        )
    product = math.prod(n for n in sizes.values() if n != -1)
    if -1 not in sizes.values() and product != world:  # torchpar's devices are its processes: say how to start them
        runs = "runs" if world == 1 else "run"
        how = (
            f"an elastic run's group changes size: make one axis -1, e.g. {_elastic_hint(sizes)}"
            if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
            else f"start {product} (torchrun --nproc_per_node={product} on one host; across hosts, nnodes x "
            "nproc_per_node or srun's tasks)"
        )
        raise UserError(f"parallel.mesh={mesh} needs {product} processes and {world} {runs}: {how}")
    resolve_sizes(sizes, world)  # an axis of -1 takes the rest; the world must divide by the others
