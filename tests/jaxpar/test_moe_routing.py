"""DeepSeek-V3's group-limited routing and routed scale in both frameworks.

model.moe_n_group, moe_topk_group, moe_routed_scale (jaxpar/models/moe.py and torchpar/models/moe.py route): both
frameworks' choices and weights against transformers' DeepseekV3TopkRouter, the settings the experts cannot hold
refused, an expert layout against one device, and jaxpar's loss and gradients against torchpar's.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.core.errors import UserError
from jaxpar.models.moe import route
from tests.helpers import assert_params_close, run_steps, tiny_config
from tests.jaxpar.test_moe import MOE


# DeepSeek-V3's routing (model.moe_n_group, moe_topk_group, moe_routed_scale): 16 experts in 4 groups of 4, the
# best 2 groups kept, top 4 among their 8 experts, sigmoid scores, the weights normalised then scaled by 2.5
GROUPED = (
    "model.moe_experts=16",
    "model.moe_top_k=4",
    "model.moe_n_group=4",
    "model.moe_topk_group=2",
    "model.moe_router=sigmoid",
    "model.moe_routed_scale=2.5",
)


def _hf_route(logits, bias, cfg):
    """transformers' DeepseekV3TopkRouter (the oracle of HF conversion) on router logits.

    An identity router weight makes its logits the hidden states. -> (ids, weights) [T, k], each token's sorted by
    expert id.
    """
    import torch
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    E = cfg.moe_experts
    hf = DeepseekV3TopkRouter(
        DeepseekV3Config(
            hidden_size=E,
            n_routed_experts=E,
            num_experts_per_tok=cfg.moe_top_k,
            n_group=cfg.moe_n_group,
            topk_group=cfg.moe_topk_group,
            norm_topk_prob=cfg.moe_norm_topk,
            routed_scaling_factor=cfg.moe_routed_scale,
        )
    )
    with torch.no_grad():
        hf.weight.copy_(torch.eye(E))
        hf.e_score_correction_bias.copy_(torch.as_tensor(bias))
        _, weights, ids = hf(torch.as_tensor(logits))
    order = ids.argsort(-1)
    return ids.gather(-1, order).numpy(), weights.gather(-1, order).numpy()


def _framework_route(framework, logits, bias, cfg):
    """-> (ids, weights) [T, k] of jaxpar's or torchpar's route, each token's sorted by expert id."""
    if framework == "jaxpar":
        ids, weights = (np.asarray(a)[0] for a in route(jnp.asarray(logits)[None], cfg, None, jnp.asarray(bias))[:2])
    else:
        import torch
        from torchpar.models.moe import route as torch_route

        out = torch_route(torch.as_tensor(logits)[None], cfg, torch.as_tensor(bias))
        ids, weights = (a[0].numpy() for a in out[:2])
    order = np.argsort(ids, -1)
    return np.take_along_axis(ids, order, -1), np.take_along_axis(weights, order, -1)


@pytest.mark.parametrize("framework", ["jaxpar", "torchpar"])
@pytest.mark.parametrize("norm", ["true", "false"])
def test_group_limited_routing_is_hf_deepseek_v3s(framework, norm):
    """64 tokens' random logits and balance bias.

    The experts chosen and their weights are HF's router's. Ignoring the groups would choose otherwise (checked on
    this input), ignoring the scale would weigh 2.5x less.
    """
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, 16)).astype(np.float32)
    bias = (0.1 * rng.normal(size=16)).astype(np.float32)
    cfg = tiny_config(*GROUPED, f"model.moe_norm_topk={norm}").model
    ids, weights = _framework_route(framework, logits, bias, cfg)
    want_ids, want_weights = _hf_route(logits, bias, cfg)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_weights, rtol=1e-6)
    assert len({tuple(np.unique(i // 4)) for i in ids}) > 1 and all(len(np.unique(i // 4)) <= 2 for i in ids)
    ungrouped = tiny_config(*GROUPED, f"model.moe_norm_topk={norm}", "model.moe_n_group=1", "model.moe_topk_group=1")
    assert np.mean(np.any(_framework_route(framework, logits, bias, ungrouped.model)[0] != ids, -1)) > 0.2
    unscaled = tiny_config(*GROUPED, f"model.moe_norm_topk={norm}", "model.moe_routed_scale=1.0").model
    np.testing.assert_allclose(_framework_route(framework, logits, bias, unscaled)[1] * 2.5, weights, rtol=1e-6)
    if norm == "true":
        np.testing.assert_allclose(weights.sum(-1), 2.5, rtol=1e-6)


@pytest.mark.parametrize(
    "setting,named",
    [
        ("model.moe_n_group=3", "model.moe_n_group=3 does not divide model.moe_experts=16"),
        ("model.moe_topk_group=5", "model.moe_topk_group=5 exceeds model.moe_n_group=4"),
        ("model.moe_n_group=16", "leaves one expert per group"),
        ("model.moe_top_k=9", "model.moe_top_k=9 exceeds the 8 experts of the model.moe_topk_group=2 groups kept"),
        ("model.moe_routed_scale=0", "model.moe_routed_scale"),
    ],
)
def test_group_settings_the_experts_cannot_hold_are_refused(setting, named):
    with pytest.raises(UserError, match=re.escape(named)):
        tiny_config(*GROUPED, setting)


# the balance bias beside the groups: a group's score counts it, as DeepSeek-V3's (and HF's) router does
GROUPED_RUN = (*GROUPED, "model.moe_top_k=2", "model.moe_bias_update=0.001", "train.steps=10")


def test_grouped_routing_on_an_expert_layout_equals_one_device(dataset):
    ref = run_steps(tiny_config(*MOE, *GROUPED_RUN), "dp=1", dataset, devices=jax.devices()[:1])
    got = run_steps(tiny_config(*MOE, *GROUPED_RUN), "dp=2,ep=2", dataset, devices=jax.devices()[:4])
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5)
    np.testing.assert_allclose(got["moe_max_load"], ref["moe_max_load"], rtol=1e-5)
    assert ref["loss"][-1] < ref["loss"][0] - 0.3
    assert_params_close(got["params"], ref["params"])


def test_grouped_routing_gives_both_frameworks_the_same_loss_and_gradients():
    """The same weights (a random balance bias included) and rows.

    jaxpar's loss, gradients and expert statistics are torchpar's; without the groups and the scale the loss is
    another.
    """
    import torch
    from flax import nnx

    from jaxpar.core.weights.names import flatten
    from jaxpar.loss import loss_fn
    from jaxpar.models.decoder import Decoder
    from torchpar.models.decoder import Decoder as TorchDecoder, inputs_and_targets
    from torchpar.models.moe import balance_loss
    from torchpar.weights import from_shared, to_shared

    cfg = tiny_config(*MOE[:-3], *GROUPED_RUN, "model.moe_top_k=3")
    graphdef, params = nnx.split(Decoder(cfg.model, nnx.Rngs(0)), nnx.Param)
    pure = params.to_pure_dict()
    bias = pure["blocks"]["moe"]["router"]["bias"]
    pure["blocks"]["moe"]["router"]["bias"] = jnp.asarray(
        0.05 * np.random.default_rng(1).normal(size=bias.shape), jnp.float32
    )
    nnx.replace_by_pure_dict(params, pure)
    batch = jnp.asarray(np.random.default_rng(0).integers(1, 256, (8, 17)), jnp.int32)
    with jax.default_matmul_precision("highest"):
        (loss, stats), grads = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p), batch), has_aux=True)(
            params
        )
        plain = tiny_config(
            *MOE[:-3],
            *GROUPED_RUN,
            "model.moe_top_k=3",
            "model.moe_n_group=1",
            "model.moe_topk_group=1",
            "model.moe_routed_scale=1.0",
        ).model
        other, other_stats = loss_fn(nnx.merge(nnx.split(Decoder(plain, nnx.Rngs(0)), nnx.Param)[0], params), batch)
    assert abs(float(other) - float(loss)) > 3e-6 * float(loss)  # measured 1.5e-5; the check below: 1e-6
    moved = np.abs(np.asarray(other_stats) - np.asarray(stats))[:-2].sum() / 2  # each moved choice counts twice
    assert moved > 25  # of the 768 choices (measured: 65)
    twin = TorchDecoder(cfg.model)
    twin.load_state_dict(
        from_shared({k: np.asarray(v) for k, v in flatten(params.to_pure_dict()).items()}, cfg.model.n_layer)
    )
    got = twin(*inputs_and_targets(torch.as_tensor(np.asarray(batch), dtype=torch.long)))
    got = got + balance_loss(twin, twin.expert_stats)
    got.backward()
    assert got.item() == pytest.approx(float(loss), rel=1e-6)
    got_stats = twin.expert_stats.detach().sum(0).numpy()
    np.testing.assert_array_equal(got_stats[:-1], np.asarray(stats)[:-1])  # each layer's choices per expert, drops
    np.testing.assert_allclose(got_stats[-1], np.asarray(stats)[-1], rtol=1e-6)
    got_grads = to_shared({k: p.grad for k, p in twin.named_parameters() if p.grad is not None}, cfg.model.n_layer)
    for name, g in flatten(grads.to_pure_dict()).items():
        if name in got_grads:
            np.testing.assert_allclose(got_grads[name], g, rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("setting", [{"moe_n_group": 4, "moe_topk_group": 2}, {"moe_routed_scale": 2.5}])
def test_mixtral_export_refuses_expert_groups_and_a_scale(setting, tmp_path):
    from jaxpar.formats.hf_mixtral import shared_to_hf

    with pytest.raises(UserError, match="moe_n_group, moe_routed_scale"):
        shared_to_hf({}, str(tmp_path), setting)
