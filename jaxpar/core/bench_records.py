"""Benchmark records both frameworks write.

The dated markdown rows of docs/benchmarks/ and the collective-bandwidth rows (nccl-tests' definitions of algorithm and
bus bandwidth).
"""

from __future__ import annotations

import json
import os

# the checkout's docs/benchmarks (this file is jaxpar/core/bench_records.py)
BENCH_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs", "benchmarks"
)


def markdown_row(r: dict) -> str:
    pct = lambda x: "-" if x is None else f"{x:.1%}"
    mem = "-" if r["memory_gib"] is None else f"{r['memory_gib']:.2f}"
    layout = r.get("mesh") or r.get("backend", "") + (" (compiled)" if r.get("compiled") else "")
    versions = ", ".join(f"{k} {v}" for k, v in r["versions"].items())
    return (
        f"| {r['date']} | {r['device_kind']} x{r['devices']} | {r['framework']} {layout} | {r['compute_dtype']} | "
        f"{r['seq_len']}x{r['global_batch_size']} | {r['tokens_per_sec']:,.0f} | {pct(r['mfu_datasheet'])} | "
        f"{pct(r['mfu_ceiling'])} | {mem} | {versions} | `{r['command']}` |"
    )


HEADER = (
    "| date | device | run | dtype | seq x batch | tokens/s | MFU (datasheet) | MFU (matmul ceiling) | "
    "peak GiB | versions | command |\n|---|---|---|---|---|---|---|---|---|---|---|\n"
)


def append_row(name: str, header: str, row: str) -> str:
    """Append a markdown row to docs/benchmarks/<name>, the table's header first if the file is new."""
    path = os.path.join(BENCH_DIR, name)
    new = not os.path.exists(path)
    with open(path, "a") as f:
        f.write((header if new else "") + row + "\n")
    return path


def record_row(result: dict) -> str:
    """Append the result as a dated row to docs/benchmarks/<framework>-bench.md."""
    return append_row(f"{result['framework']}-bench.md", HEADER, markdown_row(result))


def write_json(path: str, result) -> None:
    """A tool's --json file, its folder made here (check_output_file checked the path before the measurement)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


def publish(result: dict, json_path: str | None, record: bool) -> None:
    """Print the result; write it as JSON and/or a dated markdown row where asked."""
    print(json.dumps(result, indent=2))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
    if record:
        record_row(result)


# bus bandwidth factor for n devices (nccl-tests' definitions)
BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "ppermute": lambda n: 1.0,
}


def measurement(op: str, nbytes: int, seconds: float, n: int, platform: str) -> dict:
    """One row: algorithm and bus bandwidth of `op` moving `nbytes` per device among n in `seconds`."""
    return {
        "op": op,
        "bytes_per_device": nbytes,
        "time_s": seconds,
        "algbw_gbs": nbytes / seconds / 1e9,
        "busbw_gbs": nbytes / seconds / 1e9 * BUS_FACTOR[op](n),
        "devices": n,
        "platform": platform,
    }


def print_rows(rows: list[dict]) -> None:
    print(f"{'op':<15} {'bytes/device':>13} {'time':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}")
    for r in rows:
        print(
            f"{r['op']:<15} {r['bytes_per_device']:>13,} {r['time_s'] * 1e6:>8.1f}us {r['algbw_gbs']:>11.2f} "
            f"{r['busbw_gbs']:>11.2f}"
        )
