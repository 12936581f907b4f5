"""The command line shared by `python -m jaxpar.eval` and `python -m torchpar.eval`, and the call into lm-eval.

The framework's command builds its ProjectLM (where the weights come from, on which devices); what follows is here:
the tasks run by lm-eval's `simple_evaluate`, the text tasks' token perplexity added, evals/<step>.json written and
lm-eval's table printed.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from contextlib import contextmanager

from jaxpar.core.errors import UserError, quiet_logs
from jaxpar.core.evaluation.harness import ProjectLM
from jaxpar.core.evaluation.results import add_token_perplexity, evals_path, save, table
from jaxpar.core.evaluation.tasks import TaskList, parse_tasks, task_manager

LM_EVAL_LOGGERS = ("lm-eval", "lm_eval", "datasets", "evaluate", "absl")


def eval_parser(prog: str, doc: str, sources: dict[str, str]) -> argparse.ArgumentParser:
    """`sources`: option name -> help, one of which the user must give (e.g. run, weights)."""
    p = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    for name, help_text in sources.items():
        # --run-dir: the same as --run, which torchrun's own argument parser takes for its --run-path
        src.add_argument(f"--{name}", *(["--run-dir"] if name == "run" else []), dest=name, help=help_text)
    p.add_argument("--tasks", required=True, help="lm-eval task names, task YAML files or text files, comma-separated")
    p.add_argument("--num-fewshot", type=int, help="examples in each prompt (default: each task's own)")
    p.add_argument("--limit", type=_limit, help="the first N documents of each task (or a fraction, e.g. 0.1)")
    p.add_argument("--include-path", help="a folder of task YAML files, beside lm-eval's registry")
    p.add_argument("--batch-size", type=int, default=8, help="requests scored at once (default 8)")
    p.add_argument("--gen-kwargs", help="generation settings for every generate task, e.g. max_gen_toks=64")
    p.add_argument("--tokenizer", help="'byte' or a tokenizer.json (default: the run's, else byte)")
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


def gen_kwargs_of(text: str | None) -> dict | None:
    """key=value,... as lm-eval's --gen_kwargs reads them (numbers and booleans converted)."""
    if not text:
        return None
    out = {}
    for item in text.split(","):
        key, eq, value = item.partition("=")
        if not eq:
            raise UserError(f"--gen-kwargs {text}: {item!r} is not key=value")
        for kind in (int, float):
            try:
                value = kind(value)
                break
            except ValueError:
                pass
        out[key.strip()] = {"true": True, "false": False}.get(value, value) if isinstance(value, str) else value
    return out


@contextmanager
def _lm_eval_errors(processes: int):
    """lm-eval's errors for data it could not download or a process left without documents, as one line."""
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
        raise UserError(
            f"a task (or its --limit) has fewer documents than the {processes} processes that share them: "
            "evaluate it on fewer processes"
        ) from None


def run_tasks(
    lm: ProjectLM,
    tasks: TaskList,
    num_fewshot: int | None = None,
    limit=None,
    gen_kwargs: dict | None = None,
    log_samples: bool = False,
) -> dict | None:
    """lm-eval's results of `tasks` on `lm` (None on a process other than lm's rank 0)."""
    from lm_eval import simple_evaluate  # deferred: lm-eval's evaluator (~1 s), when a command evaluates

    manager = task_manager(tasks)
    lm.rolling.clear()  # the text tasks' token counts of this evaluation alone
    with quiet_logs(*LM_EVAL_LOGGERS), _lm_eval_errors(lm.world_size):
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
