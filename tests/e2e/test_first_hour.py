"""The README's first hour, walked in order on a clean directory with the README's own commands.

The main job and its closing lines, a sample, a benchmark task (the README's perplexity), the curves, the other
framework from the same weights (its own run directory, its checkpoints), a conversion that goes on in torchpar, the
run continued on another mesh, and the Hugging Face export in transformers' pipeline, greedy, giving
jaxpar.generate's tokens.
"""

import json
import os
import re
import shlex
import sys

import pytest

from jaxpar.core.data.tokens import text_codec
from tests.helpers import ROOT, run_in_session, torch_env

RUN, TORCH_RUN, INIT = "runs/jaxpar/gpt2-tiny", "runs/torchpar/gpt2-tiny", "runs/gpt2-tiny-init.safetensors"
N = 24  # new tokens sampled greedily


def one_line(text: str) -> str:
    """Shell continuations joined and every run of white space one space: a command as the README wraps it."""
    return re.sub(r"\s+", " ", text.replace("\\\n", " "))


class Walk:
    """Runs commands as a person pastes them, in a fresh directory holding the project's configs."""

    def __init__(self, where):
        self.where = str(where)
        with open(os.path.join(ROOT, "README.md")) as f:
            self.readme = one_line(f.read())
        for name in ("configs", "README.md"):  # what the README's commands read from the checkout
            os.symlink(os.path.join(ROOT, name), os.path.join(self.where, name))

    def __call__(self, command: str, in_readme: bool = True, ok: bool = True):
        assert not in_readme or one_line(command) in self.readme, f"the README no longer shows: {command}"
        argv = shlex.split(command)
        if argv[0] == "torchrun":  # the same launcher, from this Python (one node: a port of its own choosing)
            argv = [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
        elif argv[0] == "python":
            argv[0] = sys.executable
        r = run_in_session(argv, torch_env(), 300, command, cwd=self.where)
        assert not ok or r.returncode == 0, f"{command}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        return r

    def path(self, rel: str) -> str:
        return os.path.join(self.where, rel)

    def metrics(self, run: str) -> list[dict]:
        with open(self.path(f"{run}/metrics.jsonl")) as f:
            return [json.loads(line) for line in f]

    def steps(self, run: str) -> list[str]:
        return sorted(os.listdir(self.path(f"{run}/checkpoints")), key=int)


@pytest.mark.every_commit
def test_the_readme_first_hour(tmp_path, monkeypatch):
    from jaxpar.tools.report import curves

    walk = Walk(tmp_path)
    # the main job: where it goes, what it did, what comes next
    jax_summary = out = walk("python -m jaxpar.train --config configs/gpt2-tiny.yaml --mesh dp=2,tp=4").stdout
    assert out.startswith(f"jaxpar: run {RUN} (150 steps from scratch"), out[:300]
    assert "jaxpar: trained to step 150 of 150 (from step 0)" in out and f"; run {RUN}" in out
    assert "checkpoints at steps 100, 150" in out and "eval loss" in out
    sample, report = f'python -m jaxpar.generate --run {RUN} --prompt "def "', f"python -m jaxpar.tools.report {RUN}"
    for command in (sample, report):
        assert command in out, out

    assert walk(sample).stdout.startswith("def ")
    # benchmark tasks: the perplexity of the README itself, lm-eval's table and the results file
    out = walk(f"python -m jaxpar.eval --run {RUN} --tasks README.md").stdout
    assert "bits_per_byte" in out and f"results of step 150: {RUN}/evals/150.json" in out
    with open(walk.path(f"{RUN}/evals/150.json")) as f:
        bits = json.load(f)["results"]["ppl_README_md"]["bits_per_byte,none"]
    assert 1.0 < bits < 8.0  # a byte model that learned something of Python source (random: 8 bits per byte)
    assert walk(report).stdout.strip() == f"wrote {walk.path(RUN)}/curves.png"
    _, data = curves([walk.path(RUN)], str(tmp_path / "again.png"))  # what the picture plots
    logged = [(m["step"], m["loss"]) for m in walk.metrics(RUN)]
    assert [tuple(zip(*line)) for line in data["loss"].values()] == [tuple(logged)]

    # the other framework from the same weights: a run directory of its own, its checkpoints saved
    walk(f"python -m jaxpar.train --config configs/gpt2-tiny.yaml --write-init {INIT}")
    torch_summary = out = walk(
        f"torchrun --nproc_per_node=2 -m torchpar.train --config configs/gpt2-tiny.yaml "
        f"--backend fsdp model.init_from={INIT}"
    ).stdout
    assert "torchpar: trained to step 150 of 150" in out and f"python -m torchpar.generate --run {TORCH_RUN}" in out
    assert walk.steps(TORCH_RUN) == ["100", "150"] and walk.steps(RUN) == ["100", "150"]
    for run, framework in ((RUN, "jaxpar"), (TORCH_RUN, "torchpar")):  # each records whose run it is
        with open(walk.path(f"{run}/config.json")) as f:
            assert json.load(f)["framework"] == framework
    jax_loss, torch_loss = ({m["step"]: m["loss"] for m in walk.metrics(run)} for run in (RUN, TORCH_RUN))
    assert len(walk.metrics(RUN)) == 15  # nothing appended to the jaxpar run
    assert torch_loss[10] == pytest.approx(jax_loss[10], rel=1e-3)  # one init, one data order
    both = walk(f"python -m jaxpar.tools.report {RUN} {TORCH_RUN}").stdout.strip()
    assert both == f"wrote {walk.path('runs')}/curves.png"
    assert len(curves([walk.path(RUN), walk.path(TORCH_RUN)], str(tmp_path / "both.png"))[1]["loss"]) == 2

    # convert, and go on in torchpar from the same step
    moved = "runs/torchpar/gpt2-tiny-from-jaxpar"
    walk(f"python -m jaxpar.tools.convert --from jaxpar {RUN} --to torchpar {moved}")
    out = walk(
        f"torchrun --nproc_per_node=2 -m torchpar.train --config {moved}/config.json --backend fsdp train.steps=160",
        in_readme=False,
    ).stdout
    assert "torchpar: trained to step 160 of 160 (from step 150)" in out and walk.steps(moved)[-1] == "160"

    # a mesh of one's own: the run goes on there, saying what its longer schedule does to the learning rate
    out = walk("python -m jaxpar.train --config configs/gpt2-tiny.yaml --mesh dp=2,fsdp=2,tp=2 train.steps=300").stdout
    assert "the learning rate of step 151 moves from 3.0e-04 to" in out and "(from step 150)" in out

    # Hugging Face: each run's export, as its summary names it, loads in transformers' pipeline and decodes the
    # greedy tokens of the framework's own generate (which goes on past the end-of-document token 0; transformers
    # stops after it)
    for framework, run, summary in (("jaxpar", RUN, jax_summary), ("torchpar", TORCH_RUN, torch_summary)):
        export = f"python -m jaxpar.tools.convert --from {framework} {run} --to hf runs/hf/gpt2-tiny-from-{framework}"
        assert export in summary
        walk(export, in_readme=framework == "jaxpar")
        command = f'python -m {framework}.generate --run {run} --prompt "def " --temperature 0 --max-new-tokens {N}'
        printed = walk(command, in_readme=False).stdout
        want = greedy(framework, walk.path(run), monkeypatch)
        assert len(want) == N and printed == "def " + text_codec("byte")[1](want) + "\n"
        got = pipeline(walk.path(f"runs/hf/gpt2-tiny-from-{framework}"))
        assert got == (want[: want.index(0) + 1] if 0 in want else want), framework


def greedy(framework: str, run: str, monkeypatch) -> list[int]:
    """Return the token ids the framework's generate command prints greedily for the prompt "def ".

    The token ids `python -m FRAMEWORK.generate --run RUN --prompt "def " --temperature 0 --max-new-tokens N` prints,
    from the command's own functions in this process.
    """
    if framework == "jaxpar":
        from tests.jaxpar.test_hf_export import jaxpar_greedy

        return jaxpar_greedy(run, monkeypatch, "def ", N)
    from torchpar import generate

    args = generate.parse_args(["--run", run, "--prompt", "def ", "--temperature", "0", "--max-new-tokens", str(N)])
    return generate.sample_rows(args)[0][0]


def pipeline(model_dir: str) -> list[int]:
    """transformers' greedy continuation of "def " from an exported directory: its new token ids."""
    import transformers

    pipe = transformers.pipeline("text-generation", model=model_dir, device="cpu")
    return pipe("def ", do_sample=False, max_new_tokens=N, return_tensors=True)[0]["generated_token_ids"][4:]
