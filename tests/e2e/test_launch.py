"""The sbatch writer: each framework and launcher gives a script that bash parses, with its launch line.

The torchpar scripts, run under stand-ins for srun and scontrol on one machine, train on 2 processes; impossible
requests are one line.
"""

import contextlib
import json
import os
import random
import re
import shlex
import socket
import subprocess
import sys

import pytest

from jaxpar.tools.launch import main

from tests.helpers import ROOT, TINY, metrics, run_in_session, torch_env

CLUSTER = [
    "--nodes",
    "2",
    "--gpus-per-node",
    "4",
    "--time",
    "01:00:00",
    "--partition",
    "gpu",
    "--config",
    "configs/gpt2-tiny.yaml",
]


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    monkeypatch.chdir(ROOT)  # the config path as a user in the checkout writes it


@pytest.mark.parametrize(
    "extra,tasks,line",
    [
        (
            [],
            4,
            "srun --kill-on-bad-exit=1 python -m jaxpar.train --config configs/gpt2-tiny.yaml "
            "--mesh dp=8 train.steps=5",
        ),
        (
            ["--framework", "torchpar", "--backend", "fsdp"],
            4,
            "srun --kill-on-bad-exit=1 python -m torchpar.train --backend fsdp --config configs/gpt2-tiny.yaml "
            "parallel.mesh=dp=8\n",
        ),  # torchpar.train has no --mesh flag
        (
            ["--framework", "torchpar", "--backend", "ddp", "--launcher", "torchrun"],
            1,
            "torchrun --nnodes=$SLURM_JOB_NUM_NODES --nproc_per_node=4 --rdzv_backend=c10d",
        ),
        (
            ["--framework", "torchpar", "--backend", "deepspeed", "--launcher", "deepspeed"],
            1,
            'deepspeed --hostfile "hostfile.$SLURM_JOB_ID" --master_addr "$HEAD" --master_port "$PORT" '
            "--module torchpar.train",
        ),
        (
            ["--elastic", "1", "--mesh", "dp=-1,tp=2"],
            1,
            "srun --ntasks-per-node=1 --no-kill torchrun --nnodes=1:2 --nproc_per_node=4 --max-restarts=3 "
            "--rdzv_backend=c10d",
        ),
        (
            ["--framework", "torchpar", "--backend", "fsdp", "--elastic", "2:2"],
            1,
            "torchrun --nnodes=2:2 --nproc_per_node=4",
        ),
    ],
    ids=[
        "jaxpar-srun",
        "torchpar-srun",
        "torchpar-torchrun",
        "torchpar-deepspeed",
        "jaxpar-elastic",
        "torchpar-elastic",
    ],
)
def test_script_parses_and_launches_each_framework(extra, tasks, line, capsys, tmp_path):
    mesh = [] if "--launcher" in extra or "--elastic" in extra else ["--mesh", "dp=8"]
    assert main(CLUSTER + extra + mesh + (["train.steps=5"] if not extra else [])) == 0
    text = capsys.readouterr().out
    (tmp_path / "job.sbatch").write_text(text)
    parsed = subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")], capture_output=True, text=True)
    assert parsed.returncode == 0, parsed.stderr
    assert text.startswith("#!/bin/bash\n") and line in text
    assert f"#SBATCH --ntasks-per-node={tasks}\n" in text and "#SBATCH --nodes=2\n" in text
    assert "#SBATCH --signal=TERM@120" in text  # preemption warning -> agreed stop and checkpoint
    elastic = "--elastic" in extra  # a lost node must not end the job, and a node must be able to join again
    assert ("#SBATCH --no-kill" in text, "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in text) == (elastic, elastic)
    assert not (elastic and "--kill-on-bad-exit" in text)


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--mesh", "dp=3"], "mesh dp=3 has 3 devices but 8 are available"),
        (["--framework", "torchpar"], "needs --backend"),
        (["--launcher", "deepspeed"], "--launcher deepspeed is not one for jaxpar"),
        (["--framework", "torchpar", "--backend", "ddp", "--launcher", "deepspeed"], "runs --backend deepspeed"),
        (["train.stepz=3"], "unknown config key 'train.stepz'"),
        (
            ["--framework", "torchpar", "--backend", "fsdp", "--mesh", "dp=4,tp=2"],
            "--backend fsdp does not implement tp",
        ),
        (["--framework", "torchpar", "--backend", "zero"], "unknown backend 'zero'"),
        (["--elastic", "1", "--mesh", "dp=2,tp=4"], "--elastic needs a mesh axis that follows the devices"),
        (["--elastic", "1:3"], "needs 1 <= MIN <= MAX <= --nodes (2)"),
        (["--elastic", "x"], "expected MIN or MIN:MAX nodes"),
        (["--elastic", "1", "--launcher", "srun"], "--elastic runs under torchrun's agent"),
        (["--max-restarts", "5"], "--max-restarts is --elastic's"),
        (
            ["--elastic", "1", "--mesh", "dp=-1", "train.global_batch_size=12"],  # 12 rows: 4 data ways fit, 8 do not
            "--elastic 1, on 2 node(s): batch per microbatch 12 (train.global_batch_size=12 / "
            "train.microbatches=1) is not "
            "divisible by the data axes dp*fsdp*ep=8",
        ),
        (
            ["--elastic", "2:4", "--nodes", "4", "--mesh", "dp=-1,fsdp=8"],  # 2 and 4 nodes of 4 GPUs fit; 3 do not
            "--elastic 2:4, on 3 node(s): mesh dp=-1,fsdp=8: 12 devices are not divisible by 8",
        ),
        (
            ["--elastic", "1", "--gpus-per-node", "2", "--mesh", "dp=-1,tp=4"],
            "--elastic 1, on 1 node(s): mesh dp=-1,tp=4: 2 devices are not divisible by 4",
        ),
    ],
)
def test_impossible_requests_are_one_line(extra, message, capsys):
    assert main(CLUSTER + extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


TORCHFT = ["--framework", "torchpar", "--backend", "ddp", "--torchft", "--mesh", "diloco=2,dp=4", "checkpoint.every=0"]


def test_torchft_script_runs_the_lighthouse_and_each_group_relaunched(capsys, tmp_path):
    """--torchft: the lighthouse on the first node, each diloco group on its node with its own rendezvous and run.dir.

    Each group's launch is retried --max-restarts times (a group that fails comes back and heals); the job is not
    requeued (torchft's groups do not resume from a checkpoint yet).
    """
    assert main(CLUSTER + TORCHFT + ["--max-restarts", "2"]) == 0
    text = capsys.readouterr().out
    (tmp_path / "job.sbatch").write_text(text)
    parsed = subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")], capture_output=True, text=True)
    assert parsed.returncode == 0, parsed.stderr
    assert 'torchft_lighthouse --min_replicas 1 --bind "[::]:$((PORT + 1))" &' in text
    assert "for attempt in $(seq 0 2); do" in text and "#SBATCH --requeue" not in text
    assert "--nnodes=1 --nproc_per_node=4 --rdzv_backend=c10d --rdzv_id=$SLURM_JOB_ID-$1" in text
    assert (
        "parallel.mesh=diloco=2,dp=4 parallel.torchft_lighthouse=$HEAD:$((PORT + 1)) parallel.torchft_group=$1" in text
    )
    assert "run.dir=runs/torchpar/gpt2-tiny/group$1 && return 0" in text
    assert 'for g in $(seq 0 1); do group "$g" & pids+=($!); done' in text


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--mesh", "diloco=2,dp=8"], "needs 16 processes and 8 run"),  # 2 x 8 ranks on 8 GPUs: checked as any mesh
        (["--mesh", "dp=8"], "--torchft needs diloco=G"),
        (["--nodes", "3", "--mesh", "diloco=2,dp=6"], "G dividing --nodes (3)"),
        (["checkpoint.every=5"], "checkpoint.every=5"),
        (["--launcher", "srun"], "--torchft launches torchpar's --backend ddp under torchrun"),
    ],
)
def test_impossible_torchft_requests_are_one_line(extra, message, capsys):
    assert main(CLUSTER + TORCHFT + extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


# Stand-ins for SLURM's commands on one machine (every node of the job is this one). srun starts the step's tasks (the
# job's task count, --ntasks of them, or --ntasks-per-node on each of its --nodes) with the variables srun gives each
# task, passes a TERM on to them, and fails if any task fails.
FAKE_SRUN = """#!/bin/bash
ntasks=$SLURM_NTASKS nodes=$SLURM_JOB_NUM_NODES per_node=
while [[ $1 == --* ]]; do
  case $1 in --ntasks=*) ntasks=${1#*=} ;; --nodes=*) nodes=${1#*=} ;; --ntasks-per-node=*) per_node=${1#*=} ;; esac
  shift
done
[[ -n $per_node ]] && ntasks=$((per_node * nodes))
export SLURM_NTASKS=$ntasks SLURM_STEP_NUM_TASKS=$ntasks SLURM_STEP_NODELIST=$SLURM_JOB_NODELIST SLURM_NODEID=0
pids=()
trap 'kill "${pids[@]}" 2>/dev/null' TERM  # srun passes a TERM on to its tasks
for ((i = 0; i < ntasks; i++)); do SLURM_PROCID=$i SLURM_LOCALID=$i "$@" & pids+=($!); done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""
FAKE_SCONTROL = '#!/bin/bash\n[[ "$1 $2" == "show hostnames" ]] && echo "$3" | tr , "\\n"\n'  # a node a line
# DeepSpeed's launcher checks that it can ssh to the hostfile's first host, then (one host) starts locally
FAKE_SSH = '#!/bin/bash\nwhile [[ $1 == -* ]]; do [[ $1 == -o ]] && shift; shift; done\nshift\nexec bash -c "$*"\n'


def job_id_with_free_port(base: int, span: int, ports: int = 1) -> int:
    """A SLURM job id whose rendezvous port, base + id mod span, and the `ports - 1` after it are free now."""
    for job_id in random.sample(range(span - ports + 1), span - ports + 1):
        with contextlib.ExitStack() as held:
            try:
                for port in range(base + job_id, base + job_id + ports):
                    held.enter_context(socket.socket()).bind(("", port))
                return job_id
            except OSError:
                continue
    pytest.fail(f"no {ports} free ports in a row in {base}..{base + span - 1}")


def slurm_job_env(text: str, bin_dir, port_base: int, port_span: int, ports: int = 1) -> dict:
    """What sbatch gives the script, every node of the job being this machine.

    The job's variables from its #SBATCH header, a job id whose port (the trainer's formula: base + id mod span) is
    free, and the stand-ins first on PATH.
    """
    nodes, per_node = (int(re.search(rf"#SBATCH --{k}=(\d+)", text).group(1)) for k in ("nodes", "ntasks-per-node"))
    for name, body in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("ssh", FAKE_SSH)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    env = torch_env(
        SLURM_JOB_ID=str(job_id_with_free_port(port_base, port_span, ports)),
        SLURM_JOB_NODELIST=",".join(["localhost"] * nodes),
        SLURM_JOB_NUM_NODES=str(nodes),
        SLURM_NNODES=str(nodes),
        SLURM_NTASKS=str(nodes * per_node),
        SLURM_NTASKS_PER_NODE=str(per_node),
        PATH=os.pathsep.join([str(bin_dir), os.path.dirname(sys.executable), os.environ["PATH"]]),
    )
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


TORCH_PORT, JAX_PORT = (29500, 20000), (61440, 4096)  # torchpar/dist.py; jax's SLURM cluster detection


@pytest.mark.parametrize(
    "launcher,backend,mesh,ports,started",
    [
        (
            ["--framework", "torchpar", "--launcher", "srun"],
            "fsdp",
            "fsdp=2",
            TORCH_PORT,
            "backend fsdp on 2 cpu processes",
        ),
        (
            ["--framework", "torchpar", "--launcher", "torchrun"],
            "fsdp",
            "fsdp=2",
            TORCH_PORT,
            "backend fsdp on 2 cpu processes",
        ),
        (
            ["--framework", "torchpar", "--launcher", "deepspeed"],
            "deepspeed",
            "dp=2",
            TORCH_PORT,
            "backend deepspeed on 2 cpu processes",
        ),
        ([], None, "fsdp=2", JAX_PORT, "mesh fsdp=2 on 2 cpu devices"),
        (["--elastic", "1"], None, "dp=-1", TORCH_PORT, "mesh dp=2 on 2 cpu devices"),  # one device per process
    ],
    ids=["torchpar-srun", "torchpar-torchrun", "torchpar-deepspeed", "jaxpar-srun", "jaxpar-elastic"],
)
def test_script_trains_on_two_processes(launcher, backend, mesh, ports, started, dataset, tmp_path, capsys):
    """The batch script trains one run over two processes and exits 0.

    The whole batch script, run by bash in its submit directory under the SLURM stand-ins as a 2-process job, trains one
    run over both processes with the mesh given to the writer, and exits 0.
    """
    run_dir = tmp_path / "run"
    assert (
        main(
            [
                *launcher,
                *(["--backend", backend] if backend else []),
                "--nodes",
                "1",
                "--gpus-per-node",
                "2",
                "--time",
                "00:10:00",
                "--partition",
                "cpu",
                "--mesh",
                mesh,
                *TINY,
                "train.steps=3",
                f"data.dataset={dataset}",
                f"run.dir={run_dir}",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    (tmp_path / "job.sbatch").write_text(text)
    (tmp_path / "bin").mkdir()
    env = slurm_job_env(text, tmp_path / "bin", *ports)
    submit = f"cd {shlex.quote(str(tmp_path))} && exec bash job.sbatch"  # DeepSpeed's hostfile lands there
    r = run_in_session(["bash", "-c", submit], env, 300, "the batch script")
    assert r.returncode == 0, r.stderr[-3000:]
    assert started in r.stdout, r.stdout[-2000:]
    assert r.stdout.count("step 3/3") == 1, r.stdout[-2000:]  # process 0 of one world, not two worlds of 1
    assert sorted(metrics(run_dir)) == [1, 2, 3]
    with open(run_dir / "config.json") as f:
        saved = json.load(f)
    recorded = "dp=2" if mesh == "dp=-1" else mesh  # jaxpar's elastic axis, resolved on two processes
    assert recorded in (saved["parallel"]["mesh"], saved.get("resolved_mesh"))  # torchpar's key, jaxpar's record


def test_the_torchft_script_trains_each_group_beside_the_lighthouse(dataset, tmp_path, capsys):
    """--torchft's script, run by bash under the stand-ins as a 2-node job, trains both groups to the end and exits 0.

    The lighthouse starts on the first node, each group (one rank) in its own torchrun launch on its node and run
    directory joins it, and both meet every 2 steps to the last.
    """
    run_dir = tmp_path / "run"
    mode = ["--torchft", "--mesh", "diloco=2,dp=1", "checkpoint.every=0", "parallel.diloco_inner_steps=2"]
    cluster = ["--nodes", "2", "--gpus-per-node", "1", "--time", "00:10:00", "--partition", "cpu"]
    settings = [*TINY, "train.steps=4", f"data.dataset={dataset}", f"run.dir={run_dir}"]
    assert main(["--framework", "torchpar", "--backend", "ddp", *cluster, *mode, *settings]) == 0
    text = capsys.readouterr().out
    (tmp_path / "job.sbatch").write_text(text)
    (tmp_path / "bin").mkdir()
    env = slurm_job_env(text, tmp_path / "bin", *TORCH_PORT, ports=4)  # the rendezvous', the lighthouse's, 2 groups'
    r = run_in_session(["bash", "-c", f"cd {shlex.quote(str(tmp_path))} && exec bash job.sbatch"], env, 300, "the job")
    assert r.returncode == 0, r.stderr[-3000:]
    for g in (0, 1):
        assert f"DiLoCo with torchft: group {g} of 2 (1 rank), lighthouse localhost:" in r.stdout + r.stderr
        assert sorted(metrics(run_dir / f"group{g}")) == [1, 2, 3, 4]
