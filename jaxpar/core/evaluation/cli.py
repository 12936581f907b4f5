"""The command line shared by `python -m jaxpar.eval` and `python -m torchpar.eval`, and the call into lm-eval.

The framework's command builds its ProjectLM (where the weights come from, on which devices); what follows is here:
the tasks run by lm-eval's `simple_evaluate`, the text tasks' token perplexity added, evals/<step>.json written and
lm-eval's table printed.
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict
from contextlib import contextmanager

from jaxpar.core.errors import UserError, quiet_logs
from jaxpar.core.sampling_cli import source_parser
from jaxpar.core.evaluation.harness import ProjectLM
from jaxpar.core.evaluation.results import add_token_perplexity, evals_path, save, table
from jaxpar.core.evaluation.tasks import TaskList, parse_tasks, task_manager

LM_EVAL_LOGGERS = ("lm-eval", "lm_eval", "datasets", "evaluate", "absl")


def eval_parser(prog: str, doc: str, sources: dict[str, str]) -> argparse.ArgumentParser:
    """`sources`: option name -> help, one of which the user must give (e.g. run, weights)."""
    p = source_parser(prog, doc, sources, run_alias="--run-dir")  # torchrun's own parser takes --run for --run-path
    p.add_argument("--tasks", required=True, help="lm-eval task names, task YAML files or text files, comma-separated")
    p.add_argument("--num-fewshot", type=int, help="examples in each prompt (default: each task's own)")
    p.add_argument("--limit", type=_limit, help="the first N documents of each task (or a fraction, e.g. 0.1)")
    p.add_argument("--include-path", help="a folder of task YAML files, beside lm-eval's registry")
    p.add_argument("--batch-size", type=int, default=8, help="requests scored at once (default 8)")
    p.add_argument("--gen-kwargs", help="generation settings for every generate task, e.g. max_gen_toks=64")
    p.add_argument("--log-samples", action="store_true", help="also write each request's scores (<step>.samples.json)")
    p.add_argument("--output", help="the results file (default: RUN/evals/<step>.json; required with --weights/--hf)")
    return p


def _limit(text: str) -> int | float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError("give a count of documents (>= 1) or a fraction in (0, 1)")
    return int(value) if value >= 1 else value


def check_eval_args(args) -> TaskList:
    """The flags checked before anything loads: the tasks' files and folders, the batch size and the output."""
    if args.batch_size < 1:
        raise UserError(f"--batch-size {args.batch_size}: give at least 1")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise UserError(f"--num-fewshot {args.num_fewshot}: give 0 or more")
    if not getattr(args, "run", None) and not args.output:
        raise UserError("--output FILE is required with --weights or --hf (a run's results go to RUN/evals/)")
    return parse_tasks(args.tasks, args.include_path)


@contextmanager
def _lm_eval_errors():
    """lm-eval's errors for data it could not download or a task without documents, as one line."""
    try:
        yield
    except ConnectionError as e:  # a registry task's data, on a machine that cannot download it
        raise UserError(
            f"{e}: lm-eval's registry tasks download their data from the Hugging Face Hub; offline, write a task of "
            "your own (docs/evaluation.md)"
        ) from None
    except ValueError as e:
        if "did not find any docs" not in str(e):
            raise
        raise UserError("a task has no documents: check its data files and split") from None


def check_documents(manager, tasks: TaskList, limit, processes: int) -> None:
    """Each task has a document for each process to score (lm-eval's ranks would wait forever for an empty one)."""
    from lm_eval.tasks import get_task_dict  # deferred: lm-eval (~1 s), when a command evaluates

    def leaves(tree):
        for value in tree.values():
            yield from leaves(value) if isinstance(value, dict) else [value]

    for task in leaves(get_task_dict(tasks.names, manager)):
        n = len(task.eval_docs)
        n = n if limit is None else min(n, int(limit) if limit >= 1 else math.ceil(limit * n))
        if n < processes:
            raise UserError(
                f"task {task.config.task} has {n} document(s) (with --limit / train.eval_tasks_limit) for {processes} "
                "processes to share: give it more, or evaluate on fewer processes"
            )


def run_tasks(
    lm: ProjectLM,
    tasks: TaskList,
    num_fewshot: int | None = None,
    limit=None,
    gen_kwargs: str | None = None,
    log_samples: bool = False,
    manager=None,
) -> dict | None:
    """lm-eval's results of `tasks` on `lm` (None on a process other than lm's rank 0).

    `gen_kwargs`: "key=value,..." for every generate task (lm-eval's own reading). lm-eval's bootstrap of the
    standard errors of non-mean metrics runs 1,000 times (its default 100,000 takes minutes per task). `manager`:
    task_manager(tasks), made here unless the caller keeps one (the training hook, for all its evaluations).
    """
    from lm_eval import simple_evaluate  # deferred: lm-eval's evaluator (~1 s), when a command evaluates

    manager = manager or task_manager(tasks)
    if lm.world_size > 1:
        with quiet_logs(*LM_EVAL_LOGGERS), _lm_eval_errors():
            check_documents(manager, tasks, limit, lm.world_size)
    lm.rolling.clear()  # the text tasks' token counts of this evaluation alone
    with quiet_logs(*LM_EVAL_LOGGERS), _lm_eval_errors():
        results = simple_evaluate(
            model=lm,
            tasks=tasks.names,
            num_fewshot=num_fewshot,
            limit=limit,
            gen_kwargs=gen_kwargs,
            task_manager=manager,
            log_samples=log_samples,
            bootstrap_iters=1000,
        )
    # the text tasks' token counts of every process (lm-eval gathers its own metrics on rank 0, not these)
    parts = [dict(lm.rolling)] if lm.world_size == 1 else lm.gather_object(dict(lm.rolling))
    if results is not None:
        rolling = defaultdict(lambda: [0.0, 0])
        for part in parts:
            for task, (loglik, tokens) in part.items():
                rolling[task][0] += loglik
                rolling[task][1] += tokens
        add_token_perplexity(results, rolling, tasks.text_tasks)
    return results


def report(results: dict, args, step: int | None, about: dict) -> None:
    """Writes the results (evals/<step>.json of the run, or --output) and prints lm-eval's table and where they are.

    `step`: the checkpoint's (None for a weights file or a Hugging Face directory).
    """
    path = args.output or evals_path(args.run, step)
    save(path, step, results, about, args.log_samples)
    print(table(results))
    print(f"results of step {step}: {path}" if step is not None else f"results: {path}")
    if not args.output:
        print(f"next: python -m jaxpar.tools.report {args.run}  (plots each task's score over the evaluated steps)")
