"""Where a training step's device time goes: kernel times summed by name and by kind, both frameworks' profiles.

jaxpar's (jax.profiler's trace, jaxpar/tools/gpu_profile.py) and torchpar's (torch.profiler's, torchpar/tools/
gpu_profile.py) are read into (kernel name, microseconds) pairs and summarized here the same way, so that the two
steps' profiles stand side by side in gpu_check's report.
"""

from __future__ import annotations

import collections
import re

from jaxpar.core.bench_records import write_json

# kinds by kernel name, first match wins: cuBLAS/cuDNN/Triton names on a GPU, XLA's fusion names and torch's
# operators anywhere. Inductor's Triton kernels by their prefix first: triton_red_/triton_per_ reduce, triton_poi_ is
# pointwise (its name lists the ops fused, a cast among them often); torch's eager casts are *_copy_kernel_cuda's.
KINDS = (
    ("attention", r"fmha|flash|cudnn|attention|sdpa"),
    ("matmul", r"gemm|nvjet|cublas|cutlass|xmma|sm90|dot|ynn_fusion|matmul|::mm$|::addmm|::bmm|::linear"),
    ("optimizer", r"multi_tensor_apply|adam"),
    ("reduce", r"^triton_red_|^triton_per_"),
    ("elementwise/other", r"^triton_poi_"),
    ("convert", r"convert|_to_copy|(bfloat16|half|float)_copy_kernel"),
    ("reduce", r"reduce|::sum$"),
    ("copy/transpose", r"copy|transpose|slice|concatenate|memcpy|memset"),
)


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, pattern in KINDS if re.search(pattern, low)), "elementwise/other")


def summarize(kernels: list[tuple[str, float]], steps: int, step_s: float, top: int = 15) -> dict:
    """Per-step kernel milliseconds by kind and for the `top` kernels, and the busy share of the step.

    `kernels`: (name, microseconds) of every kernel the `steps` traced steps ran, or (name, microseconds, launches)
    for a name's launches summed. The top kernels come with their launches per step: one name can be one kernel per
    layer.
    """
    by_name, launches = collections.Counter(), collections.Counter()
    for name, us, *count in kernels:
        by_name[name] += us / 1e3 / steps  # microseconds -> ms per step
        launches[name] += (count[0] if count else 1) / steps
    by_kind = collections.Counter()
    for name, ms in by_name.items():
        by_kind[kind_of(name)] += ms
    total = sum(by_name.values())
    share = lambda ms: ms / total if total else 0.0
    return {
        "step_ms": step_s * 1e3,
        "kernel_ms": total,
        "busy": total / (step_s * 1e3) if step_s else None,
        "kinds": {k: {"ms": ms, "share": share(ms)} for k, ms in by_kind.most_common()},
        "top": [
            {"name": n[:120], "kind": kind_of(n), "ms": ms, "share": share(ms), "launches": launches[n]}
            for n, ms in by_name.most_common(top)
        ],
    }


def publish(p: dict, json_path: str | None) -> None:
    """A profile tool's output: the summary's lines printed, and written as JSON where --json asks."""
    print("\n".join(markdown(p)))
    if json_path:
        write_json(json_path, p)


def markdown(p: dict) -> list[str]:
    """A summary's lines: the step and busy share, the kinds' table and the top kernels' table."""
    lines = [
        f"Step {p['step_ms']:.2f} ms under the profiler; kernels {p['kernel_ms']:.2f} ms per step "
        f"(busy {p['busy'] or 0:.0%}).",
        "",
        "| kind | ms per step | share of kernel time |",
        "|---|---|---|",
    ]
    lines += [f"| {k} | {v['ms']:.3f} | {v['share']:.1%} |" for k, v in p["kinds"].items()]
    lines += ["", "| kernel | kind | launches per step | ms per step | share |", "|---|---|---|---|---|"]
    count = lambda t: f"{t['launches']:g}" if "launches" in t else "-"  # (earlier reports have no count)
    lines += [f"| `{t['name']}` | {t['kind']} | {count(t)} | {t['ms']:.3f} | {t['share']:.1%} |" for t in p["top"]]
    return lines
