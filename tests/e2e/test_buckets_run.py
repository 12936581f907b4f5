"""data.batching=buckets in a run: one compiled step per bucket, and a SIGKILL mid-epoch resumed exactly."""

import re

from tests.helpers import assert_resumes_exactly, make_dataset, metrics, run_cli

BUCKETS = [
    "data.batching=buckets",
    "data.seq_len=32",
    "model.max_seq_len=32",
    "train.tokens_per_batch=256",
    "data.val_fraction=0.1",
]


def test_each_bucket_is_compiled_once(tmp_path):
    dataset = make_dataset(tmp_path / "d.bin", n_tokens=6000, document_length=12)
    r = run_cli(tmp_path / "run", dataset, *BUCKETS, "train.steps=24", "train.eval_every=0", "--mesh", "dp=2")
    assert r.returncode == 0, r.stderr
    later = re.findall(r"batch (\d+) x (\d+): compiled in", r.stderr)  # the first step's shape: the describe line
    shapes = {m["batch_size"] for m in metrics(tmp_path / "run").values()}
    assert len(shapes) == 4 and len(later) == 3 and len({s for s, _ in later}) == 3  # 64x4, 32x8, 16x16, 8x32


def test_a_run_killed_mid_epoch_resumes_exactly(tmp_path):
    dataset = make_dataset(tmp_path / "d.bin", n_tokens=6000, document_length=12)
    assert_resumes_exactly(
        tmp_path, dataset, [*BUCKETS, "train.steps=10", "checkpoint.every=2", "--mesh", "dp=2"], kill_after=5
    )
