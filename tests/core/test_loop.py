"""The shared loop with a trainer made of sleeps: what it reports about where a step's time went."""

import json
import time

from jaxpar.core.run.metrics import MetricsLog
from jaxpar.core.data.prefetch import Prefetch
from jaxpar.core.run.loop import train_loop

from tests.helpers import tiny_config


class OneProcess:
    """The process group of a one-process run: nothing to agree on."""

    def any_of(self, flag):
        return flag

    def rejoined_at(self):
        return None


class SleepyProbes:
    """The measurements: the read-ahead's wait, a fixed memory, no peak FLOP/s (no MFU)."""

    def __init__(self, prefetch):
        self.prefetch = prefetch

    def data_wait_s(self):
        return self.prefetch.waited_s

    def peak_flops(self):
        return None

    def record_extra(self):
        return {}

    def memory(self):
        return {"memory_in_use_gib": 1.5, "memory_gib": 2.0}


class NoCollectives:
    """One device: no collectives to profile (jaxpar/core/run/stragglers.py)."""

    def comm_axes(self):
        return []


class NoFaults:
    """No <PREFIX>_FAULT_* variable names this prefix: no test faults."""

    prefix = "NOBODY"


class SleepyTrainer:
    """Reading a batch takes 60 ms (read ahead through the trainers' Prefetch), the step 10 ms.

    The host waits on data for the 50 ms the read-ahead is behind, 5/6 of each step.
    """

    process_count, rank, train_data, is_main = 1, 0, None, True

    def __init__(self):
        self.prefetch = Prefetch(lambda step: time.sleep(0.06) or step)
        self.processes, self.probes, self.profiling = OneProcess(), SleepyProbes(self.prefetch), NoCollectives()
        self.faults = NoFaults()

    def train_step(self, step):
        assert self.prefetch(step) == step
        time.sleep(0.01)
        return {"loss": 1.0, "grad_norm": 1.0, "lr": 0.1}

    def fetch(self, handle):
        return handle

    def save(self, step):
        pass


def test_records_say_how_much_of_a_step_was_waiting_for_data(tmp_path):
    cfg = tiny_config(
        "train.steps=8", "train.log_every=4", "train.eval_every=0", "checkpoint.every=0", f"run.dir={tmp_path}"
    )
    fw = SleepyTrainer()
    fw.evaluate = lambda batches: 0.0
    log = MetricsLog(str(tmp_path), True, 8)
    assert train_loop(cfg, fw, 0, log, stop={}) == 8
    log.close()
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in records] == [4, 8]
    for r in records:
        assert 0.6 < r["data_wait_share"] < 0.95, r  # (60 - 10) / 60 ms, less with the loop's own overhead
        assert r["memory_in_use_gib"] == 1.5 and r["memory_gib"] == 2.0


class Healing(OneProcess):
    """torchft's heal: after its third step the loop continues from step 6, a live group's."""

    def __init__(self):
        self.calls = 0

    def rejoined_at(self):
        self.calls += 1
        return 6 if self.calls == 3 else None


def test_a_heal_ahead_counts_only_the_steps_run(tmp_path):
    """The steps a heal jumps over are not counted as trained: a record's step time is a step's, not a share of one."""
    cfg = tiny_config(
        "train.steps=8", "train.log_every=1", "train.eval_every=0", "checkpoint.every=0", f"run.dir={tmp_path}"
    )
    fw = SleepyTrainer()
    fw.processes, fw.evaluate = Healing(), lambda batches: 0.0
    log = MetricsLog(str(tmp_path), True, 8)
    assert train_loop(cfg, fw, 0, log, stop={}) == 8
    log.close()
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in records] == [1, 2, 6, 7, 8]
    assert all(r["step_time_s"] > 0.04 for r in records), records  # 60 ms a step; 15 ms if 4 were counted
