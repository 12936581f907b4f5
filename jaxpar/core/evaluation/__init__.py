"""Benchmark evaluation through EleutherAI's lm-evaluation-harness, shared by jaxpar and torchpar.

harness.py   the lm-eval model: lm-eval's request handling over a framework's `Scorer` (log-probs and decoding)
tasks.py     what `--tasks` names: lm-eval's registry, the user's YAML, or a text file scored for perplexity
results.py   evals/<step>.json, the console table and the scores a run's metrics.jsonl records
cli.py       the command line of `python -m jaxpar.eval` and `python -m torchpar.eval`, and the lm-eval call

Nothing here imports jax or torch: each framework supplies its Scorer (jaxpar/scoring.py, torchpar/scoring.py).
"""
