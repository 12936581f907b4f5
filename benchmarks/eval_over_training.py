"""Benchmark scores over the README run's training: a local cloze task and a file's perplexity, every 25 steps.

    python benchmarks/eval_over_training.py OUT_DIR

Writes OUT_DIR/tasks/cloze.yaml (+ cloze.jsonl): a multiple-choice task of 200 items cut from this checkout's own
jaxpar/core sources, which the README's model never trains on (it trains on the standard library): 48 characters of
code, then the next word among four (the true one and three other words of that file, of like length; chance 25%).
Then trains the README's main job (configs/gpt2-tiny.yaml on dp=2,tp=4) with train.eval_tasks on the cloze task and
on the perplexity of jaxpar/core/run/loop.py every 25 steps, scores the last checkpoint again with jaxpar.eval and, on
its torchpar conversion, torchpar.eval, and prints a Markdown table of the scores by step.
"""

from __future__ import annotations

import glob
import json
import os
import random
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONTEXT, ITEMS, EVERY = 48, 200, 25
TEXT = os.path.join(ROOT, "jaxpar", "core", "run", "loop.py")


def cloze_items(seed: int = 0) -> list[dict]:
    rng, items = random.Random(seed), []
    files = sorted(glob.glob(os.path.join(ROOT, "jaxpar", "core", "**", "*.py"), recursive=True))
    while len(items) < ITEMS:
        with open(rng.choice(files)) as f:
            text = f.read()
        words = [m for m in re.finditer(r"\b[A-Za-z_]{4,12}\b", text) if m.start() >= CONTEXT]
        vocabulary = sorted({m.group() for m in words})
        if len(words) < 10 or len(vocabulary) < 20:
            continue
        m = rng.choice(words)
        answer = m.group()
        alike = [w for w in vocabulary if w != answer and abs(len(w) - len(answer)) <= 2]
        if len(alike) < 3:
            continue
        choices = rng.sample(alike, 3) + [answer]
        rng.shuffle(choices)
        items.append(
            {"context": text[m.start() - CONTEXT : m.start()], "choices": choices, "answer": choices.index(answer)}
        )
    return items


def write_task(folder: str) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "cloze.jsonl"), "w") as f:
        f.writelines(json.dumps(item) + "\n" for item in cloze_items())
    path = os.path.join(folder, "cloze.yaml")
    with open(path, "w") as f:
        f.write(
            "task: jaxpar_cloze\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {folder}/cloze.jsonl\ntest_split: test\noutput_type: multiple_choice\n"
            'doc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
            'target_delimiter: ""\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n'
        )
    return path


def run(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"{' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return out.stdout


def main() -> None:
    out_dir = os.path.abspath(sys.argv[1])
    task, run_dir = write_task(os.path.join(out_dir, "tasks")), os.path.join(out_dir, "run")
    tasks = f"{task},{TEXT}"
    run(
        "jaxpar.train",
        "--config",
        "configs/gpt2-tiny.yaml",
        "--mesh",
        "dp=2,tp=4",
        f"run.dir={run_dir}",
        f"train.eval_tasks={tasks}",
        f"train.eval_tasks_every={EVERY}",
    )
    run("jaxpar.eval", "--run", run_dir, "--tasks", tasks, "--output", os.path.join(out_dir, "jaxpar-eval.json"))
    torch_run = os.path.join(out_dir, "run-torchpar")
    run("jaxpar.tools.convert", "--from", "jaxpar", run_dir, "--to", "torchpar", torch_run)
    run("torchpar.eval", "--run", torch_run, "--tasks", tasks, "--output", os.path.join(out_dir, "torchpar-eval.json"))
    print("| step | cloze acc | cloze acc_norm | loop.py bits per byte | loop.py token perplexity |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    rows = sorted(glob.glob(os.path.join(run_dir, "evals", "*.json")), key=lambda p: int(os.path.basename(p)[:-5]))
    named = [(f"{os.path.basename(p)[:-5]}", p) for p in rows]
    named += [("jaxpar.eval, last", os.path.join(out_dir, "jaxpar-eval.json"))]
    named += [("torchpar.eval, last", os.path.join(out_dir, "torchpar-eval.json"))]
    for name, path in named:
        with open(path) as f:
            r = json.load(f)["results"]
        c, t = r["jaxpar_cloze"], r["ppl_loop_py"]
        print(
            f"| {name} | {c['acc,none']:.3f} ± {c['acc_stderr,none']:.3f} | {c['acc_norm,none']:.3f} | "
            f"{t['bits_per_byte,none']:.3f} | {t['token_perplexity,none']:.2f} |"
        )


if __name__ == "__main__":
    main()
