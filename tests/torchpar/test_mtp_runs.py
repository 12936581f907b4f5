"""Multi-token prediction (model.mtp_depth) in whole runs.

torchpar (one process and ddp) and jaxpar start from one weights file that torchpar wrote (the prediction modules'
parameters in it), train alike, and both write each depth's loss to metrics.jsonl as mtp_loss_1, mtp_loss_2; a jaxpar
run's whole state converted to torchpar goes on as jaxpar does.
"""

import sys

import numpy as np
import pytest

from tests.helpers import TINY, make_dataset, metrics, run_in_session, torch_env
from tests.torchpar.runs import run

MTP = ["model.mtp_depth=2", "model.mtp_loss_weight=0.3", "train.steps=4", "checkpoint.every=0"]
KEYS = ("loss", "mtp_loss_1", "mtp_loss_2")


@pytest.mark.slow
def test_both_frameworks_train_alike_from_one_weights_file_and_log_each_depth(tmp_path):
    args = TINY + [f"data.dataset={make_dataset(tmp_path / 'tokens.bin')}", *MTP]
    init = str(tmp_path / "init.safetensors")
    run(["--backend", "none", "--write-init", init, *args])
    args.append(f"model.init_from={init}")
    runs = {}
    for name, nproc in (("none", 0), ("ddp", 2)):
        run(["--backend", name, *args, f"run.dir={tmp_path / name}"], nproc=nproc)
        runs[name] = metrics(tmp_path / name)
    command = [sys.executable, "-m", "jaxpar.train", *args, f"run.dir={tmp_path / 'jaxpar'}"]
    out = run_in_session(command, torch_env(JAXPAR_CPU_DEVICES="1"), 180, "jaxpar's run")
    assert out.returncode == 0, out.stderr[-3000:]
    runs["jaxpar"] = metrics(tmp_path / "jaxpar")
    ref = runs["jaxpar"]
    for name, got in runs.items():
        for key in KEYS:
            np.testing.assert_allclose(
                [got[s][key] for s in range(1, 5)],
                [ref[s][key] for s in range(1, 5)],
                rtol=1e-5,
                err_msg=f"{name} {key}",
            )
    assert 0 < ref[1]["mtp_loss_2"] < ref[1]["mtp_loss_1"] < ref[1]["loss"]
    # the whole training state (the modules' parameters and Adam's moments) moves to torchpar, which goes on as jaxpar
    moved = tmp_path / "moved"
    out = run_in_session(
        [
            sys.executable,
            "-m",
            "jaxpar.tools.convert",
            "--from",
            "jaxpar",
            str(tmp_path / "jaxpar"),
            "--to",
            "torchpar",
            str(moved),
        ],
        torch_env(JAXPAR_CPU_DEVICES="1"),
        180,
        "convert",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    run(["--backend", "none", *args, "train.steps=6", f"run.dir={moved}"])
    out = run_in_session([*command, "train.steps=6"], torch_env(JAXPAR_CPU_DEVICES="1"), 180, "jaxpar's resume")
    assert out.returncode == 0, out.stderr[-3000:]
    got, ref = metrics(moved), metrics(tmp_path / "jaxpar")
    for key in KEYS:
        np.testing.assert_allclose(
            [got[s][key] for s in (5, 6)], [ref[s][key] for s in (5, 6)], rtol=1e-5, err_msg=f"moved {key}"
        )
