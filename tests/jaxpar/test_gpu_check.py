"""The GPU validation command runs end to end on the CPU (--tiny), so that it works when a GPU session comes."""

import json
import os
import subprocess
import sys

from jaxpar.cost.hlo_kernels import converts_of, matmuls_of
from jaxpar.tools import gpu_check
from tests.helpers import ROOT


def test_gpu_check_tiny_writes_its_report(tmp_path):
    out = tmp_path / "report.md"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxpar.tools.gpu_check",
            "--tiny",
            "--profile-also",
            "moe-tiny ragged",
            "--out",
            str(out),
        ],
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
        "(b3) Profile of (b)'s torchpar step",
        "(c) Attention",
        "(d) Matmul ceiling",
        "(e) Activation offload",
        "(f) Models and changes",
    ):
        assert heading in report, report
    assert res["parity"]["counts"] == {"passed": 1}, res["parity"]["tail"]  # float32, jaxpar vs torchpar
    assert res["throughput"]["jaxpar"]["tokens_per_sec"] > 0 and res["throughput"]["ratio"] > 0
    kinds = res["profile"]["summary"]["kinds"]  # XLA:CPU's thunks: its matmuls are YNNPACK fusions
    ragged = res["profile"]["more"]["moe-tiny ragged"]  # --profile-also: that (f) row's step profiled as well
    assert "model.moe_ragged=true" in ragged["command"] and ragged["summary"]["kernel_ms"] > 0
    assert "### (b2) The step of (f)'s row moe-tiny ragged" in report
    assert kinds["matmul"]["ms"] > 0 and abs(sum(k["share"] for k in kinds.values()) - 1) < 1e-6, kinds
    assert res["attention"]["cudnn_calls"] == [] and "XLA's own" in report  # no cuDNN on a CPU
    assert res["ceiling"]["dtype"] == "float32" and res["ceiling"]["flops"] > 0
    assert res["offload"]["row"]["remat"] == "offload" and res["offload"]["row"]["tokens_per_sec"] > 0
    torch_kinds = res["torch_profile"]["summary"]["kinds"]  # torch's operators on the CPU: aten::bmm, aten::mm
    assert torch_kinds["matmul"]["ms"] > 0 and abs(sum(k["share"] for k in torch_kinds.values()) - 1) < 1e-6
    assert set(res["models"]["rows"]) == set(gpu_check.TINY_MODELS)
    assert all(r["row"]["tokens_per_sec"] > 0 for r in res["models"]["rows"].values())
    assert res["models"]["rows"]["llama-tiny float8"]["row"]["float8"]
    assert res["models"]["rows"]["torchpar llama-tiny float8"]["row"]["framework"] == "torchpar"
    assert set(res["models"]["ratios"]) == {n for n in gpu_check.BASELINES if n in gpu_check.TINY_MODELS}
    assert res["attention"]["float8"]["matmuls"] > 0
    assert "Result: all parts ran" in report and "Versions: python" in report


def test_the_calls_budget_cuts_subprocesses_and_leaves_late_parts_unrun(tmp_path, monkeypatch):
    """--budget and each part's share cut a subprocess's timeout; a part with too little of the call left is not run."""
    import time

    monkeypatch.setattr(gpu_check, "_DEADLINE", [time.perf_counter() + 2])
    r = gpu_check._run(["sleep", "30"], 300)
    assert r["rc"] == "timeout" and r["seconds"] < 10
    monkeypatch.setattr(gpu_check, "_DEADLINE", [time.perf_counter() + 300])
    monkeypatch.setattr(gpu_check, "_PART_END", [time.perf_counter() + 2])  # the part's own share (PART_S) cuts it too
    r = gpu_check._run(["sleep", "30"], 300)
    assert r["rc"] == "timeout" and r["seconds"] < 10
    monkeypatch.setattr(gpu_check, "_PART_END", [float("inf")])
    out = tmp_path / "report.md"
    assert gpu_check.main(["--tiny", "--budget", "30", "--skip", "throughput,profile", "--out", str(out)]) == 1
    report = out.read_text()
    assert (
        "Not run, the call's budget of 30 s spent: parity, torch_profile, attention, ceiling, offload, models" in report
    )


def test_the_compiled_steps_casts_and_float8_matmuls_are_read_off_its_hlo():
    """The convert fusions (kernels, not the ops inside one) by bytes written; float8 GEMMs and dots counted.

    jaxpar/cost/hlo_kernels.py, as gpu_check's (c) reads the compiled step.
    """
    hlo = """
  %loop_convert_fusion.2 = f32[16,128,50304]{2,1,0} fusion(bf16[16,128,50304]{2,1,0} %p), kind=kLoop
  ROOT %convert_element_type.1 = bf16[768]{0} convert(f32[768]{0} %q)
  %loop_convert_multiply_fusion = (bf16[4,1024]{1,0}, f32[1024]{0}) fusion(%a, %b), kind=kLoop
  %cc.3 = (f32[8,8]) custom-call(f8e4m3fn[8,8] %a, f8e4m3fn[8,8] %b), custom_call_target="__cublas$lt$matmul$f8"
  %custom-call.4 = (bf16[8,8]{1,0}) custom-call(bf16[8,8] %c, bf16[8,8] %d), custom_call_target="__cublas$gemm"
  %dot.5 = f32[64,64]{1,0} dot(f8e5m2[64,32]{1,0} %e, f8e4m3fn[32,64]{1,0} %f), lhs_contracting_dims={1}
  %dot.6 = f32[64,64]{1,0} dot(f32[64,32]{1,0} %g, f32[32,64]{1,0} %h), lhs_contracting_dims={1}
"""
    converts = converts_of(hlo)
    assert [c["name"] for c in converts] == ["loop_convert_fusion.2", "loop_convert_multiply_fusion"]
    assert converts[0]["shape"] == "f32[16,128,50304]" and converts[0]["mib"] == 16 * 128 * 50304 * 4 / 2**20
    assert converts[1]["shape"] == "bf16[4,1024], f32[1024]" and converts[1]["mib"] == (4 * 1024 * 2 + 1024 * 4) / 2**20
    assert matmuls_of(hlo) == {"matmuls": 4, "float8_cublas": 1, "float8_dots": 1}


def test_torch_profiles_device_events_are_the_traces_kernels_and_copies():
    """torchpar's GPU profile sums the chrome trace's kernel, memcpy and memset events, not the host's operators."""
    from jaxpar.core.kernel_profile import summarize
    from torchpar.tools.gpu_profile import device_kernels

    trace = {
        "traceEvents": [
            {"cat": "cpu_op", "name": "aten::mm", "dur": 900.0},
            {"cat": "kernel", "name": "nvjet_sm90_tst_128x160", "dur": 300.0},
            {"cat": "kernel", "name": "nvjet_sm90_tst_128x160", "dur": 100.0},
            {"cat": "kernel", "name": "triton_red_fused_native_layer_norm_0", "dur": 50.0},
            {"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "dur": 50.0},
        ]
    }
    p = summarize(device_kernels(trace), steps=2, step_s=0.001)
    assert p["kernel_ms"] == 0.25 and p["busy"] == 0.25
    assert {k: v["ms"] for k, v in p["kinds"].items()} == {"matmul": 0.2, "reduce": 0.025, "copy/transpose": 0.025}
    assert p["top"][0]["launches"] == 1.0


def test_the_parity_cases_split_by_config_and_a_broken_part_is_reported_not_fatal(tmp_path, monkeypatch):
    """(a)'s processes each get whole configs (their reference runs are shared); a part that raises is a report line."""
    ids = [f"parity_tests/test_parity.py::test_parity[{c}]" for c in ("float32-a", "float32-b", "llama-a")]
    ids += [
        "parity_tests/test_parity.py::test_checker_names_a_nudged_parameter",
        "parity_tests/test_parity.py::test_parity[bf16-c]",
    ]
    # float32's two cases stay together; the rest fill the emptiest process
    assert gpu_check.split_cases(ids, 3) == [ids[:2], [ids[2], ids[4]], [ids[3]]]
    assert gpu_check.split_cases(ids[:2], 3) == [ids[:2]]  # one config: one process

    def broken(tiny):
        raise RuntimeError("XLA compile failed")

    monkeypatch.setattr(gpu_check, "ceiling", broken)
    out = tmp_path / "report.md"
    assert (
        gpu_check.main(
            ["--tiny", "--skip", "parity,throughput,profile,torch_profile,attention,offload,models", "--out", str(out)]
        )
        == 1
    )
    report = out.read_text()
    assert "## ceiling: failed" in report and "RuntimeError: XLA compile failed" in report
    assert "Result: FAILED: ceiling" in report


def test_rows_left_without_time_are_listed_not_started(monkeypatch):
    """(f): a row with less than MIN_PART_S of the call left is not started and the report names it."""
    import time

    monkeypatch.setattr(gpu_check, "_DEADLINE", [time.perf_counter() + gpu_check.MIN_PART_S - 1])
    m = gpu_check.models(tiny=True)
    assert m["rows"] == {} and m["not_run"] == list(gpu_check.TINY_MODELS) and m["ok"]
