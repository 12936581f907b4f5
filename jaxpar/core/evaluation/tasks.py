"""What `--tasks` (and train.eval_tasks) names: lm-eval tasks, the user's task YAML, or text files for perplexity.

Each comma-separated entry is one of
  a name in lm-eval's registry    hellaswag, arc_easy, lambada_openai, mmlu, ... (lm-eval downloads the data where a
                                  network exists); with --include-path DIR also the tasks of the YAML files there
  a task YAML file (.yaml/.yml)   its folder is included and its `task:` is run (works offline)
  any other file                  plain text, each paragraph (split at blank lines) a document scored with lm-eval's
                                  loglikelihood_rolling: lm-eval's word and byte perplexity and bits per byte, and
                                  the token perplexity (the task is named ppl_<file name>, _2, _3, ... for files of
                                  one name in several folders)
"""

from __future__ import annotations

import atexit
import difflib
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field

from jaxpar.core.errors import UserError

TEXT_TASK = """task: {name}
dataset_path: text
dataset_kwargs:
  data_files:
    test: {path}
  sample_by: paragraph
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
"""


@dataclass
class TaskList:
    """The names lm-eval runs, the folders it reads task YAML from, and the text-file tasks among them."""

    names: list[str] = field(default_factory=list)
    include: list[str] = field(default_factory=list)
    text_tasks: list[str] = field(default_factory=list)
    given_as: str = "--tasks"  # the flag or config key (refusals name it)


def _yaml_task_name(path: str) -> str:
    with open(path) as f:
        for line in f:
            m = re.match(r"\s*task:\s*['\"]?([\w.\-]+)", line)
            if m:
                return m.group(1)
    raise UserError(f"{path}: the file has no `task:` line, so it is not an lm-eval task YAML")


def text_task_name(path: str) -> str:
    return "ppl_" + re.sub(r"\W", "_", os.path.basename(path))


def parse_tasks(spec: str, include_path: str | None = None, name: str = "--tasks") -> TaskList:
    """The entries of `spec` sorted into names, include folders and text tasks; files are checked to exist.

    `name`: the flag or config key the user gave them with (for the refusals).
    """
    out = TaskList(include=[os.path.abspath(include_path)] if include_path else [], given_as=name)
    if include_path and not os.path.isdir(include_path):
        raise UserError(f"--include-path {include_path} is not a directory")
    entries = [e.strip() for e in spec.split(",") if e.strip()]
    if not entries:
        raise UserError(f"{name} is empty: name lm-eval tasks (e.g. hellaswag,arc_easy), task YAML or text files")
    texts = []
    for entry in entries:
        looks_like_path = os.sep in entry or os.path.splitext(entry)[1] in (".yaml", ".yml", ".txt", ".jsonl")
        if os.path.isfile(entry):
            if entry.endswith((".yaml", ".yml")):
                out.include.append(os.path.dirname(os.path.abspath(entry)))
                out.names.append(_yaml_task_name(entry))
            else:
                named, k = text_task_name(entry), 1
                while named in out.names:  # another folder's file of the same name
                    k, named = k + 1, f"{text_task_name(entry)}_{k + 1}"
                texts.append((os.path.abspath(entry), named))
                out.names.append(named)
        elif looks_like_path:
            raise UserError(f"{name}: {entry}: no such file")
        else:
            out.names.append(entry)
    if texts:
        folder = tempfile.mkdtemp(prefix="jaxpar-text-tasks-")
        atexit.register(shutil.rmtree, folder, True)  # the generated YAML lives as long as the command
        for path, named in texts:
            with open(os.path.join(folder, named + ".yaml"), "w") as f:
                f.write(TEXT_TASK.format(name=named, path=path))
        out.include.append(folder)
        out.text_tasks = [named for _, named in texts]
    return out


def task_manager(tasks: TaskList):
    """lm-eval's TaskManager over its registry and the include folders, with every name of `tasks` checked."""
    from lm_eval.tasks import TaskManager  # deferred: lm-eval's task index (~1 s), when a command evaluates

    manager = TaskManager(include_path=tasks.include or None)
    known = set(manager.all_tasks)
    for name in tasks.names:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else " (python -m lm_eval ls tasks lists them)"
            raise UserError(f"{tasks.given_as}: {name} is not an lm-eval task, a task YAML or a file{hint}")
    return manager


def check_eval_tasks(cfg) -> None:
    """Before any work: train.eval_tasks names tasks lm-eval has (its files exist, its names are in the registry)."""
    if cfg.train.eval_tasks:
        task_manager(parse_tasks(cfg.train.eval_tasks, name="train.eval_tasks"))
