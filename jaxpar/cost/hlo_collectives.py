"""Every collective in a compiled XLA program, with its bytes and how often it runs per step.

Reads the optimized HLO text: a collective inside a `while` body (the layer scan, the microbatch
scan) runs trip-count times, so each computation gets a multiplier from the call graph.
Traffic per device uses the bandwidth-optimal (ring) cost of each collective over its group. Each collective
also carries the source files on the stack of the jax operation it was made for (the HLO's stack frames), so a
caller can tell whose it is (the planner: the optimizer's, jaxpar/optim.py).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
}
OPS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(.*?)\s+(" + "|".join(OPS) + r")(-start)?\(")
_ARRAY = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([\d,]*)\]")
_CALLEE = re.compile(r"(body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_FRAME = re.compile(r"stack_frame_id=(\d+)")
_TABLE_ROW = re.compile(r"^(\d+) (.*)$")


@dataclasses.dataclass
class Collective:
    op: str
    result_bytes: int  # bytes of the result per device (all tuple elements)
    group_size: int
    groups: list[list[int]]
    count: int  # executions per step
    name: str = ""  # the instruction's name: a profiler trace's hlo_op (jaxpar/comm.py)
    files: frozenset = frozenset()  # source files on the stack of the jax operation it was made for

    @property
    def traffic_bytes(self) -> float:
        """Bytes each device sends per execution, ring algorithm (a lower bound for that op)."""
        n, s = self.group_size, self.result_bytes
        if n <= 1:
            return 0.0
        return {
            "all-reduce": 2 * s * (n - 1) / n,
            "all-gather": s * (n - 1) / n,
            "reduce-scatter": s * (n - 1),
            "all-to-all": s * (n - 1) / n,
            "collective-permute": s,
        }[self.op]


def shape_bytes(shape_text: str) -> int:
    """Bytes of an HLO shape's arrays, a tuple's summed: `bf16[16,1024]` or `(bf16[4], f32[2,2])`."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape_text):
        total += DTYPE_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return total


def _top_level(shape_text: str) -> list[str]:
    """The elements of a tuple shape `(a, (b, c), d)`, or [shape] for an array."""
    text = shape_text.strip()
    if not text.startswith("("):
        return [text]
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(text):
        depth += ch in "({["
        depth -= ch in ")}]"
        if (ch == "," and depth == 1) or (ch == ")" and depth == 0):
            parts.append(text[start:i])
            start = i + 1
    return parts


def _result_bytes(shape_text: str, op: str, is_start: bool) -> int:
    """Bytes of the result.

    An asynchronous `-start` (XLA:GPU) of all but all-reduce returns (operands, results[, context]): only the second
    element is the result.
    """
    if is_start and op != "all-reduce" and shape_text.strip().startswith("("):
        return shape_bytes(_top_level(shape_text)[1])
    return shape_bytes(shape_text)


def _groups(line: str, n_devices: int) -> list[list[int]]:
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](T\(([\d,]+)\))?", line)
    if m:  # iota form: reshape(iota(dims)).transpose(perm) into [n_groups, group_size]
        n_groups, size = int(m[1]), int(m[2])
        ids = np.arange(int(np.prod([int(d) for d in m[3].split(",")]))).reshape([int(d) for d in m[3].split(",")])
        if m[5]:
            ids = ids.transpose([int(p) for p in m[5].split(",")])
        return ids.reshape(n_groups, size).tolist()
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m:  # mesh form: mesh['axis_0'=2,'axis_1'=4] {'axis_1'}: groups vary the listed axes
        names = re.findall(r"'(\w+)'=(\d+)", m[1])
        sizes = [int(s) for _, s in names]
        chosen = [i for i, (n, _) in enumerate(names) if f"'{n}'" in m[2]]
        ids = np.arange(int(np.prod(sizes))).reshape(sizes)
        ids = ids.transpose([i for i in range(len(sizes)) if i not in chosen] + chosen)
        return ids.reshape(-1, int(np.prod([sizes[i] for i in chosen]))).tolist()
    m = re.search(r"replica_groups=\{(\{[\d,{} ]*\})\}", line)
    if m:
        return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d, ]*)\}", m[1])]
    m = re.search(r"source_target_pairs=\{([^}]*(?:\}[^}]*)*)\}", line)
    if m:  # collective-permute: one "group" per pair
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", line)]
    return [list(range(n_devices))]  # empty replica_groups: everyone


def stack_files(hlo_text: str) -> dict[int, frozenset]:
    """Stack frame id -> the source files on that stack, from the HLO's tables.

    Read from the HLO's FileNames, FileLocations and StackFrames tables (ids from 1; a frame's parent_frame_id is its
    parent's id + 1, 1 for none).
    """
    tables, rows = {}, None
    for line in hlo_text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            rows = tables[line] = {}
        elif rows is not None and (m := _TABLE_ROW.match(line)):
            rows[int(m[1])] = m[2]
        else:
            rows = None
    names = {i: v.strip('"') for i, v in tables.get("FileNames", {}).items()}
    file_of = {
        i: names.get(int(re.search(r"file_name_id=(\d+)", v)[1])) for i, v in tables.get("FileLocations", {}).items()
    }
    frames = {
        i: (int(re.search(r"file_location_id=(\d+)", v)[1]), int(re.search(r"parent_frame_id=(\d+)", v)[1]) - 1)
        for i, v in tables.get("StackFrames", {}).items()
    }
    stacks: dict[int, frozenset] = {}
    for frame in sorted(frames):  # a parent's id is below its child's
        location, parent = frames[frame]
        stacks[frame] = stacks.get(parent, frozenset()) | {file_of.get(location)}
    return stacks


def parse(hlo_text: str, n_devices: int) -> list[Collective]:
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        header = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if header and not line.startswith(" "):
            current = header[2]
            comps[current] = []
            if header[1]:
                entry = current
        elif line.startswith("}"):
            current = None
        elif current:
            comps[current].append(line)
    multiplier: dict[str, int] = {}

    def visit(name: str, mult: int) -> None:
        multiplier[name] = multiplier.get(name, 0) + mult
        for line in comps.get(name, ()):
            trip = _TRIP.search(line)
            callees = [(kind, callee) for kind, callee in _CALLEE.findall(line)]
            for b in _BRANCHES.findall(line):
                callees += [("branch", c.strip().lstrip("%")) for c in b.split(",")]
            for kind, callee in callees:
                if kind == "to_apply" and _INSTR.match(line):
                    continue  # a collective's reduction function, not a call
                visit(callee, mult * (int(trip[1]) if kind == "body" and trip else 1))

    visit(entry, 1)
    stacks, out = stack_files(hlo_text), []
    for name, lines in comps.items():
        for line in lines:
            m = _INSTR.match(line)
            if m and multiplier.get(name):
                groups = _groups(line, n_devices)
                frame = _FRAME.search(line)
                out.append(
                    Collective(
                        m[3],
                        _result_bytes(m[2], m[3], bool(m[4])),
                        len(groups[0]),
                        groups,
                        multiplier[name],
                        m["name"],
                        stacks.get(int(frame[1]) if frame else 0, frozenset()),
                    )
                )
    return out


def group_axes(groups: list[list[int]], mesh) -> tuple[str, ...]:
    """The mesh axes along which a collective's groups (or a permute's source-target pairs) differ.

    The ids are positions in the program's device assignment -- the mesh's devices in order -- not device ids (which
    differ from positions across processes, and need not be in order on one).
    """
    shape, varies = mesh.devices.shape, set()
    for group in groups:
        coords = [np.unravel_index(i, shape) for i in group if i < mesh.devices.size]
        varies |= {k for k in range(len(shape)) if len({c[k] for c in coords}) > 1}
    return tuple(a for k, a in enumerate(mesh.axis_names) if k in varies)
