"""Hugging Face Qwen3ForCausalLM and Qwen3MoeForCausalLM <-> both frameworks (jaxpar/formats/hf_qwen3.py).

A small random transformers model is the oracle for logits and greedy tokens, through --from hf and back through --to
hf; a model of ours written --to hf gives our logits in transformers; what the format cannot hold is refused in one
line. The oracles' query/key norms are random, so a dropped or misplaced norm fails; their heads are wider than
hidden_size / num_attention_heads, so a head width taken from d_model fails.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.core.errors import UserError
from tests.helpers import assert_both_frameworks_give_hf_answers, assert_hf_round_trip_through_a_jaxpar_run, hf_oracle

COMMON = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,  # 4 x 16 = 64 != 32
    max_position_embeddings=32,
    rms_norm_eps=1e-6,
    rope_theta=300.0,
    tie_word_embeddings=False,
)
# Qwen3-MoE with a dense first layer (mlp_only_layers) and Qwen3-MoE's default of weights not renormalised over the
# chosen experts
MOE = dict(
    COMMON,
    num_hidden_layers=3,
    moe_intermediate_size=16,
    num_experts=6,
    num_experts_per_tok=2,
    norm_topk_prob=False,
    mlp_only_layers=[0],
    decoder_sparse_step=1,
)
# every layer attending to its 5 latest tokens, on rows of 24 and decoding 12 tokens after 8
WINDOW = dict(COMMON, num_hidden_layers=2, use_sliding_window=True, sliding_window=5, max_window_layers=0)
# YaRN over an original context of 8 on rows of 24, the ramp over the middle pairs (beta_fast 4, beta_slow 0.5)
YARN = dict(
    {k: v for k, v in COMMON.items() if k != "rope_theta"},
    num_hidden_layers=2,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=300.0,
        factor=4.0,
        original_max_position_embeddings=8,
        beta_fast=4.0,
        beta_slow=0.5,
        truncate=False,
    ),
)
# every second layer full (layer_types, as gpt-oss's): model.full_attention_every=2
ALTERNATING = dict(WINDOW, num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2)
FAMILIES = {
    "qwen3": dict(COMMON, num_hidden_layers=2),
    "qwen3_moe": MOE,
    "qwen3_window": WINDOW,
    "qwen3_yarn": YARN,
    "qwen3_alternating": ALTERNATING,
}


def _classes(family: str):
    import transformers

    if family != "qwen3_moe":
        return transformers.Qwen3Config, transformers.Qwen3ForCausalLM
    return transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM


@pytest.fixture(scope="module", params=list(FAMILIES))
def hf_qwen3(request, tmp_path_factory):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    config_class, model_class = _classes(request.param)
    torch.manual_seed(0)
    model = model_class(config_class(**FAMILIES[request.param])).eval()
    with torch.no_grad():  # weights away from init and norms away from 1: a mixed-up or dropped tensor would show
        for name, p in model.named_parameters():
            p.add_(0.3 * torch.randn_like(p)) if "norm" in name else p.mul_(4.0)
    return request.param, hf_oracle(model, tmp_path_factory.mktemp(request.param))


def test_hf_qwen3_logits_and_greedy_tokens_match_both_frameworks(hf_qwen3):
    from jaxpar.core.config.schema import load_config
    from jaxpar.tools.convert import read

    family, (path, tokens, want, greedy) = hf_qwen3
    flat, model = read("hf", str(path))
    assert (model["family"], model["head_dim"], model["qk_norm"], model["n_kv_head"], model["rope_theta"]) == (
        "llama",
        16,
        True,
        2,
        300.0,
    )
    assert model.get("sliding_window", 0) == (5 if family in ("qwen3_window", "qwen3_alternating") else 0)
    assert model.get("full_attention_every", 0) == (2 if family == "qwen3_alternating" else 0)
    assert model.get("rope_scaling", "none") == ("yarn" if family == "qwen3_yarn" else "none")
    if family == "qwen3_moe":
        assert {k: model[k] for k in ("moe_experts", "moe_first_dense", "moe_d_ff", "d_ff", "moe_norm_topk")} == dict(
            moe_experts=6, moe_first_dense=1, moe_d_ff=16, d_ff=48, moe_norm_topk=False
        )
    cfg = load_config(None, [f"model.{k}={v}" for k, v in model.items()] + ["data.seq_len=24"]).model
    assert_both_frameworks_give_hf_answers(flat, cfg, tokens, want, greedy, family)


def test_qwen3_round_trip_through_a_jaxpar_run_is_bit_exact(hf_qwen3, tmp_path):
    family, oracle = hf_qwen3
    assert_hf_round_trip_through_a_jaxpar_run(oracle, tmp_path, _classes(family)[1])
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (config["model_type"], config["head_dim"]) == ("qwen3_moe" if family == "qwen3_moe" else "qwen3", 16)
    if family == "qwen3_alternating":
        assert config["layer_types"] == ALTERNATING["layer_types"]
    if family == "qwen3_yarn":
        assert config["rope_parameters"] == YARN["rope_parameters"]


QWEN3 = ("model.family=llama", "model.n_kv_head=2", "model.head_dim=12", "model.qk_norm=true", "model.d_ff=40")


@pytest.mark.parametrize(
    "family,overrides",
    [
        ("qwen3", ("model.tie_embeddings=true",)),
        ("qwen3", ("model.sliding_window=5",)),
        ("qwen3_moe", ("model.n_layer=3", "model.moe_experts=4", "model.moe_top_k=2", "model.moe_d_ff=16")),
        ("qwen3_moe", ("model.moe_experts=4", "model.moe_d_ff=16", "model.sliding_window=5")),
    ],
)
def test_ours_to_hf_gives_our_logits(family, overrides, tmp_path):
    """A model of ours (random weights and norms) written --to hf: transformers' logits are ours, in both frameworks.

    Qwen3 with a tied head; Qwen3-MoE with experts in every layer and renormalised weights (the other settings than
    the oracle's).
    """
    import torch
    from flax import nnx

    from jaxpar.core.weights.names import SETTINGS, flatten, unflatten
    from jaxpar.formats.weights_io import write
    from jaxpar.models.decoder import Decoder
    from tests.helpers import tiny_config
    from torchpar.models.decoder import Decoder as TorchDecoder
    from torchpar.weights import from_shared

    cfg = tiny_config(*QWEN3, *overrides).model
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))), nnx.Param)
    rng = np.random.default_rng(0)
    flat = {
        k: ((1.0 + 0.3 * rng.standard_normal(v.shape)) if k.endswith("scale") else 0.3 * rng.standard_normal(v.shape))
        for k, v in flatten(nnx.to_pure_dict(state)).items()
    }
    flat = {k: v.astype(np.float32) for k, v in flat.items()}
    write("hf", str(tmp_path), flat, {"family": "llama", **{k: getattr(cfg, k) for k in SETTINGS}})
    assert json.loads((tmp_path / "config.json").read_text())["sliding_window"] == (cfg.sliding_window or None)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == family
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 16))
    with jax.default_matmul_precision("highest"):
        ours = np.asarray(
            jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(
                unflatten({k: jnp.asarray(v) for k, v in flat.items()}), jnp.asarray(tokens)
            )
        )
    hf = _classes(family)[1].from_pretrained(tmp_path).eval()
    with torch.no_grad():
        theirs = hf(torch.as_tensor(tokens)).logits.numpy()
    scale = max(np.max(np.abs(theirs)), 1.0)
    np.testing.assert_allclose(ours, theirs, atol=1e-5 * scale)
    torch_model = TorchDecoder(cfg)
    torch_model.load_state_dict(from_shared(flat, cfg.n_layer))
    with torch.no_grad():
        np.testing.assert_allclose(torch_model(torch.as_tensor(tokens)).numpy(), theirs, atol=1e-5 * scale)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1, "layer_types": None}, "layer types"),
        ({"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8}, "layer types"),
        ({"mlp_only_layers": [1]}, r"dense layers \[1\]"),
        ({"mlp_only_layers": [], "decoder_sparse_step": 2}, r"dense layers \[0, 2\]"),
        ({"attention_bias": True}, "attention_bias"),
    ],
)
def test_what_our_model_cannot_hold_is_refused_in_one_line(hf_qwen3, tmp_path, change, message):
    from jaxpar.formats import hf_qwen3 as module

    family, (path, *_) = hf_qwen3
    if family == "qwen3_yarn":
        pytest.skip("the plain Qwen3 oracle covers these")
    if family != "qwen3_moe" and "mlp_only_layers" in change:
        pytest.skip("Qwen3 (dense) has no experts to place")
    if family == "qwen3_moe" and "layer types" in message:
        pytest.skip("Qwen3-MoE's layers slide all or none (use_sliding_window)")
    config = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
    with pytest.raises(UserError, match=message) as e:
        module.hf_to_shared(str(tmp_path))
    assert "\n" not in str(e.value)


def test_experts_qwen3_moe_cannot_hold_are_refused_on_export(tmp_path):
    from jaxpar.formats import hf_qwen3

    flat = {"blocks.moe.gate": np.zeros((1, 4, 8, 4)), "blocks.moe.shared.gate.kernel": np.zeros((1, 8, 4))}
    with pytest.raises(UserError, match="no Qwen3-MoE form: shared experts"):
        hf_qwen3.shared_to_hf(flat, str(tmp_path), {})
    with pytest.raises(UserError, match="no Qwen3-MoE form: sigmoid scores"):
        hf_qwen3.shared_to_hf({"blocks.moe.gate": flat["blocks.moe.gate"]}, str(tmp_path), {"moe_router": "sigmoid"})
    assert not list(tmp_path.iterdir())  # nothing written


def _hf_config(m):
    """transformers' config of our model config `m`, written out key by key."""
    config = dict(
        vocab_size=m.vocab_size,
        hidden_size=m.d_model,
        num_hidden_layers=m.n_layer,
        num_attention_heads=m.n_head,
        num_key_value_heads=m.kv_heads,
        head_dim=m.head_width,
        intermediate_size=m.ff_dim,
        tie_word_embeddings=m.tie_embeddings,
        rms_norm_eps=m.layernorm_eps,
        rope_theta=m.rope_theta,
        max_position_embeddings=m.max_seq_len,
    )
    if not m.moe_experts:
        return config
    return dict(
        config,
        num_experts=m.moe_experts,
        num_experts_per_tok=m.moe_top_k,
        moe_intermediate_size=m.moe_d_ff,
        norm_topk_prob=m.moe_norm_topk,
        mlp_only_layers=list(range(m.moe_first_dense)),
    )


@pytest.mark.parametrize(
    "preset,family,total",
    [("qwen3-0.6b", "qwen3", 596_049_920), ("qwen3-moe-small", "qwen3_moe", 1_604_097_024)],
)
def test_the_gpu_presets_count_as_transformers_does(preset, family, total):
    """Each GPU preset's parameter count (ours, by formula) is transformers' for the same shape.

    Qwen3-0.6B's model card gives 0.6B parameters, 0.44B of them outside the embedding.
    """
    import torch

    from jaxpar.core.config.schema import load_config
    from jaxpar.core.model.flops import count_params
    from tests.helpers import ROOT

    m = load_config(f"{ROOT}/configs/{preset}.yaml").model
    config_class, model_class = _classes(family)
    with torch.device("meta"):
        hf = model_class(config_class(**_hf_config(m)))
    assert sum(p.numel() for p in hf.parameters()) == count_params(m)["total"] == total
    assert m.qk_norm and m.head_width * m.n_head != m.d_model


@pytest.mark.slow
@pytest.mark.parametrize("preset,family", [("qwen3-tiny", "qwen3"), ("qwen3-moe-tiny", "qwen3_moe")])
def test_the_tiny_presets_train_and_their_runs_convert_to_hf(preset, family, tmp_path):
    """python -m jaxpar.train --config configs/<preset>.yaml train.steps=2, then --to hf: transformers' logits."""
    from tests.helpers import assert_preset_trains_and_converts_to_hf

    flat = assert_preset_trains_and_converts_to_hf(preset, _classes(family)[1], tmp_path)
    assert np.abs(flat["blocks.attn.k_norm.scale"] - 1).max() > 0  # the norms trained off their init


@pytest.mark.parametrize(
    "rope",
    [
        dict(factor=4.0, original_max_position_embeddings=8),
        dict(factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, truncate=False),
        dict(factor=8.0, original_max_position_embeddings=1024, attention_factor=1.5, beta_fast=16.0),
        dict(factor=0.5, original_max_position_embeddings=64),
    ],
)
def test_yarn_frequencies_are_transformers(rope):
    """core/model/rotary.py's YaRN: transformers' inverse frequencies and cos/sin factor, head width 64."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from jaxpar.core.config.schema import load_config
    from jaxpar.core.model.rotary import yarn
    from jaxpar.formats.hf_llama import yarn_settings

    hf = dict(hidden_size=256, num_attention_heads=4, head_dim=64, max_position_embeddings=4096)
    config = transformers.Qwen3Config(**hf, rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, **rope))
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    ours = yarn_settings(dict(rope), hf)
    m = load_config(
        None,
        ["model.family=llama", "model.max_seq_len=4096", "data.seq_len=16"]
        + [f"model.{k}={v}" for k, v in ours.items()],
    ).model
    freqs, scale = yarn(m, 64)
    np.testing.assert_allclose(freqs, inv_freq.numpy(), rtol=1e-6)
    assert scale == pytest.approx(factor, rel=1e-9)
