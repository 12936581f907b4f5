"""Score a jaxpar model on benchmark tasks with EleutherAI's lm-evaluation-harness.

python -m jaxpar.eval --run runs/jaxpar/gpt2-tiny --tasks hellaswag,arc_easy [--num-fewshot 0 --limit N --mesh tp=4]

The model: the latest checkpoint of a jaxpar run (`--run`, with its tokenizer; results in RUN/evals/<step>.json), a
shared-weights file (`--weights`) or a Hugging Face directory that convert reads (`--hf`); those two need --output.
--tasks names lm-eval tasks (lm-eval downloads their data where a network exists), task YAML files or folders of them
(--include-path; offline), or text files scored for perplexity (jaxpar/core/evaluation/tasks.py). jaxpar is one
process to lm-eval and scores on any dp / fsdp / tp mesh, so a model larger than one device is evaluated sharded.
"""

from __future__ import annotations

import sys

from jaxpar.core.config.mesh_spec import parse_mesh
from jaxpar.core.errors import UserError, cli
from jaxpar.core.evaluation.cli import check_eval_args, eval_parser, report, run_tasks
from jaxpar.core.evaluation.harness import ProjectLM
from jaxpar.core.run.directory import check_framework
from jaxpar.core.weights.names import unflatten
from jaxpar.generate import SOURCES, load, restore_params
from jaxpar.mesh import make_mesh, setup_devices

DECODING_AXES = ("dp", "fsdp", "tp")


def parse_args(argv):
    p = eval_parser("python -m jaxpar.eval", __doc__, SOURCES)
    p.add_argument("--mesh", default="dp=1", help="dp / fsdp / tp axes (default dp=1)")
    return p.parse_args(argv)


def check_mesh(mesh: str) -> dict[str, int]:
    sizes = parse_mesh(mesh)
    other = [f"{a}={n}" for a, n in sizes.items() if n > 1 and a not in DECODING_AXES]
    if other:
        raise UserError(f"--mesh {mesh}: evaluation runs on dp / fsdp / tp axes only, not {', '.join(other)}")
    return sizes


def scorer_of(args, sizes: dict):
    """(Scorer, tokenizer, step) of the weights the user named, on the mesh `sizes` (step: None but for a run)."""
    import jax  # deferred: jax (~1 s), after setup_devices

    from jaxpar.layout import Layout  # deferred: imports jax, after setup_devices
    from jaxpar.scoring import JaxScorer  # deferred: imports jax, after setup_devices

    cfg, flat, tokenizer = load(args)
    layout = Layout(cfg, make_mesh(sizes))
    params, step = restore_params(args.run, layout) if flat is None else (unflatten(flat), None)
    params = jax.device_put(params, layout.device_shardings["params"])  # once, in device memory
    return JaxScorer(layout, lambda: params, args.batch_size), tokenizer, step


@cli
def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    sizes = check_mesh(args.mesh)
    tasks = check_eval_args(args)
    if args.run:
        check_framework(args.run, "jaxpar", "evaluate")
    setup_devices(sizes)  # before anything starts jax (reading a run's checkpoint does)
    scorer, tokenizer, step = scorer_of(args, sizes)
    lm = ProjectLM(scorer, tokenizer, args.batch_size)
    results = run_tasks(lm, tasks, args.num_fewshot, args.limit, args.gen_kwargs, args.log_samples)
    about = {"framework": "jaxpar", "model": args.run or args.weights or args.hf, "mesh": args.mesh}
    report(results, args, step, about)
    return 0


if __name__ == "__main__":
    sys.exit(main())
