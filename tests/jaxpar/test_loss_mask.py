"""Fine-tuning data's loss mask (tests/helpers.make_sft_dataset).

The loss is the mean cross-entropy over the response targets of the whole batch, in jaxpar and torchpar, however the
batch is split over devices and microbatches.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxpar.core.data.order import Samples, unmasked
from jaxpar.core.config.mesh_spec import parse_mesh
from jaxpar.core.weights.names import flatten
from jaxpar.data import TokenBatches
from jaxpar.loss import split_rows, token_share
from jaxpar.models.decoder import Decoder
from jaxpar.models.head import cross_entropy
from tests.helpers import make_sft_dataset, run_steps, tiny_config
from torchpar.models.decoder import Decoder as TorchDecoder, inputs_and_targets, next_token_loss
from torchpar.weights import from_shared

SFT = ("data.seq_len=16", "data.document_mask=true", "train.steps=6")


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    return make_sft_dataset(tmp_path_factory.mktemp("sft") / "sft.bin")


def counted_mean(logits: np.ndarray, tokens: np.ndarray, mask: np.ndarray) -> float:
    """The mean cross-entropy over the targets the mask counts, from the file's tokens and mask (numpy)."""
    logp = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    nll = -np.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
    return float(nll[mask[:, 1:] == 1].mean())


def test_the_loss_counts_the_response_targets_alone(sft_data):
    cfg = tiny_config(*SFT)
    batch = TokenBatches(sft_data, 16, 8, seed=0).global_batch(0)
    tokens, mask = unmasked(batch), (batch >= 0).astype(np.uint8)
    file_tokens = np.fromfile(sft_data, np.uint16).reshape(-1, 17)
    assert {tuple(r) for r in tokens} <= {tuple(r) for r in file_tokens}  # rows are windows, read back whole
    assert 0 < mask[:, 1:].sum() < mask[:, 1:].size
    model = Decoder(cfg.model, nnx.Rngs(0))
    rows = split_rows(jnp.asarray(batch), eod=0)
    logits = model(rows.inputs, rows.positions, rows.segments)
    loss = lambda targets: float(cross_entropy(logits, targets) * token_share(jnp.asarray(batch)))
    want = counted_mean(np.asarray(logits, np.float64), tokens, mask)
    assert loss(rows.targets) == pytest.approx(want, rel=1e-5)

    prompt = tuple(np.argwhere(mask[:, 1:] == 0)[0])  # a target the loss skips, and one it counts
    response = tuple(np.argwhere(mask[:, 1:] == 1)[0])
    other = lambda t: (t + 1) % 256
    skipped = rows.targets.at[prompt].set(~other(tokens[:, 1:][prompt]))  # still skipped, another token
    assert loss(skipped) == loss(rows.targets)
    assert loss(rows.targets.at[response].set(other(tokens[:, 1:][response]))) != pytest.approx(want, rel=1e-4)

    # torchpar: the same loss from the same weights and rows
    twin = TorchDecoder(cfg.model, 0)
    twin.load_state_dict(
        from_shared(
            {k: torch.tensor(np.asarray(v)) for k, v in flatten(nnx.state(model, nnx.Param).to_pure_dict()).items()},
            cfg.model.n_layer,
        )
    )
    inputs, targets = inputs_and_targets(torch.from_numpy(batch).long())
    share = targets.numel() / int((targets >= 0).sum())
    with torch.no_grad():
        got = float(next_token_loss(twin.eval()(inputs), targets)) * share
    assert got == pytest.approx(want, rel=1e-5)


@pytest.fixture(scope="module")
def one_device(sft_data):
    return run_steps(tiny_config(*SFT), "dp=1", sft_data, devices=jax.devices()[:1])


@pytest.mark.parametrize(
    "mesh,overrides",
    [
        ("dp=1", ("train.microbatches=2",)),
        ("dp=2", ("train.microbatches=2",)),
        ("pp=2", ("parallel.pipeline_schedule=1f1b",)),
        ("dp=2", ("parallel.grad_compression=powersgd", "parallel.powersgd_warmup_steps=100")),
    ],
    ids=["microbatches", "dp=2-microbatches", "pp=2-1f1b", "dp=2-powersgd"],
)
def test_a_split_batch_weighs_every_counted_target_alike(mesh, overrides, sft_data, one_device):
    """Microbatches and data ranks hold unequal numbers of response targets: a mean per part would differ."""
    n = math.prod(parse_mesh(mesh).values())
    got = run_steps(tiny_config(*SFT, *overrides), mesh, sft_data, devices=jax.devices()[:n])
    np.testing.assert_allclose(got["loss"], one_device["loss"], rtol=1e-5)
    for name, ref in one_device["params"].items():
        np.testing.assert_allclose(got["params"][name], ref, atol=5e-5, rtol=0, err_msg=name)


def test_the_first_loss_is_the_mean_over_the_counted_targets(sft_data, one_device):
    cfg = tiny_config(*SFT)
    batch = Samples(sft_data, 16, 0, val_fraction=cfg.data.val_fraction)
    rows = np.stack([batch[i] for i in range(8)])
    model = Decoder(cfg.model, nnx.Rngs(cfg.train.seed))  # the state init_state draws (seed)
    r = split_rows(jnp.asarray(rows), eod=0)
    logits = np.asarray(model(r.inputs, r.positions, r.segments), np.float64)
    assert one_device["loss"][0] == pytest.approx(counted_mean(logits, unmasked(rows), (rows >= 0) * 1), rel=1e-5)
