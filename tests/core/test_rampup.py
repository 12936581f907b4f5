"""train.batch_rampup (jaxpar/core/data/rampup.py).

Megatron's rule for the batch size of each step, the samples a step reads, and one line for a ramp-up that cannot run.
"""

import numpy as np
import pytest

from jaxpar.core.config.schema import load_config
from jaxpar.core.data.order import GlobalBatches, Samples
from jaxpar.core.errors import UserError
from jaxpar.core.data.rampup import BatchSizes
from tests.helpers import TINY, make_dataset


def test_the_batch_grows_by_the_samples_read():
    # 8 -> 32 by 8 over 96 samples: three increments, one per 32 samples read (Megatron's rampup_batch_size)
    sizes = BatchSizes(32, "8,8,96")
    assert [sizes.size(k) for k in range(10)] == [8, 8, 8, 8, 16, 16, 24, 24, 32, 32]
    assert [sizes.first(k) for k in range(10)] == [0, 8, 16, 24, 32, 48, 64, 88, 112, 144]
    assert sizes.sizes == [8, 16, 24, 32] and BatchSizes(32).sizes == [32]
    assert sizes.first(1000) == 112 + 992 * 32


def test_a_step_reads_the_samples_after_those_read_before_it(tmp_path):
    samples = Samples(make_dataset(tmp_path / "d.bin", n_tokens=4000), 16, seed=0)
    data = GlobalBatches(samples, 8, sizes=BatchSizes(8, "2,2,12"))
    read = [data.global_batch(k) for k in range(6)]
    assert [len(b) for b in read] == [2, 2, 4, 6, 8, 8]  # one increment per 4 samples read: 0, 2 | 4 | 8 | 14
    stream = np.concatenate(read)
    assert (stream == np.stack([samples[i] for i in range(len(stream))])).all()  # no sample skipped or repeated
    assert (data.rows(3, 1, 3) == read[3][1:3]).all()


@pytest.mark.parametrize(
    "spec,phrase",
    [
        ("8,8", "not START,INCREMENT,SAMPLES"),
        ("8,5,64", "INCREMENT 5 does not divide train.global_batch_size - START = 24"),
        ("32,8,64", "START below train.global_batch_size=32"),
        ("8,0,64", "INCREMENT, SAMPLES >= 1"),
        ("6,2,64", "multiples of train.microbatches=4"),
    ],
)
def test_a_ramp_that_cannot_run_gets_one_line(spec, phrase):
    with pytest.raises(UserError, match=phrase):
        load_config(None, [*TINY, "train.global_batch_size=32", "train.microbatches=4", f"train.batch_rampup={spec}"])


def test_every_batch_size_of_the_ramp_must_fit_the_mesh():
    import jax

    from jaxpar.layout import Layout
    from jaxpar.mesh import make_mesh

    cfg = load_config(None, [*TINY, "train.batch_rampup=2,2,16"])
    with pytest.raises(
        UserError,
        match=r"train.batch_rampup=2,2,16, at a batch of 2 x 16 tokens: "
        r"batch per microbatch 2 .* "
        r"not divisible by the data axes dp\*fsdp\*ep=4",
    ):
        Layout(cfg, make_mesh({"dp": 4}, jax.devices()[:4]))


def test_a_resume_keeps_the_keys_that_decide_each_steps_batch():
    from jaxpar.core.run.resume import must_match

    assert all(map(must_match, ("train.batch_rampup", "data.batching", "data.buckets", "train.tokens_per_batch")))
