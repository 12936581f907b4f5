"""Benchmark scores over the README run's training: a local cloze task and a file's perplexity, every 25 steps.

    python benchmarks/eval_over_training.py OUT_DIR

Writes two multiple-choice tasks of 200 items each to OUT_DIR/tasks (YAML + JSON lines), cut from this checkout's own
jaxpar/core sources, which the README's model never trains on (it trains on the standard library): 48 characters of
code, then among four choices (chance 25%) the next word (cloze: the true one and three other words of that file, of
like length) or the next three characters (next3: the true ones and three other 3-character spans of that file).
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


def choice_items(seed: int, pick) -> list[dict]:
    """ITEMS multiple-choice items, each from a random jaxpar/core source file.

    `pick(rng, text)` -> (position, answer, three other choices), or None where that file gives no item: the context is
    the CONTEXT characters before the position, the choices the answer among the others in a random order.
    """
    rng, items = random.Random(seed), []
    files = sorted(glob.glob(os.path.join(ROOT, "jaxpar", "core", "**", "*.py"), recursive=True))
    while len(items) < ITEMS:
        with open(rng.choice(files)) as f:
            text = f.read()
        picked = pick(rng, text)
        if picked is None:
            continue
        at, answer, others = picked
        choices = others + [answer]
        rng.shuffle(choices)
        items.append({"context": text[at - CONTEXT : at], "choices": choices, "answer": choices.index(answer)})
    return items


def next_word(rng: random.Random, text: str):
    """The next word, among three other words of that file of like length."""
    words = [m for m in re.finditer(r"\b[A-Za-z_]{4,12}\b", text) if m.start() >= CONTEXT]
    vocabulary = sorted({m.group() for m in words})
    if len(words) < 10 or len(vocabulary) < 20:
        return None
    m = rng.choice(words)
    alike = [w for w in vocabulary if w != m.group() and abs(len(w) - len(m.group())) <= 2]
    return (m.start(), m.group(), rng.sample(alike, 3)) if len(alike) >= 3 else None


def next_chars(rng: random.Random, text: str):
    """The next three characters, among three other 3-character spans of that file."""
    if len(text) < 1000:
        return None
    at = rng.randrange(CONTEXT, len(text) - 3)
    answer = text[at : at + 3]
    others = {text[i : i + 3] for i in (rng.randrange(0, len(text) - 3) for _ in range(12))} - {answer}
    return (at, answer, rng.sample(sorted(others), 3)) if len(others) >= 3 else None


def write_task(folder: str, name: str, items: list[dict]) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{name}.jsonl"), "w") as f:
        f.writelines(json.dumps(item) + "\n" for item in items)
    path = os.path.join(folder, f"{name}.yaml")
    with open(path, "w") as f:
        f.write(
            f"task: jaxpar_{name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {folder}/{name}.jsonl\ntest_split: test\noutput_type: multiple_choice\n"
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
    folder, run_dir = os.path.join(out_dir, "tasks"), os.path.join(out_dir, "run")
    cloze = write_task(folder, "cloze", choice_items(0, next_word))
    chars = write_task(folder, "next3", choice_items(1, next_chars))
    tasks = f"{cloze},{chars},{TEXT}"
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
    print("| step | next word acc | next 3 characters acc | loop.py bits per byte | loop.py token perplexity |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    rows = sorted(glob.glob(os.path.join(run_dir, "evals", "*.json")), key=lambda p: int(os.path.basename(p)[:-5]))
    named = [(f"{os.path.basename(p)[:-5]}", p) for p in rows]
    named += [("jaxpar.eval, last", os.path.join(out_dir, "jaxpar-eval.json"))]
    named += [("torchpar.eval, last", os.path.join(out_dir, "torchpar-eval.json"))]
    for name, path in named:
        with open(path) as f:
            r = json.load(f)["results"]
        c, n, t = r["jaxpar_cloze"], r["jaxpar_next3"], r["ppl_loop_py"]
        print(
            f"| {name} | {c['acc,none']:.3f} ± {c['acc_stderr,none']:.3f} | {n['acc,none']:.3f} ± "
            f"{n['acc_stderr,none']:.3f} | {t['bits_per_byte,none']:.3f} | {t['token_perplexity,none']:.2f} |"
        )


if __name__ == "__main__":
    main()
