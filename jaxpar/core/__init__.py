"""The shared core: what jaxpar and torchpar both read, free of jax and torch (tests/core/test_structure.py).

config/ (the schema, its checks, who consumes each key, the mesh spec), data/ (tokens, corpora, the data order,
packing, buckets, batch shapes), run/ (the run loop of both trainers, its hooks, resume, recovery, peers, the run
directory), pipeline/ (schedule tables and the automatic choice), optimizer/ (learning rate, Muon, 8-bit AdamW,
DiLoCo rules), model/ (FLOPs, expert rules, shared layer rules), weights/ (weight names, the training-state file);
errors.py (one line per bad input), sampling_cli.py (the samplers' command line), bench_records.py (benchmark rows).
"""
