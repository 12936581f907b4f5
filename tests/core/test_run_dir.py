"""A run directory belongs to one framework (jaxpar/core/run/directory.py).

The default directories of the two trainers differ, a run is recognised by its record or, written before it, by what it
holds, and the other framework is refused in one line naming the conversion. Also the closing lines a run prints
(jaxpar/core/run/summary.py).
"""

import json
import os

import pytest
import yaml

from jaxpar.core.errors import UserError
from jaxpar.core.run.directory import check_framework, default_run_dir, framework_of, with_run_dir
from jaxpar.core.run.summary import Outcome, summary_lines
from tests.helpers import ROOT, tiny_config


def test_the_two_trainers_default_to_different_directories():
    cfg = tiny_config()
    assert cfg.run.dir == ""  # the schema names none: the trainer does
    jax_dir = with_run_dir(cfg, "jaxpar", "configs/gpt2-tiny.yaml").run.dir
    torch_dir = with_run_dir(cfg, "torchpar", "configs/gpt2-tiny.yaml").run.dir
    assert (jax_dir, torch_dir) == (
        os.path.join("runs", "jaxpar", "gpt2-tiny"),
        os.path.join("runs", "torchpar", "gpt2-tiny"),
    )
    assert with_run_dir(tiny_config("run.dir=mine"), "torchpar", "configs/gpt2-tiny.yaml").run.dir == "mine"
    assert default_run_dir("jaxpar", None) == os.path.join("runs", "jaxpar", "default")


def test_no_shipped_config_names_a_run_directory():
    """A config naming run.dir would send both trainers' runs of it into one directory."""
    for name in sorted(os.listdir(os.path.join(ROOT, "configs"))):
        if name.endswith(".yaml"):
            with open(os.path.join(ROOT, "configs", name)) as f:
                assert "dir" not in (yaml.safe_load(f).get("run") or {}), name


def plant(run_dir, files: dict) -> str:
    for rel, text in files.items():
        os.makedirs(os.path.dirname(run_dir / rel), exist_ok=True)
        (run_dir / rel).write_text(text)
    return str(run_dir)


@pytest.mark.parametrize(
    "files, framework",
    [
        ({"config.json": json.dumps({"framework": "torchpar"})}, "torchpar"),
        ({"config.json": json.dumps({"framework": "jaxpar"})}, "jaxpar"),
        # written before the record: by what the directory holds
        ({"config.json": json.dumps({"model": {}, "backend": "fsdp", "world_size": 2})}, "torchpar"),
        ({"config.json": json.dumps({"model": {}, "resolved_mesh": "dp=2"})}, "jaxpar"),
        ({"checkpoints/100/.metadata": "", "checkpoints/100/meta.json": "{}"}, "torchpar"),  # DCP
        ({"checkpoints/latest": "100", "checkpoints/100/mp_rank_00_model_states.pt": ""}, "torchpar"),  # DeepSpeed
        ({"checkpoints/100/_CHECKPOINT_METADATA": "{}", "checkpoints/100/state/x": ""}, "jaxpar"),  # orbax
        ({"metrics.jsonl": ""}, None),  # nothing to tell by
    ],
)
def test_a_run_is_recognised(tmp_path, files, framework):
    assert framework_of(plant(tmp_path / "run", files)) == framework


def test_the_other_framework_is_refused_naming_the_conversion(tmp_path):
    run = plant(tmp_path / "runs" / "torchpar" / "a", {"checkpoints/5/.metadata": "", "checkpoints/5/meta.json": ""})
    with pytest.raises(UserError) as e:
        check_framework(run, "jaxpar", "resume")
    line = str(e.value)
    assert "\n" not in line and "holds a torchpar run" in line
    assert (
        f"python -m jaxpar.tools.convert --from torchpar {run} --to jaxpar "
        f"{tmp_path / 'runs' / 'jaxpar' / 'a-from-torchpar'}"
    ) in line
    check_framework(run, "torchpar", "resume")  # its own framework: nothing to say
    check_framework(str(tmp_path / "none"), "jaxpar", "resume")  # no run yet


def outcome(**kw):
    return Outcome(
        **{"first_step": 0, "last_step": 20, "loss": 2.5, "eval_loss": 2.25, "rates": [90.0, 100.0, 200.0], **kw}
    )


def test_the_closing_lines_name_the_run_its_numbers_and_the_next_commands(tmp_path):
    run = tmp_path / "runs" / "jaxpar" / "t"
    os.makedirs(run / "checkpoints" / "10")
    os.makedirs(run / "checkpoints" / "20")
    os.makedirs(run / "checkpoints" / "30.orbax-checkpoint-tmp")  # a save not finished: not a checkpoint kept
    cfg = tiny_config(f"run.dir={run}", "train.steps=20")
    text = "\n".join(summary_lines(cfg, "jaxpar", {"resolved_mesh": "dp=2,tp=4"}, outcome(), 12.3))
    assert f"jaxpar: trained to step 20 of 20 (from step 0) in 12 s; run {run}" in text
    assert "loss 2.5000 | eval loss 2.2500 | 100 tokens/s | checkpoints at steps 10, 20" in text  # median rate
    for command in (
        f'python -m jaxpar.generate --run {run} --prompt "def "',
        f"python -m jaxpar.tools.report {run}",
        f"python -m jaxpar.eval --run {run} --tasks hellaswag,arc_easy --limit 200",
        f"python -m jaxpar.train --config {run}/config.json --mesh dp=2,tp=4 train.steps=40",
        f"--from jaxpar {run} --to torchpar {tmp_path / 'runs' / 'torchpar' / 't-from-jaxpar'}",
        f"--from jaxpar {run} --to hf {tmp_path / 'runs' / 'hf' / 't-from-jaxpar'}",
    ):
        assert command in text, text


def test_a_torchpar_run_continues_under_its_launcher_and_a_stopped_one_with_its_steps(tmp_path):
    cfg = tiny_config(f"run.dir={tmp_path}", "train.steps=50")
    info = {"backend": "fsdp", "world_size": 2, "processes": 2}
    text = "\n".join(summary_lines(cfg, "torchpar", info, outcome(stopped_by="SIGTERM"), 1.0))
    assert "torchpar: stopped by SIGTERM after step 20 of 50" in text and "no checkpoint kept" in text
    assert (
        f"continue  torchrun --nproc_per_node=2 -m torchpar.train --config {tmp_path}/config.json --backend fsdp "
        "train.steps=50"
    ) in text
    assert "generate" not in text  # a stopped run's next step is to go on


def test_a_deepspeed_run_samples_through_a_weights_file_and_a_run_over_nodes_keeps_its_launch(tmp_path, monkeypatch):
    run = tmp_path / "runs" / "torchpar" / "t"
    cfg = tiny_config(f"run.dir={run}", "train.steps=20")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun's processes on this node, of 4
    text = "\n".join(
        summary_lines(cfg, "torchpar", {"backend": "deepspeed", "world_size": 4, "processes": 4}, outcome(), 1.0)
    )
    weights = tmp_path / "runs" / "shared" / "t-from-torchpar.safetensors"
    assert (
        f"python -m jaxpar.tools.convert --from torchpar {run} --to shared {weights} && python -m "
        f'torchpar.generate --weights {weights} --prompt "def "'
    ) in text
    assert f"&& python -m torchpar.eval --weights {weights} --tasks hellaswag,arc_easy --limit 200" in text
    assert f"continue      this run's launch, with --config {run}/config.json train.steps=40" in text
    assert "torchrun" not in text


def test_a_new_run_names_the_run_its_config_made_before_directories_were_per_framework(tmp_path):
    old = tmp_path / "runs" / "gpt2-tiny"
    os.makedirs(old)
    (old / "config.json").write_text(json.dumps({"model": {}, "resolved_mesh": "dp=2"}))  # jaxpar's, by its record
    cfg = tiny_config(f"run.dir={tmp_path / 'runs' / 'jaxpar' / 'gpt2-tiny'}")
    from jaxpar.core.run.summary import start_line

    assert f"{old} holds an earlier jaxpar run of this config: run.dir={old} continues it" in start_line(
        cfg, "jaxpar", 0
    )
    assert "earlier" not in start_line(cfg, "torchpar", 0) and "earlier" not in start_line(cfg, "jaxpar", 5)
