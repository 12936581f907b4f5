"""bench, bench_collectives, report and profiling run on CPU (figures labelled CPU): the code paths are exercised."""

import os

from jaxpar.core.bench_records import HEADER, markdown_row
from jaxpar.core.config.schema import load_config
from jaxpar.tools import bench, bench_collectives
from jaxpar.core.config.mesh_spec import parse_mesh


def test_bench_reports_cpu_figures():
    cfg = load_config("configs/gpt2-tiny.yaml", ["train.global_batch_size=8"])
    r = bench.bench(cfg, parse_mesh("dp=2,tp=4"), steps=2, warmup=1)
    assert r["device_kind"].startswith("cpu") and r["devices"] == 8
    assert r["mfu_datasheet"] is None  # no datasheet peak for a CPU: never a made-up number
    assert r["tokens_per_sec"] > 0 and 0 < r["mfu_ceiling"] < 1
    assert abs(r["tokens_per_sec"] * r["step_time_s"] - 8 * cfg.data.seq_len) < 1e-6 * r["tokens_per_sec"]
    row = markdown_row(r)
    assert row.startswith(f"| {r['date']} | cpu") and "jax " in row


def test_collectives_bench_covers_each_op():
    rows = bench_collectives.run(max_bytes=16384, reps=1)
    assert {r["op"] for r in rows} == {"all_reduce", "all_gather", "reduce_scatter", "ppermute"}
    for r in rows:
        assert r["time_s"] > 0 and r["busbw_gbs"] <= r["algbw_gbs"] * 2


def test_report_draws_pngs(tmp_path, capsys):
    import json

    from jaxpar.tools import report

    runs = [
        {
            "framework": "jaxpar",
            "mesh": f"dp={n}",
            "devices": n,
            "tokens_per_sec": 100.0 * n,
            "mfu_ceiling": 0.1,
            "memory_gib": None,
            "device_kind": "cpu:cpu",
            "compute_dtype": "float32",
        }
        for n in (1, 2, 4)
    ]
    (tmp_path / "b.json").write_text(json.dumps(runs))
    assert report.main([str(tmp_path / "b.json"), "--out", str(tmp_path / "plots")]) == 0
    for name in ("throughput.png", "mfu.png", "memory.png", "scaling.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "bad.json").write_text("{}")
    assert report.main([str(tmp_path / "bad.json")]) == 2
    assert "not a benchmark result" in capsys.readouterr().err


def test_torchpar_bench_reports_the_same_fields(tmp_path):
    import json
    import subprocess
    import sys

    from tests.helpers import ROOT, TINY

    out = tmp_path / "t.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchpar.tools.bench",
            "--backend",
            "none",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--json",
            str(out),
            *TINY,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    t = json.loads(out.read_text())
    assert t["framework"] == "torchpar" and t["device_kind"].startswith("cpu") and t["mfu_datasheet"] is None
    assert t["tokens_per_sec"] > 0 and "torch" in t["versions"]
    assert markdown_row(t).count("|") == HEADER.splitlines()[0].count("|")


def test_torchpar_collectives_bench_on_two_processes(tmp_path):
    import json
    import os
    import subprocess
    import sys

    from tests.helpers import ROOT, free_port

    out = tmp_path / "c.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            f"--master_port={free_port()}",
            "-m",
            "torchpar.tools.bench_collectives",
            "--max-mib",
            "0.02",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert {x["op"] for x in rows} == {"all_reduce", "all_gather", "reduce_scatter", "ppermute"}
    assert all(x["devices"] == 2 and x["time_s"] > 0 for x in rows)


def test_profile_steps_write_traces(tmp_path):
    """train.profile_steps=a:b leaves a jax.profiler trace (jaxpar) and a torch.profiler trace (torchpar)."""
    import subprocess
    import sys

    from tests.helpers import ROOT, TINY, make_dataset, run_cli

    dataset = make_dataset(tmp_path / "tokens.bin")
    r = run_cli(tmp_path / "jax", dataset, "train.steps=4", "train.profile_steps=1:3")
    assert r.returncode == 0, r.stderr
    assert any(f.endswith(".xplane.pb") for _, _, fs in os.walk(tmp_path / "jax" / "profile") for f in fs)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchpar.train",
            "--backend",
            "none",
            *TINY,
            f"data.dataset={dataset}",
            f"run.dir={tmp_path / 'torch'}",
            "train.steps=4",
            "train.profile_steps=1:3",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "torch" / "profile" / "trace_rank0.json").stat().st_size > 0
    bad = run_cli(tmp_path / "bad", dataset, "train.profile_steps=3:1")
    assert bad.returncode == 2 and "train.profile_steps" in bad.stderr


def test_sweep_and_scaling_report(tmp_path):
    """Two meshes in one bench run, then report --scaling.

    The table's speedups and efficiencies are the rows' own tokens/s ratios (recomputed here), and the plots are
    written.
    """
    import json
    import subprocess
    import sys

    from tests.helpers import ROOT, TINY

    rows_path = tmp_path / "rows.json"
    cmd = [
        sys.executable,
        "-m",
        "jaxpar.tools.bench",
        "--mesh",
        "dp=1",
        "--mesh",
        "dp=2",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--json",
        str(rows_path),
        *TINY,
    ]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    assert subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, timeout=300).returncode == 0
    rows = json.loads(rows_path.read_text())
    assert [(r["mesh"], r["devices"]) for r in rows] == [("dp=1", 1), ("dp=2", 2)]
    assert rows[0]["pipeline_bubble"] is None
    out = subprocess.run(
        [sys.executable, "-m", "jaxpar.tools.report", str(rows_path), "--out", str(tmp_path / "p"), "--scaling"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    table = (tmp_path / "p" / "scaling.md").read_text()
    base = rows[0]["tokens_per_sec"]
    for r in rows:
        speedup = r["tokens_per_sec"] / base
        assert (
            f"| jaxpar {r['mesh']} float32 | {r['devices']} | {r['tokens_per_sec']:,.0f} | {speedup:.2f}x | "
            f"{speedup / r['devices']:.0%} |" in table
        ), table
    assert {"scaling.png", "efficiency.png", "throughput.png"} <= set(os.listdir(tmp_path / "p"))


def test_optimizer_bench_trains_two_optimizers_and_writes_its_tables(tmp_path):
    """bench_optimizers trains each sweep point through jaxpar.train and tabulates the runs' own metrics.jsonl.

    The evaluation losses in the table are the ones the runs logged.
    """
    import json
    import subprocess
    import sys

    from tests.helpers import ROOT, TINY, make_dataset

    dataset = make_dataset(tmp_path / "tokens.bin")
    table = tmp_path / "table.md"
    cmd = [
        sys.executable,
        "-m",
        "jaxpar.tools.bench_optimizers",
        "--sweep",
        "adamw=1e-2",
        "--sweep",
        "muon=1e-2",
        "--out",
        str(tmp_path / "runs"),
        "--table",
        str(table),
        *TINY,
        f"data.dataset={dataset}",
        "train.steps=4",
        "train.eval_every=2",
        "train.log_every=2",
    ]
    r = subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-2000:]
    text = table.read_text()
    for name in ("adamw", "muon"):
        records = [json.loads(line) for line in (tmp_path / "runs" / f"{name}-lr0.01" / "metrics.jsonl").open()]
        final = [x["eval_loss"] for x in records if x["step"] == 4][0]
        assert f"| {name} | 0.01 | " in text and f"{final:.4f}" in text
        assert json.load((tmp_path / "runs" / f"{name}-lr0.01" / "config.json").open())["optim"]["min_lr"] == 1e-3
    assert "eval loss within" in text and "vs adamw" in text
