"""What an evaluation leaves: evals/<step>.json in the run directory, a table on the console, scores for the log.

evals/<step>.json holds lm-eval's results of the checkpoint at that step: per task its metrics ("acc,none": the metric
and lm-eval's filter), their standard errors, the few-shot counts, task versions and sample counts, and the model and
tasks it was given. metrics.jsonl and TensorBoard record the scores as `eval/<task>/<metric>`.
"""

from __future__ import annotations

import glob
import json
import math
import os

SAVED = ("results", "groups", "group_subtasks", "n-shot", "n-samples", "versions", "higher_is_better")


def add_token_perplexity(results: dict, rolling: dict, text_tasks: list[str]) -> None:
    """Each text task's token perplexity, exp(-log-likelihood / tokens), beside lm-eval's word and byte ones."""
    for name in text_tasks:
        loglik, tokens = rolling.get(name, (0.0, 0))
        if tokens and name in results.get("results", {}):
            results["results"][name]["token_perplexity,none"] = math.exp(-loglik / tokens)


def scores(results: dict) -> dict[str, float]:
    """{"eval/<task>/<metric>": value} of lm-eval's results, without standard errors.

    A filter other than lm-eval's "none" joins the metric's name.
    """
    out = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            metric, _, filt = key.partition(",")
            if not filt or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            out[f"eval/{task}/{metric if filt == 'none' else metric + '/' + filt}"] = float(value)
    return out


def evals_path(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, "evals", f"{step}.json")


def save(path: str, step: int | None, results: dict, about: dict, samples: bool = False) -> None:
    """Writes the results to `path` (atomically: a reader never sees half of it).

    `samples`: lm-eval's per-request records beside it, as <path without .json>.samples.json.
    """
    from lm_eval.utils import handle_non_serializable  # deferred: lm-eval (~1 s), when a command evaluates

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    record = {"step": step, **about, **{k: results[k] for k in SAVED if k in results}}
    stem = path[: -len(".json")] if path.endswith(".json") else path
    items = [(path, record)] + ([(stem + ".samples.json", results["samples"])] if samples else [])
    for where, value in items:
        tmp = where + ".tmp"
        with open(tmp, "w") as f:
            json.dump(value, f, indent=1, default=handle_non_serializable)
        os.replace(tmp, where)


def table(results: dict) -> str:
    """lm-eval's own table of the results (task, filter, n-shot, metric, value, stderr)."""
    from lm_eval.utils import make_table  # deferred: lm-eval (~1 s), when a command evaluates

    return make_table(results)


def read_evals(run_dir: str) -> list[tuple[int, dict[str, float]]]:
    """(step, scores) of every evals/<step>.json of a run, in step order."""
    out = []
    for path in glob.glob(os.path.join(run_dir, "evals", "*.json")):
        name = os.path.basename(path)[: -len(".json")]
        if name.isdigit():
            with open(path) as f:
                out.append((int(name), scores(json.load(f))))
    return sorted(out, key=lambda item: item[0])
