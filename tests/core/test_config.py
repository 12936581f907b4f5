"""The config schema (jaxpar/core/config/schema.py).

Defaults <- YAML <- key=value, typed and validated, with one line naming the key for anything it refuses; a run's
config.json reads back to the same config.
"""

import json

import pytest

from jaxpar.core.config.schema import Config, config_from_dict, load_config, main
from jaxpar.core.errors import UserError


def test_overrides_win_over_the_file_and_the_file_over_the_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  n_layer: 3\n  d_model: 96\ntrain:\n  steps: 7\n")
    cfg = load_config(str(path), ["model.n_layer=5", "optim.lr=0.002"])
    assert cfg.model.n_layer == 5  # override over the file
    assert cfg.model.d_model == 96 and cfg.train.steps == 7  # the file over the defaults
    assert cfg.optim.lr == 0.002 and cfg.model.n_head == Config().model.n_head  # untouched keys keep defaults


def test_a_bare_on_or_off_in_yaml_is_the_choice_not_a_boolean(tmp_path):
    path = tmp_path / "c.yaml"  # YAML 1.1 reads on/off as true/false
    path.write_text("train:\n  compile: off\n  scan_layers: on\n")
    cfg = load_config(str(path), [])
    assert (cfg.train.compile, cfg.train.scan_layers) == ("off", "on")


def test_override_strings_take_the_fields_types():
    cfg = load_config(
        None,
        [
            "train.steps=12",
            "optim.lr=1e-3",
            "checkpoint.resume=false",
            "model.segment_lengths=4,8",
            "model.dilation_rates=1,2",
            "data.seq_len=32",
        ],
    )
    assert cfg.train.steps == 12 and isinstance(cfg.train.steps, int)
    assert cfg.optim.lr == 1e-3 and cfg.checkpoint.resume is False
    assert cfg.model.segment_lengths == "4,8" and cfg.model.dilation_pairs == ((4, 1), (8, 2))


@pytest.mark.parametrize(
    "override, named",
    [
        ("model.n_layers=2", "model.n_layers"),  # a typo: the key and the section's real keys
        ("modle.n_layer=2", "modle"),
        ("train.steps=many", "train.steps"),
        ("train.steps=-1", "train.steps"),
        ("parallel.zero_stage=4", "parallel.zero_stage"),
        ("optim.lr=nan", "optim.lr"),
        ("model.dropout=0.1", "model.dropout"),  # removed, with why
        ("train.steps", "train.steps"),  # not key=value
    ],
)
def test_a_bad_key_or_value_is_one_line_naming_it(override, named):
    with pytest.raises(UserError) as e:
        load_config(None, [override])
    assert named in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "override, suggested",
    [
        ("optim.lrr=1", "optim.lr"),  # a typo in the key
        ("train.stepz=3", "train.steps"),
        ("optm.lr=1", "optim.lr"),  # a typo in the section
        ("train.lr=1", "optim.lr"),  # the right key in the wrong section
        ("optim.warmup=3", "optim.warmup_steps"),
        ("optm.nothing_like_it=1", "optim"),  # no key is close: the section is
    ],
)
def test_an_unknown_key_suggests_the_closest_known_one(override, suggested, tmp_path):
    """A misspelt key, in an override or in the YAML file, is answered with the closest known key in one line."""
    with pytest.raises(UserError, match=f"; did you mean {suggested}\\?") as e:
        load_config(None, [override])
    assert "\n" not in str(e.value)
    section, key = override.split("=")[0].split(".")
    path = tmp_path / "c.yaml"
    path.write_text(f"{section}:\n  {key}: 1\n")
    with pytest.raises(UserError, match=f"; did you mean {suggested}\\?"):
        load_config(str(path))


def test_an_unknown_key_with_nothing_close_lists_its_section():
    with pytest.raises(UserError, match="optim has: name, lr, min_lr") as e:
        load_config(None, ["optim.xyz=1"])
    assert "did you mean" not in str(e.value)


def test_keys_that_disagree_are_refused_together():
    with pytest.raises(UserError, match="data.seq_len=256 exceeds model.max_seq_len=128"):
        load_config(None, ["data.seq_len=256", "model.max_seq_len=128"])
    with pytest.raises(UserError, match="optim.min_lr"):
        load_config(None, ["optim.lr=1e-4", "optim.min_lr=1e-3"])


def test_a_resolved_config_reads_back_unchanged(capsys):
    cfg = load_config("configs/gpt2-tiny.yaml", ["model.family=llama", "model.n_kv_head=2", "train.seed=3"])
    assert config_from_dict(json.loads(cfg.to_json())).to_dict() == cfg.to_dict()
    assert main(["configs/gpt2-tiny.yaml", "train.seed=3"]) == 0  # python -m jaxpar.core.config.schema prints it
    printed = json.loads(capsys.readouterr().out)
    assert printed["train"]["seed"] == 3 and printed["model"]["n_layer"] == 4


def test_a_run_config_from_before_optim_fused_took_choices_reads_as_it_meant(tmp_path):
    """optim.fused was a bool: a saved false (the old default) reads as today's auto, true as on; YAML's off stays off.

    So an old run's config.json continues under jaxpar, which refuses optim.fused set away from its default.
    """
    from jaxpar.core.config.contract import Run, check_contract

    saved = json.loads(load_config("configs/gpt2-tiny.yaml").to_json())
    for old, now in ((False, "auto"), (True, "on")):
        saved["optim"]["fused"] = old
        (tmp_path / "config.json").write_text(json.dumps(saved))
        assert load_config(str(tmp_path / "config.json")).optim.fused == now
        assert config_from_dict(saved).optim.fused == now
    (tmp_path / "c.yaml").write_text("optim:\n  fused: off\n")
    assert load_config(str(tmp_path / "c.yaml")).optim.fused == "off"
    saved["optim"]["fused"] = False
    (tmp_path / "config.json").write_text(json.dumps(saved))
    check_contract(Run(load_config(str(tmp_path / "config.json")), "jaxpar"))  # not refused: the default
