"""torchpar: every backend on 2 processes (torchrun over gloo) reproduces the 1-process float32 run.

All runs start from the same initial weights (--write-init once, then model.init_from), so only
the backends differ. Each subprocess has a timeout, must not print an abort, and must leave no
process behind (each run gets its own session; the session must be empty when it returns).
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from safetensors.numpy import load_file

from jaxpar.core.config.schema import load_config
from torchpar.checkpoint import complete_steps
from torchpar.trainer import build_model

from tests.helpers import (
    ABORTS,
    ROOT,
    assert_params_close,
    free_port,
    metrics,
    no_leftovers,
    run_in_session,
    tensorboard_scalars,
    torch_command,
    torch_env,
)
from tests.torchpar.runs import assert_same_run, run


def test_reference_learns(reference):
    assert reference[10]["loss"] < reference[1]["loss"] - 0.5
    assert reference[10]["eval_loss"] is not None
    fields = {
        "step",
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_sec",
        "step_time_s",
        "mfu",
        "memory_gib",
        "eval_loss",
        "memory_in_use_gib",
        "data_wait_share",
    }
    assert set(reference[10]) == fields


BACKENDS = [
    ("ddp", []),
    ("fsdp", []),
    ("deepspeed", ["parallel.zero_stage=1"]),
    ("deepspeed", ["parallel.zero_stage=2"]),
    ("deepspeed", ["parallel.zero_stage=3"]),
]


_NO_JAX = """
import sys
import torchpar.train
rc = torchpar.train.main(sys.argv[1:])
leaked = sorted({m.split(".")[0] for m in sys.modules} & {"jax", "jaxlib", "flax", "optax", "orbax", "grain"})
print("jax-side modules imported:", leaked)
sys.exit(rc or bool(leaked))
"""


def test_tensorboard_holds_the_metrics(base, reference):
    scalars = tensorboard_scalars(base["tmp"] / "reference")
    for tag in ("loss", "lr", "grad_norm"):  # float32 in the event file
        np.testing.assert_allclose(
            [scalars[tag][s] for s in range(1, 11)], [reference[s][tag] for s in range(1, 11)], rtol=1e-6
        )
    assert scalars["eval_loss"][10] == pytest.approx(reference[10]["eval_loss"], rel=1e-6)


def test_samples_at_their_steps(base, reference):
    """train.sample_every=5: a continuation of the validation data's first tokens at steps 5 and 10.

    Refused where rank 0 does not hold the whole model.
    """
    lines = [line for line in (base["tmp"] / "reference.out").read_text().splitlines() if line.startswith("sample")]
    assert [line.split(":")[0] for line in lines] == ["sample at step 5", "sample at step 10"], lines
    assert lines[0] != lines[1]  # the model changed in between
    line = _one_error_line(run(["--backend", "fsdp", *base["args"], "train.sample_every=5"], expect_rc="nonzero"))
    assert "train.sample_every needs the whole model on rank 0" in line


def test_torchpar_never_imports_jax(base, tmp_path):
    """torchpar reads only jaxpar's shared core: a whole training run (data, eval, checkpoint) imports no jax."""
    cmd = [sys.executable, "-c", _NO_JAX, "--backend", "none", *base["args"], f"run.dir={tmp_path}", "train.steps=3"]
    r = run_in_session(cmd, torch_env(), 120, "torchpar run without jax")
    assert r.returncode == 0 and "jax-side modules imported: []" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    assert sorted(metrics(tmp_path)) == [1, 2, 3] and os.path.isdir(tmp_path / "checkpoints" / "3")


@pytest.mark.parametrize("backend,extra", BACKENDS, ids=[b + "".join(f",{e}" for e in x) for b, x in BACKENDS])
def test_two_processes_match_one(backend, extra, base, reference):
    run_dir = base["tmp"] / f"{backend}{''.join(extra)}"
    out = run(["--backend", backend, *base["args"], *extra, f"run.dir={run_dir}"], nproc=2)
    assert_same_run(metrics(run_dir), reference)
    assert out.stdout.count("step 10/10") == 1  # progress printed by rank 0 only


def test_srun_style_launch_matches_one_process(base, reference, tmp_path):
    """Two processes launched the way srun does reproduce the one-process run.

    Two processes started the way srun starts them (SLURM_* variables, no torchrun) form one ddp world of 2 and
    reproduce the one-process run; DeepSpeed's launcher flag --local_rank is accepted.
    """
    run_dir, port = tmp_path / "slurm", free_port()
    cmd = [sys.executable, "-m", "torchpar.train", "--backend", "ddp", *base["args"], f"run.dir={run_dir}"]
    procs = [
        subprocess.Popen(
            cmd + [f"--local_rank={r}"],
            cwd=ROOT,
            text=True,
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=torch_env(
                SLURM_NTASKS="2",
                SLURM_PROCID=str(r),
                SLURM_LOCALID=str(r),
                SLURM_JOB_NODELIST="localhost",
                MASTER_PORT=str(port),
            ),
        )
        for r in range(2)
    ]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    assert "backend ddp on 2 cpu processes" in outs[0][0]
    assert_same_run(metrics(run_dir), reference)


def test_fsdp_resume_after_sigkill_and_on_one_process(base, reference):
    """Killed after step 6 (checkpoint at 4): a 2-rank resume and a 1-process resume both redo 5..10 exactly.

    With 2 microbatches (gradient accumulation) and zero_stage=2 (no resharding after forward), which
    must not change the run either.
    """
    killed = base["tmp"] / "fsdp-killed"
    extra = ["train.microbatches=2", "parallel.zero_stage=2", "checkpoint.every=4"]
    args = ["--backend", "fsdp", *base["args"], *extra, f"run.dir={killed}"]
    run(args, nproc=2, expect_rc="nonzero", TORCHPAR_FAULT_KILL_AFTER_STEP="6")
    assert max(metrics(killed)) == 6
    assert sorted(os.listdir(killed / "checkpoints")) == ["4"]
    one = base["tmp"] / "fsdp-killed-on-1"
    shutil.copytree(killed, one)

    out = run(args, nproc=2)
    assert "resumed from" in out.stderr and "checkpoints/4" in out.stderr
    assert_same_run(metrics(killed), reference)

    out = run(["--backend", "none", *base["args"], "train.microbatches=2", "checkpoint.every=4", f"run.dir={one}"])
    assert "checkpoints/4" in out.stderr
    assert_same_run(metrics(one), reference)


def test_fsdp_on_a_dp_by_fsdp_mesh_matches_one_process(base, reference, tmp_path):
    """parallel.mesh=dp=2,fsdp=2 on 4 processes is HSDP.

    Each rank holds half of the parameters (the startup line), and the run is the one-process run (losses, eval,
    final weights), also across a SIGKILL and a DCP resume.
    """
    final, args = (
        tmp_path / "final.safetensors",
        ["--backend", "fsdp", *base["args"], "parallel.mesh=dp=2,fsdp=2", "checkpoint.every=4", f"run.dir={tmp_path}"],
    )
    run(args, nproc=4, expect_rc="nonzero", TORCHPAR_FAULT_KILL_AFTER_STEP="6")
    out = run([*args, "--write-final", str(final)], nproc=4)
    assert "resumed from" in out.stderr and "checkpoints/4" in out.stderr
    assert_same_run(got := metrics(tmp_path), reference)
    assert got[10]["eval_loss"] == pytest.approx(reference[10]["eval_loss"], rel=1e-5)
    assert_params_close(load_file(final), load_file(base["tmp"] / "reference.safetensors"))
    total, low, high = re.search(r"([\d,]+) params, ([\d,]+)(?:-([\d,]+))? per rank", out.stdout).groups()
    total, low, high = (int(x.replace(",", "")) if x else None for x in (total, low, high or low))
    # the two ranks of a shard group hold complementary halves (a dim-0 of 3 splits 2 + 1)
    assert low + high == total and abs(low - total / 2) < 0.01 * total, out.stdout[:300]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_two_stages_match_one_process(schedule, base, reference):
    """torch.distributed.pipelining, one stage (one layer) per rank: same losses and final weights."""
    run_dir, final = base["tmp"] / f"pipeline-{schedule}", str(base["tmp"] / f"pipeline-{schedule}.safetensors")
    run(
        [
            "--backend",
            "pipeline",
            *base["args"],
            f"parallel.pipeline_schedule={schedule}",
            f"run.dir={run_dir}",
            "--write-final",
            final,
        ],
        nproc=2,
    )
    assert_same_run(metrics(run_dir), reference)
    assert_params_close(load_file(final), load_file(base["tmp"] / "reference.safetensors"))


@pytest.fixture(scope="module")
def four_layers(base):
    """A 4-layer one-process run (2 ranks x 2 virtual stages need 4 layers): args and metrics."""
    args = [a for a in base["args"] if not a.startswith("model.init_from")] + ["model.n_layer=4"]
    run_dir = base["tmp"] / "four-layers"
    run(["--backend", "none", *args, f"run.dir={run_dir}"])
    return args, metrics(run_dir)


@pytest.mark.parametrize("schedule,virtual", [("interleaved", 2), ("zb_h1", 1), ("zb_v", 1), ("dualpipev", 1)])
def test_pipeline_multi_stage_schedules_match_one_process(schedule, virtual, four_layers, tmp_path):
    """torch's multi-stage pipeline schedules reproduce the one-process run.

    torch's ScheduleInterleaved1F1B (virtual stages from parallel.pipeline_virtual_stages, jaxpar's layer split),
    ScheduleInterleavedZeroBubble (zb_h1) and ScheduleZBVZeroBubble (zb_v: rank 0 holds layers 0 and 3, rank 1 layers 1
    and 2) reproduce the one-process run.
    """
    args, ref = four_layers
    run(
        [
            "--backend",
            "pipeline",
            *args,
            f"parallel.pipeline_schedule={schedule}",
            f"parallel.pipeline_virtual_stages={virtual}",
            f"run.dir={tmp_path}",
        ],
        nproc=2,
    )
    got = metrics(tmp_path)
    assert_same_run(got, ref)
    evals = [s for s in ref if "eval_loss" in ref[s]]  # zb_v evaluates through a training pass (pipeline.py)
    assert evals and all(got[s]["eval_loss"] == pytest.approx(ref[s]["eval_loss"], rel=1e-5) for s in evals)


def test_pipeline_composes_with_data_parallelism(base, reference, tmp_path):
    """parallel.mesh=pp=2,dp=2 on 4 processes.

    Two pipeline replicas on a 2-D DeviceMesh, each reading its half of every batch (DDP per stage over dp): the
    one-process run, also across a SIGKILL and resume.
    """
    args = [
        "--backend",
        "pipeline",
        *base["args"],
        "parallel.mesh=pp=2,dp=2",
        "parallel.pipeline_schedule=1f1b",
        "checkpoint.every=4",
        f"run.dir={tmp_path}",
    ]
    run(args, nproc=4, expect_rc="nonzero", TORCHPAR_FAULT_KILL_AFTER_STEP="6")
    out = run(args, nproc=4)  # DCP: the replicas' identical tensors written once, read by both
    assert "resumed from" in out.stderr and "checkpoints/4" in out.stderr
    assert_same_run(metrics(tmp_path), reference)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pipeline_stages_sharded_by_fsdp(schedule, base, reference, tmp_path):
    """parallel.mesh=pp=2,fsdp=2 on 4 processes.

    FSDP2 inside each pipeline stage (torchtitan's layout) gives the one-process run, also across a SIGKILL and
    resume (DCP of the sharded stages), each rank holding half of its stage's parameters.
    """
    args = [
        "--backend",
        "pipeline",
        *base["args"],
        "parallel.mesh=pp=2,fsdp=2",
        f"parallel.pipeline_schedule={schedule}",
        "checkpoint.every=4",
        f"run.dir={tmp_path}",
    ]
    run(args, nproc=4, expect_rc="nonzero", TORCHPAR_FAULT_KILL_AFTER_STEP="6")
    out = run(args, nproc=4)
    assert "resumed from" in out.stderr and "checkpoints/4" in out.stderr
    assert_same_run(metrics(tmp_path), reference)
    low, high = re.search(r"[\d,]+ params, ([\d,]+)(?:-([\d,]+))? per rank", out.stdout).groups()
    low, high = (int(x.replace(",", "")) for x in (low, high or low))
    sizes = {n: p.numel() for n, p in build_model(load_config(None, base["args"])).named_parameters()}
    stages = [
        sum(v for n, v in sizes.items() if n.startswith(("wte", "wpe", "blocks.0."))),  # the tied wte on both
        sum(v for n, v in sizes.items() if n.startswith(("wte", "ln_f", "blocks.1."))),
    ]
    assert 0.45 * min(stages) <= low <= high <= 0.55 * max(stages), (low, high, stages)


def test_pipeline_resume_after_sigkill(base, reference):
    """1F1B with gradient accumulation (2 x 2 microbatches), killed after step 6, resumed from step 4."""
    run_dir = base["tmp"] / "pipeline-killed"
    args = [
        "--backend",
        "pipeline",
        *base["args"],
        "parallel.pipeline_schedule=1f1b",
        "train.microbatches=2",
        "parallel.pipeline_microbatches=2",
        "checkpoint.every=4",
        f"run.dir={run_dir}",
    ]
    run(args, nproc=2, expect_rc="nonzero", TORCHPAR_FAULT_KILL_AFTER_STEP="6")
    assert max(metrics(run_dir)) == 6
    out = run(args, nproc=2)
    assert "resumed from" in out.stderr and "checkpoints/4" in out.stderr
    assert_same_run(metrics(run_dir), reference)


def _worker_of_rank(parent: int, rank: int) -> int:
    """pid of torchrun's worker with RANK=rank (Linux /proc)."""
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if ppid == parent and env.get(b"RANK") == str(rank).encode():
            return int(d)
    raise AssertionError(f"no worker with RANK={rank} under pid {parent}")


@pytest.mark.parametrize(
    "backend,ranks",
    [("ddp", [1]), ("fsdp", [0, 1]), ("ddp", [0, 1]), ("fsdp", [1])],
    ids=["ddp-rank1", "fsdp-both", "ddp-both", "fsdp-rank1"],
)
def test_sigterm_stops_all_ranks_after_one_step_and_resume_is_exact(backend, ranks, base, reference):
    """SIGTERM stops all ranks after the same step, and the resume is exact.

    SIGTERM to rank 1 only, or to rank 0 and 0.35 s later rank 1 (a scheduler's preemption; steps slowed to 0.1 s so
    that both land mid-run): all ranks stop after the same step, save that one checkpoint and exit 0 within 60 s;
    resuming continues the uninterrupted run.
    """
    # one per case: a finished run would resume as complete
    run_dir = base["tmp"] / f"sigterm-{backend}-{'-'.join(map(str, ranks))}"
    args = ["--backend", backend, *base["args"], f"run.dir={run_dir}"]
    proc = subprocess.Popen(
        torch_command(args, 2),
        cwd=ROOT,
        env=torch_env(TORCHPAR_FAULT_SLOW_STEP_S="0.1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        line = proc.stdout.readline()
        while line and not line.startswith("step"):
            line = proc.stdout.readline()
        for i, rank in enumerate(ranks):
            time.sleep(0.35 * i)
            os.kill(_worker_of_rank(proc.pid, rank), signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    no_leftovers(proc.pid)
    assert proc.returncode == 0 and "stopped by signal" in err, err[-3000:]
    assert not any(a in out + err for a in ABORTS)
    saved = complete_steps(str(run_dir / "checkpoints"))
    assert len(saved) == 1 and saved[0] < 10 and max(metrics(run_dir)) == saved[0], saved
    run(args, nproc=2)
    assert_same_run(metrics(run_dir), reference)


def test_killed_peer_is_named_within_the_timeout(base, tmp_path):
    """Two processes started as srun starts them (no torchrun to tear the job down): rank 1 is killed after step 3.

    Rank 0 leaves with one line naming it and the last checkpoint (step 2) within run.peer_timeout_s, and that
    checkpoint restores on one process.
    """
    run_dir, port = tmp_path / "run", free_port()
    args = ["--backend", "ddp", *base["args"], "checkpoint.every=2", "run.peer_timeout_s=10", f"run.dir={run_dir}"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "torchpar.train", *args],
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            env=torch_env(
                SLURM_NTASKS="2",
                SLURM_PROCID=str(r),
                SLURM_LOCALID=str(r),
                SLURM_JOB_NODELIST="localhost",
                MASTER_PORT=str(port),
                **({"TORCHPAR_FAULT_KILL_AFTER_STEP": "3"} if r else {}),
            ),
        )
        for r in range(2)
    ]
    try:
        procs[1].wait(timeout=120)
        t0 = time.monotonic()
        err = procs[0].communicate(timeout=60)[1]
        waited = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert procs[1].returncode == -signal.SIGKILL and procs[0].returncode == 3 and waited < 10, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "process 1 of 2 did not answer" in errors[0], err[-3000:]
    assert f"the last checkpoint is step 2 in {run_dir}/checkpoints" in errors[0]
    assert not any(a in err for a in ABORTS)
    out = run(["--backend", "none", *args[2:]])
    assert f"resumed from {run_dir}/checkpoints/2" in out.stderr.replace("'", "")


def _one_error_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_non_finite_step_stops_before_it_is_saved(base, tmp_path):
    """NaN parameters before step 3 on both ddp ranks.

    Every rank stops at step 3 with one line, and the only checkpoint is step 2's.
    """
    run_dir = tmp_path / "run"
    result = run(
        ["--backend", "ddp", *base["args"], "checkpoint.every=2", f"run.dir={run_dir}"],
        nproc=2,
        expect_rc="nonzero",
        TORCHPAR_FAULT_NAN_AT_STEP="3",
    )
    assert "error: step 3: loss nan" in result.stderr and "last checkpoint this run wrote is step 2" in result.stderr
    assert complete_steps(str(run_dir / "checkpoints")) == [2] and max(metrics(run_dir)) == 2


def test_compiled_blocks_train_as_eager(base, reference, tmp_path):
    """train.compile=on (auto's choice on a GPU): the same run as eager, within float32 reassociation."""
    out = run(["--backend", "none", *base["args"], "train.compile=on", f"run.dir={tmp_path}"])
    assert "torch.compile on" in out.stdout
    assert "torch.compile off" in (base["tmp"] / "reference.out").read_text()  # auto on the CPU
    assert_same_run(metrics(tmp_path), reference)


def test_compile_on_with_deepspeed_is_refused(base):
    line = _one_error_line(run(["--backend", "deepspeed", *base["args"], "train.compile=on"], expect_rc="nonzero"))
    assert "train.compile=on" in line and "deepspeed" in line


def test_unknown_backend(base):
    line = _one_error_line(run(["--backend", "horovod", *base["args"]], expect_rc="nonzero"))
    assert "horovod" in line


def test_zero_stage_out_of_range(base):
    line = _one_error_line(run(["--backend", "deepspeed", *base["args"], "parallel.zero_stage=4"], expect_rc="nonzero"))
    assert "parallel.zero_stage" in line


@pytest.mark.parametrize(
    "backend,mesh,message",
    [
        ("ddp", "tp=2", "does not implement tp"),
        ("fsdp", "dp=2,sp=2", "does not implement sp"),
        ("none", "pp=2", "does not implement pp"),
    ],
)
def test_mesh_axes_the_backend_lacks_are_refused(backend, mesh, message, base):
    """parallel.mesh is read, never silently ignored: axes torchpar does not run are one line."""
    assert message in _one_error_line(
        run(["--backend", backend, *base["args"], f"parallel.mesh={mesh}"], expect_rc="nonzero")
    )


@pytest.mark.parametrize(
    "mesh,backend,world,named",
    [
        (
            "pp=2,dp=2",
            "pipeline",
            1,
            "parallel.mesh=pp=2,dp=2 needs 4 processes and 1 runs: start 4 (torchrun --nproc_per_node=4 on one host",
        ),
        ("dp=2", "ddp", 8, "parallel.mesh=dp=2 needs 2 processes and 8 run"),
        ("dp=-1,fsdp=3", "fsdp", 4, "4 devices are not divisible by 3"),
    ],
)
def test_a_mesh_the_processes_do_not_fill_says_how_many_to_start(mesh, backend, world, named):
    """torchpar's devices are its processes: a mesh of another size names the count to launch."""
    from jaxpar.core.errors import UserError
    from jaxpar.core.config.mesh_spec import check_torch_mesh

    with pytest.raises(UserError, match=re.escape(named)):
        check_torch_mesh(mesh, backend, world)


def test_deepspeed_missing(base, tmp_path):
    (tmp_path / "deepspeed.py").write_text("raise ImportError('No module named deepspeed')\n")
    result = run(
        ["--backend", "deepspeed", *base["args"]],
        expect_rc="nonzero",
        PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]),
    )
    assert "deepspeed" in _one_error_line(result)


def test_world_size_not_dividing_batch(base, tmp_path):
    """Checked from torchrun's environment before any process group exists; rank 0 prints the line."""
    args = ["--backend", "ddp", *base["args"], "train.global_batch_size=3", f"run.dir={tmp_path / 'run'}"]
    line = _one_error_line(run(args, expect_rc="nonzero", RANK="0", WORLD_SIZE="2", LOCAL_RANK="0"))
    assert "world size 2" in line
    assert not os.path.exists(tmp_path / "run")  # nothing half-written


@pytest.mark.parametrize(
    "extra,world,message",
    [
        (["parallel.pipeline_schedule=interleaved"], "2", "pipeline_virtual_stages >= 2"),
        ([], "4", "model.n_layer=2 is not divisible by stages"),
        (
            ["parallel.pipeline_schedule=1f1b", "parallel.pipeline_microbatches=1"],
            "2",
            "1f1b needs microbatches >= stages",
        ),
    ],
)
def test_bad_pipeline_layouts(extra, world, message, base, tmp_path):
    args = ["--backend", "pipeline", *base["args"], *extra, f"run.dir={tmp_path / 'run'}"]
    line = _one_error_line(run(args, expect_rc="nonzero", RANK="0", WORLD_SIZE=world, LOCAL_RANK="0"))
    assert message in line
    assert not os.path.exists(tmp_path / "run")
