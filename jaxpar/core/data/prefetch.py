"""Read the next training batch ahead, on a background thread, while the current step runs (both trainers).

A batch depends on its step alone (core/data/order.py), so reading ahead never changes what a step sees;
a step that was not the one read ahead (a resume, an evaluation) is simply fetched in place.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable


class Prefetch:
    """`waited_s`: the seconds callers have spent waiting for their batch (the loop's data_wait_share)."""

    def __init__(self, fetch: Callable[[int], Any]):
        self.fetch, self.pool, self.ahead = fetch, ThreadPoolExecutor(1, thread_name_prefix="prefetch"), None
        self.waited_s = 0.0

    def __call__(self, step: int):
        t0 = time.perf_counter()
        hit = self.ahead is not None and self.ahead[0] == step
        batch = self.ahead[1].result() if hit else self.fetch(step)
        self.waited_s += time.perf_counter() - t0
        self.ahead = (step + 1, self.pool.submit(self.fetch, step + 1))
        return batch

    def close(self) -> None:
        self.pool.shutdown(wait=True)
