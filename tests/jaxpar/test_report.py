"""jaxpar.tools.report on run directories.

The curves figure holds the runs' own metrics.jsonl values (read back from the figure's lines), a panel no run has data
for is left out, the default output lies beside the runs, and bad input is one line. Hand-written metrics.jsonl files:
no training.
"""

import json
import os

import pytest

from jaxpar.tools import report


def write_run(path, records, config=None):
    """A run directory holding these metrics.jsonl records (and config.json, when given)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    return path


def records(loss_at, eval_every=0, n=6):
    """Logged steps 2, 4, ...: loss from `loss_at(step)`, lr, grad_norm, tokens/s; eval_loss every `eval_every`."""
    out = []
    for step in range(2, 2 * n + 1, 2):
        r = {
            "step": step,
            "loss": loss_at(step),
            "lr": 1e-3 * step / (2 * n),
            "grad_norm": 1.0 + step / 10,
            "tokens_per_sec": 1000.0 + step,
            "mfu": 0.1,
        }
        if eval_every and step % eval_every == 0:
            r["eval_loss"] = loss_at(step) + 0.5
        out.append(r)
    return out


def panels(data):
    """The figure drawn from `data`, as {panel key: {line label: (x, y)}}."""
    fig = report.curve_figure(data, sorted({name for lines in data.values() for name in lines}))
    return {
        ax.get_label(): {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}
        for ax in fig.axes
    }


def test_the_loss_panel_plots_the_runs_logged_losses(tmp_path):
    recs = records(lambda s: 5.0 - 0.3 * s, eval_every=4)
    run = write_run(tmp_path / "runs" / "a", recs, {"framework": "jaxpar", "model": {}})
    path, data = report.curves([str(run)])
    assert path == str(run / "curves.png")  # the default: beside the run
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    drawn = panels(data)
    assert list(drawn) == ["loss", "eval_loss", "lr", "grad_norm", "tokens_per_sec"]
    for key in drawn:
        want = [(r["step"], r[key]) for r in recs if key in r]
        assert drawn[key] == {"a (jaxpar)": ([s for s, _ in want], [v for _, v in want])}, key
    assert drawn["eval_loss"]["a (jaxpar)"][0] == [4, 8, 12]


def test_a_panel_no_run_has_data_for_is_left_out(tmp_path):
    no_eval = [{k: v for k, v in r.items() if k not in ("lr",)} for r in records(lambda s: 3.0)]
    run = write_run(tmp_path / "b", no_eval, {"framework": "torchpar"})
    _, data = report.curves([str(run)], str(tmp_path / "out"))
    assert list(panels(data)) == ["loss", "grad_norm", "tokens_per_sec"]
    assert (tmp_path / "out" / "curves.png").is_file()


def test_two_runs_are_two_lines_and_the_default_is_their_common_parent(tmp_path):
    jax_recs, torch_recs = records(lambda s: 4.0 - 0.1 * s), records(lambda s: 4.2 - 0.1 * s, n=4)
    a = write_run(tmp_path / "runs" / "jaxpar" / "a", jax_recs, {"framework": "jaxpar"})
    b = write_run(tmp_path / "runs" / "torchpar" / "a", torch_recs, {"backend": "ddp"})  # before the framework key
    path, data = report.curves([str(a), str(b)])
    assert path == str(tmp_path / "runs" / "curves.png")
    loss = panels(data)["loss"]
    assert loss == {
        "a (jaxpar)": ([r["step"] for r in jax_recs], [r["loss"] for r in jax_recs]),
        "a (torchpar)": ([r["step"] for r in torch_recs], [r["loss"] for r in torch_recs]),
    }
    assert not (a / "curves.png").exists() and not (b / "curves.png").exists()


def test_alike_labels_take_the_path_and_a_run_without_config_its_name(tmp_path):
    a = write_run(tmp_path / "x" / "run", records(lambda s: 1.0), {"framework": "jaxpar"})
    b = write_run(tmp_path / "y" / "run", records(lambda s: 2.0), {"framework": "jaxpar"})
    c = write_run(tmp_path / "z", records(lambda s: 3.0))
    assert report.run_labels([str(a), str(b), str(c)]) == ["x/run (jaxpar)", "y/run (jaxpar)", "z"]
    assert report.run_labels([str(c), str(c)]) == ["z", "z #2"]


def test_a_resumed_run_plots_each_step_once_with_its_last_value(tmp_path):
    first = [{"step": s, "loss": 9.0} for s in (2, 4, 6)]
    again = [{"step": s, "loss": 1.0} for s in (4, 6, 8)]  # restarted from step 2's checkpoint
    run = write_run(tmp_path / "r", first + again + [{"step": 10, "loss": None}])
    _, data = report.curves([str(run)])
    assert data == {"loss": {"r": ([2, 4, 6, 8], [9.0, 1.0, 1.0, 1.0])}}


def test_the_command_writes_one_line_and_never_into_the_source_tree(tmp_path, capsys):
    run = write_run(tmp_path / "runs" / "a", records(lambda s: 2.0))
    assert report.main([str(run)]) == 0
    assert capsys.readouterr().out == f"wrote {run / 'curves.png'}\n"
    assert report.main([str(run), "--out", str(tmp_path / "pics" / "c.png")]) == 0
    assert (tmp_path / "pics" / "c.png").is_file()
    root = report.source_root()
    assert root == os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(report.__file__))))
    for where in (
        [os.path.join(root, "docs", "benchmarks", "run")],
        [os.path.join(root, "jaxpar", "run")],
        [os.path.join(root, "a"), os.path.join(root, "b")],
    ):  # several runs whose common parent is the root
        with pytest.raises(report.UserError, match="is in the source tree; choose one with --out"):
            report.beside(where)
    assert report.beside([os.path.join(root, "runs", "a")]) == os.path.join(root, "runs", "a")


@pytest.mark.parametrize("case", ["missing", "no_metrics", "empty", "nothing_to_plot"])
def test_bad_run_input_is_one_line(case, tmp_path, capsys):
    run = tmp_path / "run"
    if case != "missing":
        run.mkdir()
    if case == "empty":
        (run / "metrics.jsonl").write_text("\n")
    if case == "nothing_to_plot":
        write_run(run, [{"step": 2, "straggler_ratio": 1.5}])
    assert report.main([str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert {
        "missing": "no such run directory",
        "no_metrics": "has no metrics.jsonl",
        "empty": "is empty",
        "nothing_to_plot": "has no loss, eval_loss",
    }[case] in err
    assert not list(tmp_path.rglob("*.png"))


def test_straggler_plots_are_drawn_only_from_data_and_beside_the_run(tmp_path, capsys):
    one = write_run(tmp_path / "one", records(lambda s: 2.0) + [{"step": 14, "comm_share": 0.0}])
    assert report.main(["--run", str(one)]) == 0
    assert "no straggler plots" in capsys.readouterr().out
    assert not list(tmp_path.rglob("*.png"))
    two = write_run(tmp_path / "two", [{"step": 2, "straggler_ratio": 1.8, "slowest_rank": 1}])
    assert report.main(["--run", str(two)]) == 0
    assert capsys.readouterr().out == f"wrote {two / 'stragglers.png'}\n"  # no comm_share_<axis>: no comm plot
    assert {p.name for p in two.iterdir()} == {"metrics.jsonl", "stragglers.png"}
