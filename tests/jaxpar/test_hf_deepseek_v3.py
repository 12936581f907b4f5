"""Hugging Face DeepseekV3ForCausalLM <-> both frameworks (jaxpar/formats/hf_deepseek_v3.py).

A small random transformers model is the oracle for logits and greedy tokens, through --from hf and back through --to
hf; what the format cannot hold is refused in one line.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.core.errors import UserError
from tests.helpers import assert_both_frameworks_give_hf_answers, assert_hf_round_trip_through_a_jaxpar_run, hf_oracle

# every DeepSeek-V3 part at once: latent attention with interleaved rotary features, a dense first layer, sigmoid
# group-limited routing (4 groups, the best 2 kept), a shared expert, the routed scale, the choice's bias
CONFIG = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    routed_scaling_factor=2.5,
    kv_lora_rank=12,
    q_lora_rank=20,
    qk_rope_head_dim=4,
    v_head_dim=8,
    qk_nope_head_dim=8,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    max_position_embeddings=32,
    rope_theta=500.0,
    tie_word_embeddings=False,
)


# the long-context DeepSeek-V3's YaRN on rows of 24 over an original context of 8, its mscale pair unequal, so that both
# the cos/sin factor (mscale / mscale_all_dim's) and the scores' scale (mscale_all_dim's) act
YARN = dict(
    rope_type="yarn",
    rope_theta=500.0,
    factor=4.0,
    original_max_position_embeddings=8,
    beta_fast=4.0,
    beta_slow=0.5,
    mscale=0.8,
    mscale_all_dim=1.3,
)


def _oracle(path, **changes):
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**CONFIG, **changes})).eval()
    with torch.no_grad():  # weights away from init and norms away from 1: a mixed-up tensor would show
        for name, p in model.named_parameters():
            p.add_(0.3 * torch.randn_like(p)) if "norm" in name else p.mul_(4.0)
        for name, b in model.named_buffers():  # a bias that changes the choice: it must be carried
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn_like(b))
    return hf_oracle(model, path)


@pytest.fixture(scope="module")
def hf_deepseek(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return _oracle(tmp_path_factory.mktemp("hf_deepseek_v3"))


@pytest.fixture(scope="module")
def hf_deepseek_yarn(tmp_path_factory):
    pytest.importorskip("transformers")
    return _oracle(tmp_path_factory.mktemp("hf_deepseek_v3_yarn"), rope_parameters=YARN)


def test_deepseek_v3_yarn_gives_the_oracles_answers_and_round_trips(hf_deepseek_yarn, tmp_path):
    """DeepSeek-V3's YaRN: logits, greedy tokens and a bit-exact round trip.

    Its frequencies on the rotary part, cos and sin scaled by get_mscale(factor, mscale) / get_mscale(factor,
    mscale_all_dim), the scores by get_mscale(factor, mscale_all_dim)^2.
    """
    import transformers

    from jaxpar.core.config.schema import load_config
    from jaxpar.tools.convert import read

    path, tokens, want, greedy = hf_deepseek_yarn
    flat, model = read("hf", str(path))
    get = lambda m: 0.1 * m * np.log(4.0) + 1.0
    assert model["rope_scaling"] == "yarn" and model["rope_mscale_all_dim"] == 1.3
    assert model["rope_attention_factor"] == pytest.approx(get(0.8) / get(1.3), rel=1e-12)
    cfg = load_config(None, [f"model.{k}={v}" for k, v in model.items()] + ["data.seq_len=24"]).model
    assert_both_frameworks_give_hf_answers(flat, cfg, tokens, want, greedy, "DeepSeek-V3 with YaRN")
    assert_hf_round_trip_through_a_jaxpar_run(hf_deepseek_yarn, tmp_path, transformers.DeepseekV3ForCausalLM)


def test_hf_deepseek_v3_logits_and_greedy_tokens_match_both_frameworks(hf_deepseek):
    from jaxpar.core.config.schema import load_config
    from jaxpar.tools.convert import read

    path, tokens, want, greedy = hf_deepseek
    flat, model = read("hf", str(path))
    assert {
        k: model[k]
        for k in (
            "attention",
            "moe_first_dense",
            "moe_experts",
            "moe_shared_experts",
            "moe_router",
            "moe_n_group",
            "moe_topk_group",
            "moe_routed_scale",
            "moe_router_bias",
        )
    } == dict(
        attention="mla",
        moe_first_dense=1,
        moe_experts=8,
        moe_shared_experts=1,
        moe_router="sigmoid",
        moe_n_group=4,
        moe_topk_group=2,
        moe_routed_scale=2.5,
        moe_router_bias=True,
    )
    cfg = load_config(None, [f"model.{k}={v}" for k, v in model.items()] + ["data.seq_len=24"]).model
    assert_both_frameworks_give_hf_answers(flat, cfg, tokens, want, greedy, "DeepSeek-V3")


def test_deepseek_v3_round_trip_through_a_jaxpar_run_is_bit_exact(hf_deepseek, tmp_path):
    import transformers

    assert_hf_round_trip_through_a_jaxpar_run(hf_deepseek, tmp_path, transformers.DeepseekV3ForCausalLM)


def test_ours_to_hf_gives_our_logits_and_greedy_tokens(tmp_path):
    """A model of ours (random weights, a nonzero choice bias, tied embeddings, two shared experts) written --to hf.

    transformers' logits and greedy tokens are ours (jaxpar's and torchpar's).
    """
    import torch
    import transformers
    from flax import nnx

    from jaxpar.core.weights.names import flatten, unflatten
    from jaxpar.decode import make_generate
    from jaxpar.models.decoder import Decoder
    from jaxpar.formats import hf_deepseek_v3
    from tests.helpers import tiny_config
    from torchpar.decode import generate
    from torchpar.models.decoder import Decoder as TorchDecoder
    from torchpar.weights import from_shared

    cfg = tiny_config(*DEEPSEEK).model
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))), nnx.Param)
    rng = np.random.default_rng(0)  # norms near 1, the bias 0.2 wide: it changes choices
    flat = {
        k: (
            (1.0 + 0.3 * rng.standard_normal(v.shape))
            if k.endswith("scale")
            else (0.2 if k.endswith("bias") else 0.08) * rng.standard_normal(v.shape)
        ).astype(np.float32)
        for k, v in flatten(nnx.to_pure_dict(state)).items()
    }
    hf_deepseek_v3.shared_to_hf(flat, str(tmp_path), _settings(cfg))
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 16))
    with jax.default_matmul_precision("highest"):
        ours = np.asarray(
            jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(
                unflatten({k: jnp.asarray(v) for k, v in flat.items()}), jnp.asarray(tokens)
            )
        )
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        theirs = hf(torch.as_tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-5 * max(np.max(np.abs(theirs)), 1.0))
    torch_model = TorchDecoder(cfg)
    torch_model.load_state_dict(from_shared(flat, cfg.n_layer))
    with torch.no_grad():
        np.testing.assert_allclose(
            torch_model(torch.as_tensor(tokens)).numpy(), theirs, atol=1e-5 * max(np.max(np.abs(theirs)), 1.0)
        )
        greedy = hf.generate(torch.as_tensor(tokens[:1, :6]), max_new_tokens=8, do_sample=False)[:, 6:].tolist()
    assert len(set(greedy[0])) > 1, greedy  # a degenerate continuation would prove little
    assert generate(torch_model.eval(), torch.as_tensor(tokens[:1, :6]), 8).tolist() == greedy
    with jax.default_matmul_precision("highest"):
        ours = make_generate(graphdef)(
            unflatten({k: jnp.asarray(v) for k, v in flat.items()}),
            jnp.asarray(tokens[:1, :6]),
            jax.random.key(0),
            new_tokens=8,
            temperature=0.0,
        )
    assert np.asarray(ours).tolist() == greedy


def test_de_interleaved_hf_weights_read_the_same(hf_deepseek, tmp_path):
    """rope_interleave=false (the rotary features of q_b_proj and kv_a_proj_with_mqa already in halves).

    The same transformers model once its rotary rows are in halves, and the same shared tensors.
    """
    import torch
    import transformers
    from safetensors.numpy import load_file, save_file

    from jaxpar.tools.convert import read

    path, tokens, want, _ = hf_deepseek
    raw, k, r, h = (
        load_file(str(path / "model.safetensors")),
        CONFIG["qk_nope_head_dim"],
        CONFIG["qk_rope_head_dim"],
        CONFIG["num_attention_heads"],
    )
    halves = np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)])
    for name, w in raw.items():
        if name.endswith("q_b_proj.weight"):  # [heads x (nope + rope), q_lora]: each head's rope rows
            w = w.reshape(h, k + r, -1)
            raw[name] = np.concatenate([w[:, :k], w[:, k:][:, halves]], axis=1).reshape(h * (k + r), -1)
        elif name.endswith("kv_a_proj_with_mqa.weight"):  # [kv_lora + rope, embed]
            raw[name] = np.concatenate([w[:-r], w[-r:][halves]])
    save_file(raw, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "rope_interleave": False}))
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        np.testing.assert_allclose(hf(torch.as_tensor(tokens)).logits.numpy(), want, atol=1e-5 * np.abs(want).max())
    (a, dims_a), (b, dims_b) = read("hf", str(path)), read("hf", str(tmp_path))
    assert dims_a == dims_b and sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


DEEPSEEK = (
    "model.family=llama",
    "model.attention=mla",
    "model.n_layer=3",
    "model.moe_first_dense=1",
    "model.d_ff=40",
    "model.moe_experts=8",
    "model.moe_d_ff=16",
    "model.moe_shared_experts=2",
    "model.moe_router=sigmoid",
    "model.moe_n_group=2",
    "model.moe_topk_group=1",
    "model.moe_top_k=3",
    "model.moe_routed_scale=1.5",
    "model.moe_router_bias=true",
    "model.layernorm_eps=1e-6",
    "model.q_latent_dim=24",
    "model.kv_latent_dim=16",
    "model.rope_head_dim=8",
    "model.rope_theta=300.0",
    "model.tie_embeddings=true",
    "model.vocab_size=64",
)


def _settings(cfg) -> dict:
    from jaxpar.core.weights.names import SETTINGS

    return {k: getattr(cfg, k) for k in SETTINGS}


@pytest.mark.parametrize(
    "change,message",
    [
        ({"rope_parameters": {"rope_type": "llama3", "factor": 4.0, "rope_theta": 500.0}}, "rope type 'llama3'"),
        ({"q_lora_rank": None}, "q_lora_rank null"),
        ({"v_head_dim": 4}, "v_head_dim=4"),
        ({"rms_norm_eps": 1e-5}, "rms_norm_eps=1e-05"),
        ({"attention_bias": True}, "attention_bias"),
        ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
    ],
)
def test_what_our_model_cannot_hold_is_refused_in_one_line(hf_deepseek, tmp_path, change, message):
    from jaxpar.formats import hf_deepseek_v3

    config = json.loads((hf_deepseek[0] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(UserError, match=message) as e:
        hf_deepseek_v3.read_config(str(tmp_path))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "extra,message",
    [
        (("model.moe_router=softmax", "model.moe_n_group=1", "model.moe_topk_group=1"), "moe_router=softmax"),
        (("model.layernorm_eps=1e-5",), "layernorm_eps=1e-05"),
        (("model.moe_capacity_factor=1.0",), "moe_capacity_factor"),
        (("model.mtp_depth=1",), "model.mtp_depth>0"),  # multi-token prediction's modules (mtp.*) beside the model's
    ],
)
def test_what_hf_cannot_hold_is_refused_in_one_line(tmp_path, extra, message):
    from flax import nnx

    from jaxpar.core.weights.names import flatten
    from jaxpar.models.decoder import Decoder
    from jaxpar.formats import hf_deepseek_v3
    from tests.helpers import tiny_config

    cfg = tiny_config(*DEEPSEEK, *extra).model
    model = nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0)))
    flat = {k: np.zeros(v.shape, np.float32) for k, v in flatten(nnx.to_pure_dict(nnx.state(model, nnx.Param))).items()}
    with pytest.raises(UserError, match=message) as e:
        hf_deepseek_v3.shared_to_hf(flat, str(tmp_path), _settings(cfg))
    assert "\n" not in str(e.value)


def test_the_deepseek_configs_build_with_their_documented_counts():
    from jaxpar.core.config.schema import load_config
    from jaxpar.core.model.flops import count_params
    from tests.helpers import ROOT

    small = load_config(f"{ROOT}/configs/deepseek-v3-small.yaml").model
    assert (count_params(small)["total"], count_params(small, active=True)["total"]) == (694_131_520, 192_387_904)
    assert small.mtp_depth == 1  # DeepSeek-V3's multi-token prediction depth
    tiny = load_config(f"{ROOT}/configs/deepseek-v3-tiny.yaml").model
    assert (tiny.family, tiny.attention, tiny.moe_first_dense, tiny.moe_router, tiny.moe_n_group) == (
        "llama",
        "mla",
        1,
        "sigmoid",
        4,
    )


@pytest.mark.slow
def test_the_tiny_config_trains_and_its_run_converts_to_hf(tmp_path, capsys):
    """python -m jaxpar.train --config configs/deepseek-v3-tiny.yaml train.steps=2, then --to hf.

    transformers' logits are the run's (its balance bias moved off zero by the two steps); the multi-token prediction
    module (mtp_depth 1) is left out of the export, and the command says so.
    """
    import transformers

    from tests.helpers import assert_preset_trains_and_converts_to_hf

    flat = assert_preset_trains_and_converts_to_hf("deepseek-v3-tiny", transformers.DeepseekV3ForCausalLM, tmp_path)
    assert np.abs(flat["blocks.moe.router.bias"]).max() > 0
    assert any(k.startswith("mtp.") for k in flat)
    assert "left out: multi-token prediction's 1 module(s)" in capsys.readouterr().out
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 0


@pytest.mark.slow
def test_deepseek_v3_shape_on_a_layout_equals_one_device_and_keeps_its_fixed_bias(dataset):
    """The DeepSeek-V3 block on an ep/tp layout equals one device and keeps its fixed router bias.

    The whole DeepSeek-V3 block (llama with mla, a dense first layer, grouped sigmoid routing, shared experts, the
    routed scale, a fixed router bias) with the experts over ep and the heads over tp equals one device; the fixed bias
    (model.moe_router_bias, moe_bias_update=0) stays as it started, through AdamW and its weight decay.
    """
    from tests.helpers import assert_params_close, run_steps, tiny_config

    overrides = (*(o for o in DEEPSEEK if "vocab_size" not in o), "train.steps=4")
    ref = run_steps(tiny_config(*overrides), "dp=1", dataset, devices=jax.devices()[:1])
    assert ref["loss"][-1] < ref["loss"][0]
    assert not ref["params"]["blocks.moe.router.bias"].any()
    got = run_steps(tiny_config(*overrides), "ep=2,tp=2,dp=2", dataset, devices=jax.devices()[:8])
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5)
    assert_params_close(got["params"], ref["params"])
