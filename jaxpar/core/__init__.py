"""The shared core: what jaxpar and torchpar both read. Imports neither jax nor torch (a test checks).

config.py (the schema) and contract.py (who consumes each key), errors.py, faults.py (the test-fault hook),
lr_schedule.py, flops.py (FLOP and parameter counts by formula), pipeline_schedules.py, tokens.py, corpus.py and
bpe.py (token files, corpora, a BPE), data_order.py, weights.py (the weight-name table), sketches.py, loop.py (the
training loop) and run.py (the run sequence of both trainers) with metrics_log.py, trackers.py, peers.py and prefetch.py, resume.py (run
directories), mesh_spec.py, bench_records.py, sampling_cli.py, malloc.py (the CLIs' allocator setting).
"""
