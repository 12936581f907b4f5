"""Validation and measurement on a GPU in one command, written up as a markdown report.

python -m jaxpar.tools.gpu_check [--tiny] [--out REPORT.md] [--skip parity,...] [--profile-also ROW,...] [--budget S]

One command that validates and measures on a GPU (a device session runs it in one call; docs/gpu.md):
  (a) the parity suite on the device (jaxpar vs torchpar, float32 highest precision, bf16 in its band),
  (b) GPT-2 124M, sequence 1024, bf16 on one device: tokens/s, MFU (6N + 12·L·T·d FLOPs per token, see
      jaxpar/core/model/flops.py), peak memory, for jaxpar and torchpar (torch.compile) in the same run,
  (b2) where (b)'s jaxpar step spends its device time: kernel milliseconds by kind and the top kernels
      (jaxpar/tools/gpu_profile.py), the profile the cast/reduction work is guided by,
  (b3) the same for (b)'s torchpar step under torch.compile (torchpar/tools/gpu_profile.py),
  (c) what the compiled jaxpar step calls: its attention (cuDNN fused attention or XLA's), its largest convert
      fusions by tensor, and with model.float8 whether its matmuls became float8 GEMMs,
  (d) the measured bf16 matmul ceiling,
  (e) (b)'s jaxpar step with model.remat=offload (activations in host memory): tokens/s and peak memory,
  (f) models and changes on one device (MODELS, most wanted first, each change beside its baseline row): torchpar's
      GPT-2 with its loss's chunk eager, configs/moe-1b.yaml padded and with model.moe_ragged, a Llama-3 3B in bf16
      and with model.float8 in both frameworks: tokens/s, MFU, peak memory.
It prints and writes a dated markdown report with device, versions and every command, rewritten after each
part, so that a device call cut off at its time limit still brings back the parts that ran. Each part has its own
share of the call (PART_S, parity first) and `--budget` (570 s by default) bounds the whole: every subprocess's
timeout is cut to the time its part and the call have left, and a part or an (f) row that would start with less than
MIN_PART_S left is reported as not run, so the report always comes back within the device call. `--tiny`
runs the same path on the CPU with the tiny config and a few parity steps, so that CI keeps it working. A part that
cannot run (e.g. DeepSpeed or grain missing from the image) is reported with its reason, not hidden.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gzip
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time

from jaxpar.core.config.schema import load_config
from jaxpar.core.errors import UserError, cli
from jaxpar.tools.bench import matmul_ceiling
from jaxpar.core.kernel_profile import markdown as profile_lines
from jaxpar.cost.hlo_kernels import converts_of, matmuls_of

PARTS = ("parity", "throughput", "profile", "torch_profile", "attention", "ceiling", "offload", "models")
MIN_PART_S = 30  # a part or an (f) row with less time left than this is not started (--budget, PART_S)
# each part's own share of the call, in seconds (its subprocesses' timeouts are cut to it), parity first; the models
# take what the others leave of --budget (570 s by default: 225 s after all but the activation offload, which a device
# session skips unless it changed)
PART_S = {
    "parity": 150,
    "throughput": 70,
    "profile": 35,
    "torch_profile": 35,
    "attention": 45,
    "ceiling": 10,
    "offload": 30,
    "models": float("inf"),
}
PARITY_PROCESSES = 3  # the parity cases split over this many pytest processes on the one GPU
GPT2_124M = [
    "--config",
    "configs/gpt2-124m.yaml",
    "model.compute_dtype=bfloat16",
    "data.seq_len=1024",
    "train.global_batch_size=16",
]
TINY = ["--config", "configs/gpt2-tiny.yaml", "train.global_batch_size=8"]
ONE_DEVICE = ["train.global_batch_size=8", "train.microbatches=1"]  # the 1B/3B rows: sequence 2048, 8 rows at once
# the 3B rows: jaxpar's layers scanned (train.scan_layers=on) so that its float8 step compiles in the budget (unrolled,
# 2 minutes on an H200, 2026-11-30); bf16 beside it scanned too. torchpar's blocks share one compiled graph anyway.
LLAMA_3B = ["--config", "configs/llama-3b.yaml", *ONE_DEVICE]
# (f)'s rows, most wanted first (a row with under MIN_PART_S of the budget left is not started): each change beside
# the row it is measured against (BASELINES; a torchpar GPT-2 row's is (b)'s torchpar). A "torchpar ..." row runs
# torchpar.tools.bench with torch.compile. Measured on an H200 (docs/benchmarks/gpu-check-2026-11-30.md) and so no
# longer rows: model.float32_logits (0.976x, not kept), torchpar's foreach AdamW (fused 1.29x, the default since).
MODELS = {
    "torchpar gpt2-124m eager loss": [*GPT2_124M, "--eager-loss"],  # the loss's chunk not compiled: the old path
    "moe-1b bf16": ["--config", "configs/moe-1b.yaml", *ONE_DEVICE],
    "llama-3b bf16": [*LLAMA_3B, "train.scan_layers=on"],
    "llama-3b float8": [*LLAMA_3B, "train.scan_layers=on", "model.float8=true"],
    "torchpar llama-3b bf16": LLAMA_3B,
    "torchpar llama-3b float8": [*LLAMA_3B, "model.float8=true"],
    "moe-1b bf16 ragged": ["--config", "configs/moe-1b.yaml", *ONE_DEVICE, "model.moe_ragged=true"],  # 0.55x so far
}
TINY_MODELS = {
    "torchpar gpt2-tiny eager loss": [*TINY, "--eager-loss"],
    "moe-tiny": ["--config", "configs/moe-tiny.yaml"],
    "llama-tiny": ["--config", "configs/llama-tiny.yaml", "train.scan_layers=on"],
    "llama-tiny float8": ["--config", "configs/llama-tiny.yaml", "train.scan_layers=on", "model.float8=true"],
    "torchpar llama-tiny": ["--config", "configs/llama-tiny.yaml"],
    "torchpar llama-tiny float8": ["--config", "configs/llama-tiny.yaml", "model.float8=true"],
    "moe-tiny ragged": ["--config", "configs/moe-tiny.yaml", "model.moe_ragged=true"],
}
# a changed row -> the row it is measured against (its tokens/s over that row's in the report)
BASELINES = {
    "moe-1b bf16 ragged": "moe-1b bf16",
    "llama-3b float8": "llama-3b bf16",
    "torchpar llama-3b float8": "torchpar llama-3b bf16",
    "moe-tiny ragged": "moe-tiny",
    "llama-tiny float8": "llama-tiny",
    "torchpar llama-tiny float8": "torchpar llama-tiny",
}
# the 3B rows hold 75-85 GiB at their peak on an H200 (2026-11-30): room beside jax's default 75% preallocation
BIG_ROW_ENV = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.92"}


# time.perf_counter() by which the call's budget (--budget) is spent, and the part's own (PART_S)
_DEADLINE, _PART_END = [float("inf")], [float("inf")]


def _left() -> float:
    return min(_DEADLINE[0], _PART_END[0]) - time.perf_counter()


def _run(cmd: list[str], timeout: int, env: dict | None = None) -> dict:
    t0, timeout = time.perf_counter(), max(1, min(timeout, int(_left())))
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = (
            "timeout",
            ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else str(e.stdout)),
        )
    return {"command": shlex.join(cmd), "rc": rc, "seconds": time.perf_counter() - t0, "tail": out[-4000:]}


def parity(device: str, tiny: bool) -> dict:
    """(a): the parity suite, every tier's cases, split over PARITY_PROCESSES pytest processes on the one device.

    Each process's jax allocates as it goes (no 75% preallocation each).
    """
    base = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-W", "ignore", "-m", "", f"--device={device}"]
    base += ["--parity-steps", "20" if tiny else "50"]
    if tiny:  # one case, jaxpar vs torchpar
        groups = [["parity_tests", "-k", "float32 and none and not bfloat16"]]
    else:
        listing = [*base, "parity_tests", "--collect-only", "-q", "-o", "addopts="]  # one id a line
        try:
            listed = subprocess.run(listing, capture_output=True, text=True, timeout=max(1, min(60, _left())))
            ids = [line for line in listed.stdout.splitlines() if line.startswith("parity_tests/") and "::" in line]
            rc, tail = listed.returncode, listed.stdout[-2000:] + listed.stderr[-2000:]
        except subprocess.TimeoutExpired:
            ids, rc, tail = [], "timeout", ""
        if rc != 0 or not ids:  # the collection's own failure: not a run of the whole unit suite without ids
            failure = {"command": shlex.join(listing), "rc": rc, "seconds": 0.0, "tail": tail}
            return {**failure, "counts": {}, "failed": [], "ok": False}
        groups = split_cases(ids, PARITY_PROCESSES)
    t0, env = time.perf_counter(), {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    procs = [
        subprocess.Popen([*base, *g], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for g in groups
    ]
    tails, timed_out = [], False
    for p in procs:
        try:
            out = p.communicate(timeout=max(1, _left()))[0]
        except subprocess.TimeoutExpired:
            p.kill()
            out, timed_out = p.communicate()[0], True
        tails.append(out)
    counts = collections.Counter()
    for tail in tails:
        for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", tail[-500:]):
            counts[k] += int(n)
    failed = [f for tail in tails for f in re.findall(r"^FAILED (\S+)", tail, re.M)]
    rc = "timeout" if timed_out else max(p.returncode for p in procs)
    command = (
        shlex.join([*base, *groups[0]])
        if tiny
        else f"{shlex.join([*base, 'parity_tests'])} (in {len(procs)} processes)"
    )
    return {
        "command": command,
        "rc": rc,
        "seconds": time.perf_counter() - t0,
        "tail": "\n".join(t[-1500:] for t in tails),
        "counts": dict(counts),
        "failed": failed,
        "ok": rc == 0,
    }


def split_cases(ids: list[str], n: int) -> list[list[str]]:
    """The parity test ids in at most n groups, the cases of one config together (they share its reference runs).

    A case's config is its id's parameter up to the first "-" (`test_parity[float32-torch:ddp]`: float32); the largest
    configs are placed first, each on the group with the fewest cases so far.
    """
    by_config: dict[str, list[str]] = {}
    for i in ids:
        m = re.search(r"\[([^\]-]+)", i)
        by_config.setdefault(m.group(1) if m else i, []).append(i)
    groups: list[list[str]] = [[] for _ in range(min(n, len(by_config)))]
    for cases in sorted(by_config.values(), key=len, reverse=True):
        min(groups, key=len).extend(cases)
    return groups


def _run_json(cmd: list[str], timeout: int, env: dict | None = None) -> tuple[dict, dict | None]:
    """_run of a tool that writes its result to the file after `--json` (appended here).

    Returns (the run, that result or None if it wrote none).
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        r = _run([*cmd, "--json", out], timeout, env)
        if not os.path.exists(out):
            return r, None
        with open(out) as f:
            return r, json.load(f)


def throughput(tiny: bool) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "jaxpar.tools.bench",
        "--mesh",
        "dp=1",
        "--steps",
        "3" if tiny else "20",
        "--warmup",
        "1" if tiny else "5",
        "--compare",
        *(TINY if tiny else GPT2_124M),
    ]
    # tiny: torch.compile is a no-op (TORCH_COMPILE_DISABLE), the same code path without minutes of compiling
    r, jax_row = _run_json(cmd, 300 if tiny else 480, {"TORCH_COMPILE_DISABLE": "1"} if tiny else None)
    m = re.search(r"vs torchpar \(compiled\) ([\d,]+) tok/s: ratio ([\d.]+)", r["tail"])
    return {
        **r,
        "jaxpar": jax_row,
        "torchpar_tokens_per_sec": float(m.group(1).replace(",", "")) if m else None,
        "ratio": float(m.group(2)) if m else None,
        "ok": r["rc"] == 0 and jax_row is not None,
    }


def profile_step(tiny: bool, module: str = "jaxpar.tools.gpu_profile", flags: tuple = (), args=None) -> dict:
    """(b2): (b)'s jaxpar step profiled, in a process of its own (the trace's memory and XLA flags stay there).

    (b3) runs torchpar's twin (`module`) with `flags` the same way; `args`: another config than (b)'s.
    """
    cmd = [sys.executable, "-m", module, *flags, "--steps", "2" if tiny else "5", "--warmup", "1" if tiny else "3"]
    args = args or (TINY if tiny else GPT2_124M)
    r, summary = _run_json([*cmd, *args], 300, {"TORCH_COMPILE_DISABLE": "1"} if tiny else None)
    return {**r, "summary": summary, "ok": r["rc"] == 0 and summary is not None}


def profiles(tiny: bool, also: list[str]) -> dict:
    """(b2), and the same profile of each (f) row named by --profile-also (a target's "why": moe-1b, float8)."""
    rows = TINY_MODELS if tiny else MODELS
    main = profile_step(tiny)
    more = {name: profile_step(tiny, args=rows[name]) for name in also}  # jaxpar's rows alone (main checks)
    return {**main, "more": more, "ok": main["ok"] and all(m["ok"] for m in more.values())}


def torch_profile(tiny: bool) -> dict:
    """(b3): (b)'s torchpar step (torch.compile) profiled as (b2)."""
    return profile_step(tiny, "torchpar.tools.gpu_profile", ("--compile",))


def bench_row(args: list[str], tiny: bool, timeout: int = 300, framework: str = "jaxpar") -> dict:
    """One jaxpar.tools.bench run on one device (or torchpar.tools.bench's, compiled): its command, rc and row.

    The row is None if it wrote none.
    """
    tool = ["jaxpar.tools.bench", "--mesh", "dp=1"] if framework == "jaxpar" else ["torchpar.tools.bench", "--compile"]
    steps = ["--steps", "3" if tiny else "10", "--warmup", "1" if tiny else "3"]
    env = {"TORCH_COMPILE_DISABLE": "1"} if tiny else BIG_ROW_ENV if "configs/llama-3b.yaml" in args else None
    r, row = _run_json([sys.executable, "-m", *tool, *steps, *args], timeout, env)
    return {**r, "row": row, "ok": r["rc"] == 0 and row is not None}


def offload(tiny: bool) -> dict:
    """(b)'s jaxpar run with each layer's projection outputs in host memory between its forward and backward."""
    return bench_row([*(TINY if tiny else GPT2_124M), "model.remat=offload"], tiny)


def models(tiny: bool) -> dict:
    """(f): each of MODELS (the tiny configs with --tiny) while the budget lasts; each changed row over its baseline."""
    rows, not_run = {}, []
    for name, args in (TINY_MODELS if tiny else MODELS).items():
        if _left() < MIN_PART_S:
            not_run.append(name)
            continue
        framework = "torchpar" if name.startswith("torchpar ") else "jaxpar"
        rows[name] = bench_row(args, tiny, 300, framework)
    tps = lambda name: ((rows.get(name) or {}).get("row") or {}).get("tokens_per_sec") or 0
    ratios = {name: tps(name) / tps(base) for name, base in BASELINES.items() if tps(name) and tps(base)}
    return {"rows": rows, "ratios": ratios, "not_run": not_run, "ok": all(r["ok"] for r in rows.values())}


def attention(tiny: bool, hlo_out: str) -> dict:
    """(c) What the compiled jaxpar step calls: its attention, its largest casts, its float8 matmuls.

    cuDNN's fused attention shows as a custom call; the casts are the profile's convert kernels, by tensor; the
    float8 step (model.float8) is compiled too, to see whether XLA turned its matmuls into float8 GEMMs. The bf16
    step's optimized HLO is written to `hlo_out` (gzip) for reading after the call.
    """
    import jax  # deferred: jax (~1 s), after the arguments are checked

    from jaxpar.step import build_step  # deferred: imports jax, after the arguments are checked

    args = TINY if tiny else GPT2_124M
    compiled = lambda overrides: build_step(
        load_config(args[1], [*args[2:], *overrides]), {"dp": 1}, jax.devices()[:1], abstract=True
    )[2].as_text()
    hlo = compiled([])
    with gzip.open(hlo_out, "wt") as f:
        f.write(hlo)
    cudnn = sorted(set(re.findall(r'custom_call_target="(__cudnn\$[^"]+)"', hlo)))
    kind = f"cuDNN fused attention ({', '.join(cudnn)})" if cudnn else "XLA's own (softmax(QK^T)V as separate ops)"
    float8 = matmuls_of(compiled(["model.float8=true"]))
    return {
        "implementation": kind,
        "cudnn_calls": cudnn,
        "converts": converts_of(hlo),
        "float8": float8,
        "hlo": hlo_out,
        "ok": True,
    }


def ceiling(tiny: bool) -> dict:
    dtype = "float32" if tiny else "bfloat16"
    return {"dtype": dtype, "flops": matmul_ceiling(dtype), "ok": True}


def versions() -> dict:
    import jax  # deferred: jax (~1 s), after the arguments are checked

    out = {"python": platform.python_version(), "jax": jax.__version__}
    for name in ("torch", "flax", "optax", "orbax.checkpoint", "grain", "deepspeed"):
        try:
            out[name] = __import__(name, fromlist=["__version__"]).__version__
        except Exception as e:  # noqa: BLE001 - missing or broken: say which
            out[name] = f"missing ({type(e).__name__})"
    return out


def gib(row: dict) -> str:
    return "-" if row.get("memory_gib") is None else f"{row['memory_gib']:.2f}"


def profile_and_compiled_lines(res: dict) -> list[str]:
    """The report's (b2), (b3) and (c): where each framework's step spends its device time, what XLA compiled."""
    lines = []
    for part, title in (
        ("profile", "(b2) Profile of (b)'s jaxpar step"),
        ("torch_profile", "(b3) Profile of (b)'s torchpar step (torch.compile)"),
    ):
        if part in res:
            for name, p in [(title, res[part]), *res[part].get("more", {}).items()]:
                summary = profile_lines(p["summary"]) if p["summary"] else ["(no summary: see the JSON's tail)"]
                heading = f"## {title}" if name == title else f"### (b2) The step of (f)'s row {name}"
                lines += [heading, "", f"`{p['command']}` -> rc {p['rc']}", "", *summary, ""]
    if "attention" in res:
        a, f8 = res["attention"], res["attention"]["float8"]
        lines += [
            "## (c) Attention, casts and float8 in the compiled jaxpar step",
            "",
            f"The compiled jaxpar step calls {a['implementation']}. Its largest convert fusions (the profile's "
            "convert kernels):",
            "",
            "| fusion | result | MiB written |",
            "|---|---|---|",
            *[f"| `{c['name']}` | {c['shape']} | {c['mib']:,.1f} |" for c in a["converts"]],
            "",
            f"With model.float8=true: {f8['matmuls']} matmuls, {f8['float8_cublas']} of them cuBLAS float8 GEMMs, "
            f"{f8['float8_dots']} other dots on float8 operands. The bf16 step's optimized HLO: `{a['hlo']}`.",
            "",
        ]
    return lines


def markdown(res: dict) -> str:
    broken = {k: res[k]["error"] for k in PARTS if k in res and "error" in res[k]}  # parts that raised
    res = {k: v for k, v in res.items() if k not in broken}
    lines = [
        f"# GPU check, {res['date']}",
        "",
        f"Device: {res['device']} ({res['devices']} visible). "
        f"Versions: {', '.join(f'{k} {v}' for k, v in res['versions'].items())}.",
        "",
        f"Command: `{res['command']}`",
        "",
    ]
    if "parity" in res:
        p = res["parity"]
        lines += [
            "## (a) Parity suite",
            "",
            f"`{p['command']}` -> rc {p['rc']} in {p['seconds']:.0f} s: "
            f"{', '.join(f'{n} {k}' for k, n in p['counts'].items()) or 'no summary'}",
            *([f"- FAILED {f}" for f in p["failed"]]),
            "",
        ]
    if "throughput" in res:
        t, j = res["throughput"], res["throughput"]["jaxpar"] or {}
        mfu = j.get("mfu_datasheet")
        lines += [
            "## (b) Throughput, one device",
            "",
            f"`{t['command']}` -> rc {t['rc']}",
            "",
            "| framework | tokens/s | MFU (datasheet) | MFU (matmul ceiling) | peak GiB |",
            "|---|---|---|---|---|",
            f"| jaxpar | {j.get('tokens_per_sec', 0):,.0f} | {'-' if mfu is None else f'{mfu:.1%}'} | "
            f"{j.get('mfu_ceiling') or 0:.1%} | {gib(j)} |",
            f"| torchpar ({'eager: --tiny' if res['tiny'] else 'torch.compile'}) | "
            f"{t['torchpar_tokens_per_sec'] or 0:,.0f} | | | |",
            "",
            f"jaxpar / torchpar: {t['ratio'] or float('nan'):.2f}",
            "",
        ]
    lines += profile_and_compiled_lines(res)
    if "ceiling" in res:
        c = res["ceiling"]
        lines += [
            "## (d) Matmul ceiling",
            "",
            f"{c['dtype']}: {c['flops'] / 1e12:.1f} TFLOP/s (one square matmul, jaxpar/tools/bench.py:matmul_ceiling)",
            "",
        ]
    if "offload" in res:
        o, b = res["offload"], (res.get("throughput") or {}).get("jaxpar") or {}
        row = lambda name, j: f"| {name} | {j.get('tokens_per_sec', 0):,.0f} | {gib(j)} |"
        lines += [
            "## (e) Activation offload",
            "",
            f"`{o['command']}` -> rc {o['rc']}",
            "",
            "| jaxpar, model.remat | tokens/s | peak GiB |",
            "|---|---|---|",
            row("none ((b))", b),
            row("offload", o["row"] or {}),
            "",
        ]
    if "models" in res:
        m = res["models"]
        lines += [
            "## (f) Models and changes, one device (jaxpar unless named torchpar: torch.compile)",
            "",
            "| model | tokens/s | MFU (datasheet) | peak GiB | command |",
            "|---|---|---|---|---|",
        ]
        for name, r in m["rows"].items():
            j, mfu = r["row"] or {}, (r["row"] or {}).get("mfu_datasheet")
            lines.append(
                f"| {name} | {j.get('tokens_per_sec', 0):,.0f} | {'-' if mfu is None else f'{mfu:.1%}'} | "
                f"{gib(j)} | `{r['command']}` -> rc {r['rc']} |"
            )
        lines += ["", "| row | tokens/s over its baseline row |", "|---|---|"]
        lines += [f"| {name} | {ratio:.3f}x of {BASELINES[name]} |" for name, ratio in m["ratios"].items()]
        torch_b = (res.get("throughput") or {}).get("torchpar_tokens_per_sec")  # the torchpar GPT-2 rows' baseline
        for name, r in m["rows"].items():
            if name.startswith("torchpar gpt2") and torch_b and (r["row"] or {}).get("tokens_per_sec"):
                lines.append(f"| {name} | {r['row']['tokens_per_sec'] / torch_b:.3f}x of (b)'s torchpar |")
        lines += [*([f"Not started, the budget spent: {', '.join(m['not_run'])}"] if m["not_run"] else []), ""]
    lines += [line for part, error in broken.items() for line in (f"## {part}: failed", "", f"`{error}`", "")]
    failed = [k for k in PARTS if k in broken or (k in res and not res[k]["ok"])]
    lines += [f"Result: {'all parts ran' if not failed else 'FAILED: ' + ', '.join(failed)}", ""]
    if res.get("not_run"):
        lines += [f"Not run, the call's budget of {res['budget_s']:.0f} s spent: {', '.join(res['not_run'])}", ""]
    return "\n".join(lines)


def write_report(out: str, res: dict) -> str:
    report = markdown(res)
    with open(out, "w") as f:
        f.write(report)
    with open(os.path.splitext(out)[0] + ".json", "w") as f:
        json.dump(res, f, indent=2, default=str)
    return report


@cli
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m jaxpar.tools.gpu_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--tiny", action="store_true", help="the same path on the CPU, tiny config (CI)")
    ap.add_argument("--out", help="report path (default docs/benchmarks/gpu-check-<date>.md)")
    ap.add_argument("--skip", default="", help=f"comma-separated parts to leave out: {', '.join(PARTS)}")
    ap.add_argument(
        "--profile-also",
        default="",
        help="comma-separated jaxpar rows of (f) to profile in part (b2) as well (60 s more of its share each)",
    )
    ap.add_argument("--budget", type=float, default=570.0, help="seconds the whole call may take (default 570)")
    args = ap.parse_args(argv)
    if args.budget <= 0:
        raise UserError(f"--budget {args.budget:g}: the call needs some seconds")
    _DEADLINE[0] = time.perf_counter() + args.budget
    skip = {s for s in args.skip.split(",") if s}
    if skip - set(PARTS):
        raise UserError(f"--skip {args.skip}: parts are {', '.join(PARTS)}")
    also = [a for a in args.profile_also.split(",") if a]
    rows = [n for n in (TINY_MODELS if args.tiny else MODELS) if not n.startswith("torchpar ")]
    if set(also) - set(rows):
        raise UserError(f"--profile-also {args.profile_also}: jaxpar's rows are {', '.join(rows)}")
    # this process runs parts (c) and (d) itself: without this, jax would hold 75% of the GPU's memory here
    # while (e) and (f) run in their own processes (they ran out of memory, 2026-11-27); those keep jax's default
    own = "XLA_PYTHON_CLIENT_PREALLOCATE" not in os.environ
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax  # deferred: jax (~1 s), after the arguments are checked

    jax.devices()  # the backend starts here, reading the setting
    if own:
        del os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"]
    if jax.devices()[0].platform != "gpu" and not args.tiny:
        raise UserError(f"no GPU here (jax sees {jax.devices()[0].platform}); use --tiny to check the path on the CPU")
    date = datetime.date.today().isoformat()
    res = {
        "date": date,
        "tiny": args.tiny,
        "device": jax.devices()[0].device_kind,
        "devices": jax.device_count(),
        "versions": versions(),
        "command": "python -m jaxpar.tools.gpu_check " + shlex.join(sys.argv[1:] if argv is None else argv),
        "budget_s": args.budget,
        "not_run": [],
    }
    out = args.out or os.path.join("docs", "benchmarks", f"gpu-check-{date}.md")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    for part, fn in (
        ("parity", lambda: parity("cpu" if args.tiny else "gpu", args.tiny)),
        ("throughput", lambda: throughput(args.tiny)),
        ("profile", lambda: profiles(args.tiny, also)),
        ("torch_profile", lambda: torch_profile(args.tiny)),
        ("attention", lambda: attention(args.tiny, os.path.splitext(out)[0] + "-step.hlo.txt.gz")),
        ("ceiling", lambda: ceiling(args.tiny)),
        ("offload", lambda: offload(args.tiny)),
        ("models", lambda: models(args.tiny)),
    ):
        if part in skip:
            continue
        _PART_END[0] = float("inf")
        if _left() < MIN_PART_S:  # not started: the report comes back within the budget
            res["not_run"].append(part)
            continue
        if not args.tiny:  # the shares are a GPU call's; on a shared CPU (CI) only the whole budget bounds a part
            _PART_END[0] = time.perf_counter() + PART_S[part] + (60 * len(also) if part == "profile" else 0)
        print(f"gpu_check: {part} ({_left():.0f} s left) ...", file=sys.stderr, flush=True)
        try:
            res[part] = fn()
        except Exception as e:  # noqa: BLE001 - a part that breaks (c's compile, say) is reported; the rest run
            res[part] = {"error": f"{type(e).__name__}: {str(e)[:500]}", "ok": False}
        res["not_run"] += [f"{part}: {row}" for row in res[part].get("not_run", [])]  # (f)'s rows not started
        write_report(out, res)  # after each part: a call cut off still returns what ran
    print(write_report(out, res))
    return 0 if all(res[k]["ok"] for k in PARTS if k in res) and not res["not_run"] else 1


if __name__ == "__main__":
    sys.exit(main())
