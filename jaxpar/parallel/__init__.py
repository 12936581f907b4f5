"""Parallelism that needs manual control (jax.shard_map + collectives), one technique per file, and expert dispatch."""
