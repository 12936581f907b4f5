"""torchpar's model and weight layout against jaxpar's (in-process, float32), and the DeepSpeed config merge."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxpar.core.weights.names import flatten, load_weights, save_weights, unflatten
from jaxpar.models.decoder import Decoder as JaxGPT
from jaxpar.loss import loss_fn as jax_loss
from jaxpar.models.decoder import abstract_model
from tests.helpers import tiny_config
from jaxpar.core.weights.names import NAMES, shared_name
from torchpar.weights import from_shared, shared_shapes, to_shared
from torchpar.parallelize import checkpoint_blocks
from torchpar.models.decoder import Decoder, next_token_loss
from torchpar.optim import decays


@pytest.fixture(scope="module")
def cfg():
    return tiny_config()


def test_layout_matches_jaxpar_names_and_shapes(cfg):
    _, _, abstract = abstract_model(cfg.model)
    jax_shapes = {k: tuple(v.shape) for k, v in _flat_abstract(abstract).items()}
    assert shared_shapes(cfg.model) == jax_shapes
    model = Decoder(cfg.model)
    assert {shared_name(n) for n, _ in model.named_parameters()} == set(NAMES)


def _flat_abstract(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        out.update(_flat_abstract(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def test_round_trip_is_lossless(cfg, tmp_path):
    model = Decoder(cfg.model)
    model.init_weights(0)
    path = str(tmp_path / "w.safetensors")
    save_weights(path, unflatten(to_shared(model.state_dict(), cfg.model.n_layer)))
    flat = load_weights(path, shared_shapes(cfg.model))  # jaxpar's own loader and checks
    again = Decoder(cfg.model)
    again.load_state_dict(from_shared(flat, cfg.model.n_layer))
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name


def test_init_distribution(cfg):
    model = Decoder(cfg.model)
    model.init_weights(0)
    shared = to_shared(model.state_dict(), cfg.model.n_layer)
    std, proj = cfg.model.init_std, cfg.model.init_std / np.sqrt(2 * cfg.model.n_layer)
    for name, value in shared.items():
        if name.endswith("scale"):
            assert np.all(value == 1), name
        elif name.endswith("bias"):
            assert np.all(value == 0), name
        else:
            expected = proj if name in ("blocks.attn.out.kernel", "blocks.mlp.proj.kernel") else std
            assert abs(value.std() / expected - 1) < 0.1 and abs(value.mean()) < expected / 5, name


def test_weight_decay_mask_is_jaxpars(cfg):
    no_decay = {n for n, _ in Decoder(cfg.model).named_parameters() if not decays(n)}
    assert no_decay == {n for n, _ in Decoder(cfg.model).named_parameters() if n.endswith("bias") or "ln" in n}


@pytest.fixture(scope="module")
def jax_reference(cfg):
    """jaxpar's loss and gradients for one batch, from torchpar-initialised weights.

    float32 at highest matmul precision (jitted once), with torchpar-initialised weights loaded into jaxpar's model
    through the shared weight format.
    """
    torch_model = Decoder(cfg.model)
    torch_model.init_weights(0)
    params = to_shared(torch_model.state_dict(), cfg.model.n_layer)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: JaxGPT(cfg.model, nnx.Rngs(0))))
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, unflatten(params)))
    model = nnx.merge(graphdef, state)
    batch = np.random.default_rng(0).integers(0, 256, (4, cfg.data.seq_len + 1)).astype(np.int32)
    with jax.default_matmul_precision("highest"):
        loss, grads = nnx.jit(nnx.value_and_grad(lambda m, b: jax_loss(m, b)))(model, jnp.asarray(batch))
    return params, batch, float(loss), {k: np.asarray(v) for k, v in flatten(nnx.to_pure_dict(grads)).items()}


@pytest.mark.parametrize("remat", ["none", "full", "save_matmuls"])
def test_same_loss_and_gradients_as_jaxpar(remat, jax_reference):
    params, batch, jloss, jgrads = jax_reference
    cfg = tiny_config(f"model.remat={remat}")
    model = Decoder(cfg.model)
    model.load_state_dict(from_shared(params, cfg.model.n_layer))
    checkpoint_blocks(model, remat)  # as torchpar/parallelize.py applies model.remat
    tbatch = torch.from_numpy(batch).long()
    loss = next_token_loss(model(tbatch[:, :-1]), tbatch[:, 1:])
    loss.backward()
    np.testing.assert_allclose(loss.item(), jloss, rtol=1e-6)
    grads = to_shared({n: p.grad for n, p in model.named_parameters()}, cfg.model.n_layer)
    diff = np.sqrt(sum(np.sum((grads[k] - v) ** 2) for k, v in jgrads.items()))
    total = np.sqrt(sum(np.sum(v**2) for v in jgrads.values()))
    assert diff / total < 1e-5


def test_bfloat16_forward_keeps_float32_logits():
    cfg = tiny_config("model.compute_dtype=bfloat16")
    model = Decoder(cfg.model)
    model.init_weights(0)
    logits = model(torch.zeros(2, 8, dtype=torch.long))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_deepspeed_config_generated_and_merged(cfg, tmp_path):
    pytest.importorskip("deepspeed")
    from torchpar.backends.deepspeed import generated_config, merge

    c = tiny_config(
        "train.microbatches=2",
        "parallel.zero_stage=3",
        "model.compute_dtype=bfloat16",
        "parallel.offload=params+optimizer",
    )
    gen = generated_config(c, world=2)
    assert gen["train_batch_size"] == 8 and gen["train_micro_batch_size_per_gpu"] == 2
    assert gen["gradient_accumulation_steps"] == 2 and gen["zero_optimization"]["stage"] == 3
    assert gen["zero_optimization"]["offload_param"] == {"device": "cpu"} and gen["bf16"]["enabled"]
    user = {"zero_optimization": {"stage": 2}, "fp16": {"enabled": True, "loss_scale": 0}}
    merged = merge(gen, user)
    assert merged["zero_optimization"]["stage"] == 2  # the user's value wins...
    assert merged["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}  # ...only where it speaks
    assert merged["fp16"] == {"enabled": True, "loss_scale": 0} and merged["gradient_clipping"] == c.optim.grad_clip
    # float16: DeepSpeed's dynamic scaler from the shared keys (65536 = 2^16, window = growth interval)
    fp16 = generated_config(
        tiny_config("model.compute_dtype=float16", "optim.loss_scale_growth_interval=7", "optim.loss_scale_min=4"),
        world=2,
    )["fp16"]
    assert fp16 == {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 16,
        "hysteresis": 1,
        "loss_scale_window": 7,
        "min_loss_scale": 4.0,
    }
