"""Multi-token prediction (model.mtp_depth, model.mtp_loss_weight).

jaxpar/models/decoder.py MTP, jaxpar/loss.py mtp_rows: the loss against a depth computed by hand, jaxpar against
torchpar from one set of weights (loss and gradients, with packed documents, a loss mask and chunks), every layout
against one device, the weight format and what is refused.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxpar.core.errors import UserError
from jaxpar.core.weights.names import flatten, model_dims
from jaxpar.loss import loss_fn
from jaxpar.models.decoder import Decoder
from tests.helpers import assert_params_close, run_steps, tiny_config
from torchpar.models.decoder import Decoder as TorchDecoder
from torchpar.weights import from_shared, to_shared

MTP = ("model.mtp_depth=2", "model.mtp_loss_weight=0.5")


def _model(*overrides):
    cfg = tiny_config(*MTP, *overrides)
    graphdef, params = nnx.split(Decoder(cfg.model, nnx.Rngs(0)), nnx.Param)
    return cfg, graphdef, params


def _rows(cfg, documents: bool = False, masked: bool = False, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rows = rng.integers(1, cfg.model.vocab_size, (4, cfg.data.seq_len + 1)).astype(np.int32)
    if documents:  # a document starts at each 0 (the byte tokenizer's end-of-document token)
        rows[:, [3, 9]] = 0
        rows[1, 5] = 0
    if masked:  # targets out of the loss: ~token (data_order.Samples)
        rows[:, 4:7] = ~rows[:, 4:7]
    return rows


def _depth_by_hand(model, rows: np.ndarray, d: int, eod=None) -> float:
    """Depth d's cross-entropy written out.

    The embedding of token t+d and the hidden state of depth d-1 (here d=1: the main model's last), both normed,
    projected, the block, the depth's norm and the shared head; a target only where token t+d exists, is counted,
    and (with documents) is in t's document; divided by all positions.
    """
    assert d == 1
    from jaxpar.core.data.order import unmasked
    from jaxpar.ops import document_positions

    inputs, targets = unmasked(rows[:, :-1]), rows[:, 1:]
    B, T = inputs.shape
    positions, segments = (None, None) if eod is None else document_positions(jnp.asarray(inputs), eod)
    ahead = np.zeros_like(inputs)
    ahead[:, :-1] = inputs[:, 1:]

    @jax.jit
    def log_probs(graphdef, params):
        model = nnx.merge(graphdef, params)
        h = model.run_blocks(model.embed(jnp.asarray(inputs), positions), positions, segments)
        norm_emb, norm_hidden, kernel, block, norm_out = model.mtp.depth(1)
        e = model.wte[...][ahead]
        z = jnp.einsum("btd,de->bte", norm_emb(e), kernel[0]) + jnp.einsum("btd,de->bte", norm_hidden(h), kernel[1])
        out = norm_out(block(z, jnp.float32, positions, segments)[0])
        return jax.nn.log_softmax(jnp.einsum("btd,vd->btv", out, model.wte[...]), axis=-1)

    logp = np.asarray(log_probs(*nnx.split(model, nnx.Param)))
    seg = None if segments is None else np.asarray(segments)
    total = 0.0
    for b in range(B):
        for t in range(T - 1):
            target = targets[b, t + 1]
            if target < 0 or (seg is not None and seg[b, t + 1] != seg[b, t]):
                continue
            total -= float(logp[b, t, target])
    return total / (B * T)


@pytest.mark.parametrize("documents", [False, True])
def test_the_loss_adds_the_weighted_mean_of_the_depths(documents):
    """Dropping the prediction loss, its weight, a depth, or the documents' mask fails here.

    The total is the main loss plus weight x the mean of the depths, depth 1 equals the loss written out by hand,
    and every prediction module's parameter gets a gradient.
    """
    cfg, graphdef, params = _model()
    rows = jnp.asarray(_rows(cfg, documents, masked=True))
    eod = 0 if documents else None
    (total, aux), grads = jax.jit(
        jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p), rows, eod=eod), has_aux=True)
    )(params)
    main = jax.jit(lambda p: loss_fn(nnx.merge(graphdef, p), rows, eod=eod, balance=False))(params)
    depths = np.asarray(aux["mtp_losses"])
    assert depths.shape == (2,) and np.all(depths > 1.0)
    np.testing.assert_allclose(float(total), float(main) + 0.5 * depths.mean(), rtol=1e-6)
    by_hand = _depth_by_hand(nnx.merge(graphdef, params), np.asarray(rows), 1, eod)
    np.testing.assert_allclose(depths[0], by_hand, rtol=1e-5)
    for name, g in flatten(grads.to_pure_dict()).items():
        if name.startswith("mtp.") and not name.endswith("attn.qkv.bias"):  # (the key bias: no true gradient)
            assert np.abs(np.asarray(g)).max() > 0, name


@pytest.mark.parametrize(
    "overrides", [(), ("model.loss_chunks=4", "model.family=llama", "model.n_kv_head=2")], ids=["gpt2", "llama-chunks"]
)
def test_jaxpar_and_torchpar_agree_from_one_set_of_weights(overrides):
    """jaxpar and torchpar agree on the multi-token loss and gradients from one set of weights.

    Loss, each depth's loss and every gradient within 1e-5 of each other, through the shared weight format (the
    prediction modules' parameters included), with packed documents and a loss mask.
    """
    cfg, graphdef, params = _model(*overrides)
    rows = _rows(cfg, documents=True, masked=True)
    (jloss, aux), jgrads = jax.jit(
        jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p), jnp.asarray(rows), eod=0), has_aux=True)
    )(params)
    flat = {k: np.asarray(v) for k, v in flatten(params.to_pure_dict()).items()}
    assert model_dims(flat)["mtp_depth"] == 2
    twin = TorchDecoder(cfg.model, eod=0)
    twin.load_state_dict(from_shared(flat, cfg.model.n_layer))
    t = torch.from_numpy(rows.astype(np.int64))
    tloss = twin(t[:, :-1] ^ (t[:, :-1] >> 63), t[:, 1:])
    tloss.backward()
    np.testing.assert_allclose(float(tloss.detach()), float(jloss), rtol=1e-5)
    np.testing.assert_allclose(twin.mtp_losses.numpy(), np.asarray(aux["mtp_losses"]), rtol=1e-5)
    tgrads = to_shared({n: p.grad for n, p in twin.named_parameters()}, cfg.model.n_layer)
    jflat = {k: np.asarray(v) for k, v in flatten(jgrads.to_pure_dict()).items()}
    assert set(tgrads) == set(jflat) and any(k.startswith("mtp.") for k in jflat)
    for name, g in jflat.items():
        np.testing.assert_allclose(tgrads[name], g, rtol=1e-5, atol=1e-7, err_msg=name)
    twin.eval()  # evaluation: the main loss alone, as jaxpar's
    main = loss_fn(nnx.merge(graphdef, params), jnp.asarray(rows), eod=0, balance=False)
    with torch.no_grad():
        np.testing.assert_allclose(float(twin(t[:, :-1] ^ (t[:, :-1] >> 63), t[:, 1:])), float(main), rtol=1e-5)


_REFERENCE: dict = {}


def _devices(mesh: str):
    return jax.devices()[: math.prod(int(p.split("=")[1]) for p in mesh.split(","))]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["dp=2", "fsdp=2,tp=2", "sp=2", "pp=2", "ep=2"])
def test_every_layout_equals_one_device(mesh, dataset):
    """The loss, each depth's loss (the metrics' mtp_loss_1, mtp_loss_2) and the parameters after 4 steps.

    sp in zig-zag order (the depths' rows shifted before the permutation), pp on gpipe (the modules after the
    stages), ep with experts in the main blocks.
    """
    experts = ("model.moe_experts=4", "model.moe_top_k=2") if "ep" in mesh else ()
    cfg = tiny_config(*MTP, *experts, "train.steps=4")
    if experts not in _REFERENCE:
        _REFERENCE[experts] = run_steps(cfg, "dp=1", dataset, devices=jax.devices()[:1])
    ref = _REFERENCE[experts]
    pipeline = ("parallel.pipeline_schedule=gpipe",) if "pp" in mesh else ()
    got = run_steps(tiny_config(*MTP, *experts, "train.steps=4", *pipeline), mesh, dataset, devices=_devices(mesh))
    for key in ("loss", "mtp_loss_1", "mtp_loss_2"):
        np.testing.assert_allclose(got[key], ref[key], rtol=1e-5, err_msg=key)
    assert ref["loss"][-1] < ref["loss"][0]
    assert_params_close(got["params"], ref["params"])


@pytest.mark.slow
@pytest.mark.parametrize("compression", ["bf16", "powersgd"])
def test_gradient_compression_carries_the_depths(compression, dataset, monkeypatch):
    """The compressed reductions average each depth's loss over the data ranks as the loss.

    bf16's program with a float32 wire, and PowerSGD within its warm-up (a plain reduction), equal one device.
    """
    from jaxpar.parallel import compression as bf16

    monkeypatch.setattr(bf16, "WIRE", jnp.float32)
    if () not in _REFERENCE:
        _REFERENCE[()] = run_steps(tiny_config(*MTP, "train.steps=4"), "dp=1", dataset, devices=jax.devices()[:1])
    ref = _REFERENCE[()]
    warmup = ("parallel.powersgd_warmup_steps=8",) if compression == "powersgd" else ()
    cfg = tiny_config(*MTP, "train.steps=4", f"parallel.grad_compression={compression}", *warmup)
    got = run_steps(cfg, "dp=2", dataset, devices=jax.devices()[:2])
    for key in ("loss", "mtp_loss_1", "mtp_loss_2"):
        np.testing.assert_allclose(got[key], ref[key], rtol=1e-5, err_msg=key)
    assert_params_close(got["params"], ref["params"])


@pytest.mark.parametrize(
    "schedule",
    [
        "1f1b",
        "zb_v",
        pytest.param("interleaved", marks=pytest.mark.slow),
        pytest.param("zb_h1", marks=pytest.mark.slow),
    ],
)
def test_each_hand_scheduled_pipeline_equals_one_device(schedule, dataset):
    """Multi-token prediction on each hand-scheduled pipeline equals one device.

    The executor's last stage runs the modules after the head (their parameters and the shared table's lookups in
    `rest`, their gradient from that stage): the loss, each depth's loss and the parameters after 3 steps equal one
    device. A last stage that dropped the depths' loss would give another loss (and no mtp.* gradient).
    """
    steps = ("train.steps=3", "model.n_layer=4")  # interleaved and ZB-V: a layer per chunk
    if steps not in _REFERENCE:
        _REFERENCE[steps] = run_steps(tiny_config(*MTP, *steps), "dp=1", dataset, devices=jax.devices()[:1])
    ref = _REFERENCE[steps]
    virtual = ("parallel.pipeline_virtual_stages=2",) if schedule == "interleaved" else ()
    cfg = tiny_config(*MTP, *steps, f"parallel.pipeline_schedule={schedule}", *virtual)
    got = run_steps(cfg, "pp=2", dataset, devices=_devices("pp=2"))
    for key in ("loss", "mtp_loss_1", "mtp_loss_2"):
        np.testing.assert_allclose(got[key], ref[key], rtol=1e-5, err_msg=key)
    assert_params_close(got["params"], ref["params"])


def test_what_is_refused_is_one_line():
    from jaxpar.core.config.contract import Run, check_contract

    with pytest.raises(UserError, match="model.mtp_depth=16 leaves no target"):
        tiny_config("model.mtp_depth=16")
    with pytest.raises(UserError, match="model.mtp_depth"):
        tiny_config("model.mtp_depth=-1")
    with pytest.raises(UserError, match="model.mtp_loss_weight=0.1 has no effect"):
        check_contract(Run(tiny_config("model.mtp_loss_weight=0.1"), "jaxpar"))
    # torchpar's pipeline runs the depths on gpipe/1f1b/interleaved and refuses the rest in one line:
    # tests/torchpar/test_pipeline_mtp.py


def test_hugging_face_formats_refuse_the_modules(tmp_path):
    from jaxpar.tools.convert import write

    cfg, _, params = _model()
    flat = {k: np.asarray(v) for k, v in flatten(params.to_pure_dict()).items()}
    with pytest.raises(UserError, match="no place for multi-token prediction"):
        write("hf", str(tmp_path / "hf"), flat, model_dims(flat))
