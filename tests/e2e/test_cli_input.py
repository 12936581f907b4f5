"""Small command-line edges, each through the command's own main in-process (no trainer starts).

Input that means nothing is one `error:` line and exit status 2 with nothing written, and a flag one trainer takes means
the same in the other.
"""

import json

import pytest

from jaxpar.core.config.schema import ModelConfig, load_config
from jaxpar.core.errors import UserError
from jaxpar.core.run.resume import already_complete
from tests.helpers import TINY


def assert_one_error_line(rc, capsys, *phrases):
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(errors) == 1 and "Traceback" not in err, err
    for phrase in phrases:
        assert phrase in errors[0], errors[0]


def test_zero_train_steps_is_refused_before_the_run_dir_is_touched(tmp_path, capsys):
    """train.steps=0 trains nothing (untrained weights come from --write-init): refused by the config's ranges."""
    from jaxpar.train import main

    run_dir = tmp_path / "run"
    assert_one_error_line(
        main([*TINY, "train.steps=0", f"run.dir={run_dir}"]), capsys, "train.steps: 0", "must be >= 1"
    )
    assert not run_dir.exists()


@pytest.mark.parametrize("steps, step, more", [(4, 4, 8), (4, 6, 12), (0, 0, 1)])
def test_a_complete_run_suggests_more_steps_than_it_has(steps, step, more, tmp_path, capsys):
    """The suggestion is above the step reached, also at step 0 (a config made without load_config's ranges)."""
    cfg = load_config(None, [f"run.dir={tmp_path}"])
    cfg.train.steps = steps
    assert already_complete(cfg, step, is_main=True)
    assert f"raise train.steps (e.g. train.steps={more})" in capsys.readouterr().err


def _prepare(tmp_path, records: list[dict], *flags: str) -> int:
    from jaxpar.data import main

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in records))
    return main(["prepare", *flags, "--out", str(tmp_path / "out.bin"), str(corpus)])


def test_prepare_refuses_pack_zero(tmp_path, capsys):
    """--pack 0 is no window length (not packing is leaving --pack out): one line, no dataset."""
    assert_one_error_line(_prepare(tmp_path, [{"text": "hello"}], "--pack", "0"), capsys, "--pack 0", "at least 1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl"]


@pytest.mark.parametrize(
    "record, held",
    [
        ({"prompt": "2+2=", "completion": "4"}, "'prompt'/'completion'"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "'messages'"),
    ],
)
def test_prepare_names_the_flag_for_fine_tuning_records(record, held, tmp_path, capsys):
    assert_one_error_line(
        _prepare(tmp_path, [record]), capsys, "no field 'text'", f"but has {held}", "read with --format sft"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl"]
    assert _prepare(tmp_path, [record], "--format", "sft") == 0  # the flag named reads them


def test_prepare_names_the_flag_for_fine_tuning_columns_of_parquet(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from jaxpar.data import main

    pq.write_table(pa.table({"prompt": ["2+2="], "completion": ["4"]}), tmp_path / "c.parquet")
    rc = main(["prepare", "--out", str(tmp_path / "out.bin"), str(tmp_path / "c.parquet")])
    assert_one_error_line(rc, capsys, "no column 'text'", "read with --format sft")


def test_torchpar_mesh_flag_is_parallel_mesh(tmp_path, capsys, monkeypatch):
    """torchpar.train --mesh M is parallel.mesh=M and wins over it, as jaxpar.train's --mesh.

    Honoured (a plain process is told to start two for dp=2), and accepted where the world matches.
    """
    pytest.importorskip("torch")
    from torchpar import train
    from torchpar.checks import validate

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    rc = train.main(["--backend", "ddp", "--mesh", "dp=2", *TINY, f"run.dir={tmp_path / 'run'}"])
    assert_one_error_line(rc, capsys, "parallel.mesh=dp=2 needs 2 processes")
    assert not (tmp_path / "run").exists()
    args = train.parse_args(["--mesh", "dp=2", *TINY, "parallel.mesh=dp=4", f"run.dir={tmp_path / 'run'}"])
    assert train.read_config(args).parallel.mesh == "dp=2"
    assert train.read_config(train.parse_args(TINY)).parallel.mesh == ""  # without the flag, the config's
    monkeypatch.setenv("WORLD_SIZE", "2")
    validate(train.read_config(args), args)  # two processes: nothing to refuse


def test_generate_decodes_by_default_what_the_context_leaves():
    """Without --max-new-tokens, generate decodes what the model's context leaves after the prompt.

    No --max-new-tokens: the model's context after the prompt (a 32-position model after 9 prompt tokens: 23), at most
    200; an explicit count that does not fit, or a prompt that fills the context, is one line.
    """
    from jaxpar.core.sampling_cli import decodable_tokens, sampling_parser

    args = sampling_parser("generate", "", {"run": ""}).parse_args(["--run", "r", "--prompt", "hi"])
    assert args.max_new_tokens is None
    assert decodable_tokens(ModelConfig(max_seq_len=32), 9, None) == 23
    assert decodable_tokens(ModelConfig(max_seq_len=1024), 4, None) == 200
    assert decodable_tokens(ModelConfig(max_seq_len=32), 9, 23) == 23
    with pytest.raises(
        UserError, match="9 tokens.*24 new tokens exceed .* max_seq_len 32: ask for at most --max-new-tokens 23"
    ):
        decodable_tokens(ModelConfig(max_seq_len=32), 9, 24)
    with pytest.raises(UserError, match="the prompt .32 tokens. fills the model's max_seq_len 32"):
        decodable_tokens(ModelConfig(max_seq_len=32), 32, None)
