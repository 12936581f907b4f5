"""A training run: the loop both trainers share, its hooks, the run directory, resume, recovery, peers, signals."""
