"""Benchmark evaluation end to end: lm-eval's own `hf` model as the oracle, torchrun's ranks, train.eval_tasks.

Offline: the tasks are the test's own (tests/helpers.py write_eval_tasks: multiple choice, generate_until and a text
file for perplexity) over the tiny runs' text.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxpar.core.evaluation.tasks import parse_tasks
from tests.helpers import (
    ROOT,
    TINY,
    free_port,
    metrics,
    run_cli,
    tensorboard_scalars,
    torch_command,
    torch_env,
    write_eval_tasks,
)

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
TASKS = ("tiny_mc", "tiny_gen")


def _run(args: list[str], env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    full = {**torch_env(), **OFFLINE, **(env or {})}
    out = subprocess.run(args, cwd=ROOT, env=full, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out


def _eval(module: str, source: list[str], tasks: dict, *extra: str, launcher: list[str] | None = None):
    spec = ",".join([*TASKS, tasks["text"]])
    cmd = launcher or [sys.executable, "-m"]
    return _run([*cmd, module, *source, "--tasks", spec, "--include-path", tasks["include"], *extra])


def _samples(path: str) -> dict[str, dict[int, list]]:
    """{task: {doc id: [each request's response]}} of a --log-samples file."""
    with open(path) as f:
        data = json.load(f)
    return {t: {s["doc_id"]: [r[0] for r in s["resps"]] for s in samples} for t, samples in data.items()}


def _assert_same_answers(got: dict, want: dict, atol: float, what: str) -> None:
    assert set(got) == set(want), what
    for task in want:
        assert sorted(got[task]) == sorted(want[task]), (what, task)
        for doc, responses in want[task].items():
            for g, w in zip(got[task][doc], responses):
                if isinstance(w, str):  # a generation
                    assert g == w, (what, task, doc, g, w)
                elif isinstance(w, (list, tuple)):  # (log-likelihood, greedy)
                    assert abs(g[0] - w[0]) <= atol and bool(g[1]) == bool(w[1]), (what, task, doc, g, w)
                else:  # a rolling log-likelihood
                    assert abs(g - w) <= atol, (what, task, doc, g, w)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, dataset):
    """A tiny jaxpar run trained on the tasks' text, its Hugging Face export and its torchpar conversion."""
    root = tmp_path_factory.mktemp("eval")
    run = root / "run"
    out = run_cli(run, dataset, "train.steps=40", "train.eval_every=0", "optim.warmup_steps=5")
    assert out.returncode == 0, out.stderr[-3000:]
    convert = [sys.executable, "-m", "jaxpar.tools.convert", "--from", "jaxpar", str(run)]
    _run([*convert, "--to", "hf", str(root / "hf")])
    _run([*convert, "--to", "torchpar", str(root / "torchpar")])
    return {"root": root, "run": str(run), "hf": str(root / "hf"), "torchpar": str(root / "torchpar")}


def _hf_oracle(hf_dir: str, tasks: dict) -> dict:
    """lm-eval's own `hf` model on the export (transformers, CPU, float32): its per-request answers and accuracies."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    listed = parse_tasks(",".join([*TASKS, tasks["text"]]), tasks["include"])
    os.environ.update(OFFLINE)
    results = simple_evaluate(
        model="hf",
        model_args=f"pretrained={hf_dir},device=cpu,dtype=float32",
        tasks=listed.names,
        task_manager=TaskManager(include_path=listed.include),
        log_samples=True,
        batch_size=4,
    )
    path = os.path.join(tasks["include"], "hf.samples.json")
    with open(path, "w") as f:
        json.dump(results["samples"], f, default=str)
    return {"samples": _samples(path), "results": results["results"]}


@pytest.mark.every_commit
def test_both_frameworks_answer_as_lm_evals_hf_model_on_the_export(trained, tmp_path):
    """The oracle nobody here wrote: lm-eval's `hf` model on the export gives each request's answer.

    Every log-likelihood within 1e-4 (a context/continuation split one token off moves it by a whole token's
    log-probability), the greedy flags, the accuracies and the greedy generations equal, in jaxpar and in torchpar.
    """
    tasks = write_eval_tasks(tmp_path / "tasks")
    oracle = _hf_oracle(trained["hf"], tasks)
    gens = [s[0] for s in oracle["samples"]["tiny_gen"].values()]
    assert len(set(gens)) > 1 and any(gens), gens  # a model that says something, not the same thing for every prompt
    for module, source in (("jaxpar.eval", trained["run"]), ("torchpar.eval", trained["torchpar"])):
        _eval(module, ["--run", source], tasks, "--log-samples")
        step = 40
        got = _samples(os.path.join(source, "evals", f"{step}.samples.json"))
        _assert_same_answers(got, oracle["samples"], 1e-4, module)
        with open(os.path.join(source, "evals", f"{step}.json")) as f:
            results = json.load(f)["results"]
        for task, metric in (("tiny_mc", "acc,none"), ("tiny_gen", "exact_match,none")):
            assert results[task][metric] == oracle["results"][task][metric], (module, task)
        text = next(t for t in results if t.startswith("ppl_"))
        for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
            assert results[text][metric] == pytest.approx(oracle["results"][text][metric], rel=1e-5)
        # the byte tokenizer's token perplexity is its byte perplexity
        assert results[text]["token_perplexity,none"] == pytest.approx(results[text]["byte_perplexity,none"], rel=1e-9)
    assert 0.5 <= oracle["results"]["tiny_mc"]["acc,none"] < 1.0  # the trained model learned some of the text


def test_torchrun_ranks_share_the_requests_and_equal_one_process(trained, tmp_path):
    """One process on the weights file, two under torchrun on the torchpar run: the same answers and scores.

    The text task's 3 documents leave one rank a repeat of lm-eval's; its tokens count once in the token perplexity.
    A task with fewer documents than processes is refused in one line on every rank (not a hang).
    """
    tasks = write_eval_tasks(tmp_path / "tasks")
    one, two = str(tmp_path / "one.json"), str(tmp_path / "two.json")
    weights = os.path.join(trained["root"], "weights.safetensors")
    _run([sys.executable, "-m", "jaxpar.tools.convert", "--from", "jaxpar", trained["run"], "--to", "shared", weights])
    _eval("torchpar.eval", ["--weights", weights], tasks, "--log-samples", "--output", one)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}"]
    source = ["--run-dir", trained["torchpar"]]  # as docs/evaluation.md runs it (torchrun takes --run itself)
    out = _eval("torchpar.eval", source, tasks, "--log-samples", "--output", two, launcher=[*torchrun, "-m"])
    assert out.stdout.count("results of step 40") == 1  # rank 0 writes and prints
    _assert_same_answers(_samples(two[:-5] + ".samples.json"), _samples(one[:-5] + ".samples.json"), 1e-6, "torchrun")
    with open(one) as f, open(two) as g:
        a, b = json.load(f)["results"], json.load(g)["results"]
    text = next(t for t in a if t.startswith("ppl_"))
    assert b[text]["token_perplexity,none"] == pytest.approx(a[text]["token_perplexity,none"], rel=1e-6)
    assert a[text]["token_perplexity,none"] == pytest.approx(a[text]["byte_perplexity,none"], rel=1e-9)

    refused = subprocess.run(
        [
            *torchrun,
            "-m",
            "torchpar.eval",
            *source,
            "--tasks",
            "tiny_mc",
            "--include-path",
            tasks["include"],
            "--limit",
            "1",
            "--output",
            str(tmp_path / "three.json"),
        ],
        cwd=ROOT,
        env={**torch_env(), **OFFLINE},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert refused.returncode != 0 and refused.stderr.count("error: task tiny_mc has 1 document(s)") == 1, (
        refused.stderr[-2000:]
    )


def _scores_by_step(run_dir) -> dict[int, dict]:
    return {s: {k: v for k, v in r.items() if k.startswith("eval/")} for s, r in metrics(run_dir).items()}


@pytest.mark.every_commit
def test_train_eval_tasks_score_at_the_requested_steps(dataset, tmp_path):
    """jaxpar: scores of the live parameters at every train.eval_tasks_every steps and the last.

    A resumed run acts on its changed settings (every, limit, few-shot).
    """
    tasks = write_eval_tasks(tmp_path / "tasks")
    spec = f"train.eval_tasks={tasks['include']}/mc.yaml,{tasks['text']}"
    run = tmp_path / "run"
    first = run_cli(
        run, dataset, "train.steps=6", spec, "train.eval_tasks_every=3", "run.tensorboard=true", env=OFFLINE
    )
    assert first.returncode == 0, first.stderr[-3000:]
    assert sorted(os.listdir(run / "evals")) == ["3.json", "6.json"]
    scored = {s: v for s, v in _scores_by_step(run).items() if v}
    assert sorted(scored) == [3, 6] and scored[3] != scored[6]  # the model moved between them
    board = tensorboard_scalars(run)
    assert board["eval/tiny_mc/acc"] == pytest.approx({s: scored[s]["eval/tiny_mc/acc"] for s in (3, 6)})  # float32
    assert "eval tasks at step 6: tiny_mc/acc" in first.stdout
    # the scores of step 6 are those of its checkpoint, scored afresh by the eval command
    _run(
        [
            sys.executable,
            "-m",
            "jaxpar.eval",
            "--run",
            str(run),
            "--tasks",
            spec.split("=", 1)[1],
            "--output",
            str(tmp_path / "after.json"),
        ]
    )
    with open(tmp_path / "after.json") as f:
        after = json.load(f)["results"]
    assert after["tiny_mc"]["acc,none"] == scored[6]["eval/tiny_mc/acc"]
    text = next(t for t in after if t.startswith("ppl_"))
    assert after[text]["bits_per_byte,none"] == pytest.approx(scored[6][f"eval/{text}/bits_per_byte"], rel=1e-6)

    resumed = run_cli(
        run,
        dataset,
        "train.steps=10",
        spec,
        "train.eval_tasks_every=5",
        "train.eval_tasks_limit=4",
        "train.eval_tasks_fewshot=1",
        env=OFFLINE,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming with train.eval_tasks_every changed: 3 -> 5" in resumed.stdout + resumed.stderr
    assert sorted(os.listdir(run / "evals")) == ["10.json", "3.json", "6.json"]  # every 3 would have scored step 9
    with open(run / "evals" / "10.json") as f:
        last = json.load(f)
    assert last["n-shot"]["tiny_mc"] == 1 and last["n-samples"]["tiny_mc"]["effective"] == 4
    with open(run / "evals" / "6.json") as f:
        assert json.load(f)["n-samples"]["tiny_mc"]["effective"] == 6  # no limit before the resume


def test_torchpar_trainer_scores_at_the_requested_steps(dataset, tmp_path):
    """torchpar: one process, and 2 ddp ranks under torchrun sharing the requests, score the one run alike."""
    tasks = write_eval_tasks(tmp_path / "tasks")
    args = [
        "train.steps=4",
        f"train.eval_tasks={tasks['include']}/mc.yaml,{tasks['text']}",
        "train.eval_tasks_every=2",
        "train.eval_tasks_limit=3",
    ]
    out = run_cli(tmp_path / "one", dataset, *args, env=OFFLINE, module="torchpar.train")
    assert out.returncode == 0, out.stderr[-3000:]
    ddp = subprocess.run(
        torch_command([*TINY, f"data.dataset={dataset}", f"run.dir={tmp_path / 'two'}", "--backend", "ddp", *args], 2),
        cwd=ROOT,
        env={**torch_env(), **OFFLINE},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    for run in ("one", "two"):
        assert sorted(os.listdir(tmp_path / run / "evals")) == ["2.json", "4.json"]
        with open(tmp_path / run / "evals" / "4.json") as f:
            assert json.load(f)["n-samples"]["tiny_mc"]["effective"] == 3
    one, two = ({s: v for s, v in _scores_by_step(tmp_path / r).items() if v} for r in ("one", "two"))
    assert sorted(one) == sorted(two) == [2, 4] and all("eval/tiny_mc/acc" in v for v in one.values())
    for step in (2, 4):  # ddp trains the one-process run; its ranks' shares of the requests gather to the same scores
        assert two[step] == pytest.approx(one[step], rel=1e-5), step


@pytest.mark.parametrize(
    "module,args,message",
    [
        ("jaxpar.train", ["--mesh", "pp=2", "train.eval_tasks=x.txt"], "train.eval_tasks=x.txt has no effect"),
        ("jaxpar.train", ["train.eval_tasks_every=5"], "train.eval_tasks_every=5 has no effect without"),
        (
            "jaxpar.train",
            ["train.eval_tasks=no_such_task_here"],
            "train.eval_tasks: no_such_task_here is not an lm-eval",
        ),
        ("torchpar.train", ["train.eval_tasks=tiny.txt"], "train.eval_tasks: tiny.txt: no such file"),
        ("jaxpar.eval", ["--run", "/nonexistent", "--tasks", "x"], "not a run directory"),
        ("jaxpar.eval", ["--weights", "w.safetensors", "--tasks", "x"], "--output FILE is required"),
        ("jaxpar.eval", ["--run", ".", "--tasks", "a.txt", "--mesh", "pp=2"], "evaluation runs on dp / fsdp / tp"),
    ],
)
def test_bad_evaluation_input_is_one_line(tmp_path, dataset, module, args, message):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            module,
            *(["--config", "configs/gpt2-tiny.yaml", f"run.dir={tmp_path}/r"] if module.endswith("train") else []),
            *args,
        ],
        cwd=ROOT,
        env={**torch_env(), **OFFLINE},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0 and message in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert not os.path.exists(tmp_path / "r")  # a refused run writes nothing
