"""Score a torchpar model on benchmark tasks with EleutherAI's lm-evaluation-harness.

    python -m torchpar.eval --run runs/torchpar/gpt2-tiny --tasks hellaswag,arc_easy [--num-fewshot 0 --limit N]
    torchrun --nproc-per-node 2 -m torchpar.eval --run-dir RUN --tasks ...   (torchrun takes --run for itself)

The model: the latest checkpoint of a none / ddp / fsdp run (`--run`, loaded whole on each process: DCP reshards;
results in RUN/evals/<step>.json) or a shared-weights file (`--weights`, e.g. written by jaxpar; needs --output).
Each process holds the whole model; under torchrun lm-eval gives each rank its share of the requests and gathers the
scores on rank 0, which writes them. --tasks as in python -m jaxpar.eval (jaxpar/core/evaluation/tasks.py).
"""

from __future__ import annotations

import sys

import torch.distributed as torch_dist

from jaxpar.core.errors import cli
from jaxpar.core.evaluation.cli import check_eval_args, eval_parser, report, run_tasks
from torchpar import dist
from torchpar.generate import SOURCES, load_model
from torchpar.scoring import TorchLM, TorchScorer


def parse_args(argv):
    return eval_parser("python -m torchpar.eval", __doc__, SOURCES).parse_args(argv)


@cli(rank=lambda: dist.launch_env()[0])  # a refusal every rank meets: rank 0's line alone
def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    tasks = check_eval_args(args)
    model, tokenizer, step = load_model(args, "evaluate")
    step = step if args.run else None  # a weights file has no step
    env = dist.init(dist.launch_env()[1] > 1, 600.0)  # the process group lm-eval gathers over, under torchrun
    lm = TorchLM(TorchScorer(model.eval()), tokenizer, args.batch_size, env)
    results = run_tasks(lm, tasks, args.num_fewshot, args.limit, args.gen_kwargs, args.log_samples)
    if env.is_main:
        report(
            results, args, step, {"framework": "torchpar", "model": args.run or args.weights, "processes": env.world}
        )
    if torch_dist.is_initialized():
        torch_dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
