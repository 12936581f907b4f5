"""The sbatch writer: each framework and launcher gives a script that bash parses, with its launch line;
impossible requests are one line."""
import subprocess

import pytest

from jaxpar.tools.launch import main

from tests.helpers import ROOT

CLUSTER = ["--nodes", "2", "--gpus-per-node", "4", "--time", "01:00:00", "--partition", "gpu",
           "--config", "configs/gpt2-tiny.yaml"]


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    monkeypatch.chdir(ROOT)  # the config path as a user in the checkout writes it


@pytest.mark.parametrize("extra,tasks,line", [
    ([], 4, "srun --kill-on-bad-exit=1 python -m jaxpar.train --config configs/gpt2-tiny.yaml --mesh dp=8 train.steps=5"),
    (["--framework", "torchpar", "--backend", "fsdp"], 4,
     "srun --kill-on-bad-exit=1 python -m torchpar.train --backend fsdp --config configs/gpt2-tiny.yaml --mesh dp=8"),
    (["--framework", "torchpar", "--backend", "ddp", "--launcher", "torchrun"], 1,
     "torchrun --nnodes=$SLURM_JOB_NUM_NODES --nproc_per_node=4 --rdzv_backend=c10d"),
    (["--framework", "torchpar", "--backend", "deepspeed", "--launcher", "deepspeed"], 1,
     'deepspeed --hostfile "hostfile.$SLURM_JOB_ID" --master_addr "$HEAD" --master_port 29500 --module torchpar.train'),
], ids=["jaxpar-srun", "torchpar-srun", "torchpar-torchrun", "torchpar-deepspeed"])
def test_script_parses_and_launches_each_framework(extra, tasks, line, capsys, tmp_path):
    mesh = [] if "--launcher" in extra else ["--mesh", "dp=8"]
    assert main(CLUSTER + extra + mesh + (["train.steps=5"] if not extra else [])) == 0
    text = capsys.readouterr().out
    (tmp_path / "job.sbatch").write_text(text)
    parsed = subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")], capture_output=True, text=True)
    assert parsed.returncode == 0, parsed.stderr
    assert text.startswith("#!/bin/bash\n") and line in text
    assert f"#SBATCH --ntasks-per-node={tasks}\n" in text and "#SBATCH --nodes=2\n" in text
    assert "#SBATCH --signal=TERM@120" in text  # preemption warning -> agreed stop and checkpoint


@pytest.mark.parametrize("extra,message", [
    (["--mesh", "dp=3"], "mesh dp=3 has 3 devices but 8 are available"),
    (["--framework", "torchpar"], "needs --backend"),
    (["--launcher", "torchrun"], "--launcher torchrun is not one for jaxpar"),
    (["--framework", "torchpar", "--backend", "ddp", "--launcher", "deepspeed"], "runs --backend deepspeed"),
    (["train.stepz=3"], "unknown config key 'train.stepz'"),
])
def test_impossible_requests_are_one_line(extra, message, capsys):
    assert main(CLUSTER + extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
