"""The GPU validation command runs end to end on the CPU (--tiny), so that it works when a GPU session comes."""

import json
import os
import subprocess
import sys

from tests.helpers import ROOT


def test_gpu_check_tiny_writes_its_report(tmp_path):
    out = tmp_path / "report.md"
    r = subprocess.run(
        [sys.executable, "-m", "jaxpar.tools.gpu_check", "--tiny", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report, res = out.read_text(), json.loads(out.with_suffix(".json").read_text())
    for heading in (
        "(a) Parity suite",
        "(b) Throughput",
        "(b2) Profile",
        "(c) Attention",
        "(d) Matmul ceiling",
        "(e) Activation offload",
        "(f) Larger models",
    ):
        assert heading in report, report
    assert res["parity"]["counts"] == {"passed": 1}, res["parity"]["tail"]  # float32, jaxpar vs torchpar
    assert res["throughput"]["jaxpar"]["tokens_per_sec"] > 0 and res["throughput"]["ratio"] > 0
    kinds = res["profile"]["summary"]["kinds"]  # XLA:CPU's thunks: its matmuls are YNNPACK fusions
    assert kinds["matmul"]["ms"] > 0 and abs(sum(k["share"] for k in kinds.values()) - 1) < 1e-6, kinds
    assert res["attention"]["cudnn_calls"] == [] and "XLA's own" in report  # no cuDNN on a CPU
    assert res["ceiling"]["dtype"] == "float32" and res["ceiling"]["flops"] > 0
    assert res["offload"]["jaxpar"]["remat"] == "offload" and res["offload"]["jaxpar"]["tokens_per_sec"] > 0
    rows = {"llama-tiny", "llama-tiny float8", "moe-tiny", "moe-tiny ragged", "gpt2-tiny bf16 float32 logits"}
    assert set(res["models"]["rows"]) == rows
    assert all(r["jaxpar"]["tokens_per_sec"] > 0 for r in res["models"]["rows"].values())
    assert res["models"]["rows"]["llama-tiny float8"]["jaxpar"]["float8"] and res["models"]["float8_speedup"] > 0
    assert "Result: all parts ran" in report and "Versions: python" in report


def test_the_calls_budget_cuts_subprocesses_and_leaves_late_parts_unrun(tmp_path, monkeypatch):
    """--budget: a subprocess's timeout is cut to the time left; a part with under a minute left is not started."""
    import time

    from jaxpar.tools import gpu_check

    monkeypatch.setattr(gpu_check, "_DEADLINE", [time.perf_counter() + 2])
    r = gpu_check._run(["sleep", "30"], 300)
    assert r["rc"] == "timeout" and r["seconds"] < 10
    out = tmp_path / "report.md"
    assert gpu_check.main(["--tiny", "--budget", "30", "--skip", "throughput,profile", "--out", str(out)]) == 1
    report = out.read_text()
    assert "Not run, the call's budget of 30 s spent: parity, attention, ceiling, offload, models" in report
