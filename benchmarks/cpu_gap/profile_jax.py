"""Per-HLO-op self times of one JAX train step on CPU (jaxpar's or minimal_step.py's), from a jax.profiler trace.

    XLA_FLAGS=--xla_cpu_enable_xprof_traceme=true python benchmarks/cpu_gap/profile_jax.py --impl jaxpar \
        [--d_model ... same flags as minimal_step.py] [--steps 10] [--dir /tmp/cpugap/trace] [--top 30] [--hlo FILE]

Traces `--steps` steps after the warmup, reads the .xplane.pb back with jax's ProfileData, and prints each XLA
op (thunk: fusion, dot, custom-call, while...) by total self time per step, grouped also by kind. `--hlo` writes
the optimized HLO text of the step, to map the op names back to what they compute.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("XLA_FLAGS", "")
if "xla_cpu_enable_xprof_traceme" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_cpu_enable_xprof_traceme=true"

import minimal_step as ms  # noqa: E402


def classify(hlo_text: str) -> dict[str, str]:
    """op name -> what it computes.

    Dot (XLA's own Eigen dot), ynn-dot / ynn-reduce (YNNPACK library fusions), onednn-dot, copy/transpose,
    dynamic-update-slice (scan stacking), broadcast, reduce / elementwise fusions.
    """
    import re

    comps, cur = {}, None
    for line in hlo_text.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m and not line.startswith(" "):
            cur = comps.setdefault(m.group(1), [])
        elif cur is not None:
            cur.append(line)
    out = {}
    for line in hlo_text.splitlines():
        m = re.match(r"^\s*(?:ROOT )?%([\w.\-]+) = \S+ (\w[\w\-]*)\(", line)
        if not m:
            continue
        name, op = m.groups()
        body = ""
        c = re.search(r"calls=%([\w.\-]+)", line)
        if c:
            body = "\n".join(comps.get(c.group(1), []))
        lib = "ynn-" if "__ynn_fusion" in line else "onednn-" if "onednn" in line else "xnn-" if "xnn" in line else ""
        if op == "dot" or " dot(" in body:
            out[name] = lib + "dot"
        elif op == "custom-call":
            out[name] = lib + "custom-call"
        elif " reduce(" in body or op == "reduce":
            out[name] = lib + "reduce"
        elif "dynamic-update-slice" in name:
            out[name] = "dynamic-update-slice"
        elif name.startswith("wrapped_broadcast") or op == "broadcast":
            out[name] = "broadcast (zero init)"
        elif name.startswith(("copy", "transpose")) or op in ("copy", "transpose"):
            out[name] = "copy/transpose"
        elif op == "scatter" or " scatter(" in body:
            out[name] = "scatter"
        elif op in ("while", "conditional", "call"):
            out[name] = "control"
        else:
            out[name] = lib + "elementwise"
    return out


def kind(name: str) -> str:
    n = name.split(".")[0].split("(")[0]
    for k in (
        "loop_",
        "input_",
        "wrapped_",
        "copy",
        "dot",
        "custom-call",
        "while",
        "fusion",
        "scatter",
        "gather",
        "reduce",
        "transpose",
        "convolution",
    ):
        if n.startswith(k) or k in n:
            return k.rstrip("_")
    return n


def main() -> int:
    ap = argparse.ArgumentParser()
    for name, default in (
        ("d_model", 128),
        ("n_layer", 4),
        ("n_head", 4),
        ("seq_len", 64),
        ("batch", 16),
        ("vocab", 256),
    ):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--impl", default="jaxpar")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dir", default="/tmp/cpugap/trace")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--hlo")
    ap.add_argument("--override", action="append", default=[])
    a = ap.parse_args()
    import jax
    from jax._src.lib import _profile_data

    if a.impl == "jaxpar":
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
        from jaxpar.mesh import setup_devices

        setup_devices({"dp": 1})
        run = ms.build_jaxpar(a)
    else:
        run = ms.build_min(a, set(a.impl.split(":")[1:]))
    if a.hlo:
        with open(a.hlo, "w") as f:
            f.write(run.compiled.as_text())
    for _ in range(3):
        run()
    out = os.path.join(a.dir, a.impl.replace(":", "_"))
    with jax.profiler.trace(out):
        for _ in range(a.steps):
            run()
    path = max(glob.glob(os.path.join(out, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    data = _profile_data.ProfileData.from_file(path)
    # every event on the CPU threads, with its nesting: self time = duration - children's durations
    ops = collections.Counter()
    counts = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            events = sorted(((e.start_ns, e.duration_ns, e.name) for e in line.events), key=lambda t: (t[0], -t[1]))
            stack = []  # [end, name, child_time]
            for start, dur, name in events:
                while stack and start >= stack[-1][0]:
                    end, n, child = stack.pop()
                    ops[n] -= child
                ops[name] += dur
                counts[name] += 1
                if stack:
                    stack[-1][2] += dur
                stack.append([start + dur, name, 0])
            while stack:
                end, n, child = stack.pop()
                ops[n] -= child
    # keep only XLA ops: names that look like HLO instruction names
    hlo = {
        n: t
        for n, t in ops.items()
        if any(
            n.split(".")[0].startswith(p)
            for p in (
                "loop_",
                "input_",
                "wrapped_",
                "copy",
                "dot",
                "custom-call",
                "while",
                "fusion",
                "scatter",
                "gather",
                "reduce",
                "transpose",
                "convolution",
                "bitcast",
                "broadcast",
                "add",
                "multiply",
                "select",
                "concatenate",
                "slice",
                "dynamic",
                "xnn",
                "onednn",
                "ynn",
                "call",
                "conditional",
                "sort",
                "iota",
                "exp",
                "tanh",
                "convert",
                "compare",
                "rng",
                "pad",
                "reverse",
                "subtract",
                "divide",
                "negate",
                "maximum",
                "tuple",
                "constant",
            )
        )
    }
    total = sum(hlo.values())
    print(f"# {a.impl}: {len(hlo)} XLA ops, {total / a.steps / 1e6:.2f} ms/step of op self time over {a.steps} steps")
    print(
        "# other events (top): "
        + ", ".join(f"{n[:40]}={t / a.steps / 1e6:.2f}ms" for n, t in ops.most_common(8) if n not in hlo)
    )
    classes = classify(run.compiled.as_text())
    by_kind = collections.Counter()
    for n, t in hlo.items():
        by_kind[classes.get(n, kind(n))] += t
    print(f"{'kind':<20} {'ms/step':>8} {'share':>6}")
    for k, t in by_kind.most_common():
        print(f"{k:<20} {t / a.steps / 1e6:>8.3f} {t / total:>6.1%}")
    print(f"{'op':<36} {'class':<22} {'ms/step':>8} {'share':>6} {'calls/step':>10}")
    for n, t in sorted(hlo.items(), key=lambda kv: -kv[1])[: a.top]:
        print(
            f"{n[:36]:<36} {classes.get(n, '?'):<22} {t / a.steps / 1e6:>8.3f} {t / total:>6.1%} "
            f"{counts[n] / a.steps:>10.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
