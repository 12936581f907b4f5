"""gpt-oss: Hugging Face's GptOssForCausalLM as the oracle, and its blocks on jaxpar's layouts.

A random transformers gpt-oss (biases, sinks, a clamp that acts, YaRN, sliding layers with a window shorter than the row
alternating with full ones) gives its logits and greedy tokens to both frameworks through --from hf, and comes back bit
for bit through --to hf; so does one with the Hub's MXFP4 experts and bfloat16 tensors; what the format cannot hold is
refused in one line. Each layout equals one device: dp x tp, the experts over ep with fsdp or tp (their biases split as
their weights, down's added once after the tp sum), the hand-scheduled pipelines 1f1b and zb_v with ep, and sequence
parallelism with ulysses (the sinks split as the heads). The math against numpy: tests/jaxpar/test_moe.py (the
dispatch) and the twins in tests/jaxpar/test_variants.py (gpt_oss_moe, llama_sinks); torchpar's backends:
tests/torchpar/test_qwen3_runs.py.
"""

import math

import jax
import numpy as np
import pytest

from tests.helpers import assert_params_close, run_steps, tiny_config
from tests.jaxpar.test_variants import VARIANTS

# the twins' gpt-oss (its attention and experts, a clamp the tiny model's gate and up values pass) on 4 layers, sliding
# and full alternating; the learning rate of the MoE layouts of tests/jaxpar/test_qwen3.py
GPT_OSS = (
    *VARIANTS["gpt_oss_moe"],
    "model.n_layer=4",
    "model.sliding_window=6",
    "model.full_attention_every=2",
    "optim.lr=1e-3",
    "optim.min_lr=1e-4",
)
CASES = [
    ("ep=2,fsdp=2", ()),
    ("dp=2,tp=2", ()),
    ("ep=2,tp=2", ()),
    ("pp=2,ep=2", ("parallel.pipeline_schedule=1f1b",)),
    ("pp=2,ep=2", ("parallel.pipeline_schedule=zb_v", "model.n_layer=8")),  # zb_v's 4 chunks: a cycle of 2 each
    ("sp=2,tp=2", ("parallel.sequence_attention=ulysses",)),
]
_REFERENCES: dict = {}


@pytest.mark.slow  # each depth's one-device reference trains before its first layout
@pytest.mark.parametrize("mesh,extra", CASES, ids=[m + "".join(f"-{e.split('=')[1]}" for e in x) for m, x in CASES])
def test_gpt_oss_blocks_on_a_layout_equal_one_device(mesh, extra, dataset):
    model_keys = GPT_OSS + tuple(e for e in extra if e.startswith("model."))
    if model_keys not in _REFERENCES:
        _REFERENCES[model_keys] = run_steps(tiny_config(*model_keys), "dp=1", dataset, devices=jax.devices()[:1])
    ref = _REFERENCES[model_keys]
    for name in ("blocks.moe.down_bias", "blocks.moe.router.logit_bias", "blocks.attn.q.bias"):
        assert np.abs(ref["params"][name]).max() > 1e-4, name  # the biases trained off their zeros
    n = math.prod(int(p.split("=")[1]) for p in mesh.split(","))
    got = run_steps(tiny_config(*GPT_OSS, *extra), mesh, dataset, devices=jax.devices()[:n])
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5)
    assert_params_close(got["params"], ref["params"])


# gpt-oss's alternation of sliding and full layers (a window of 5 on rows of 24), over two cycles of it
CONFIG = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=16,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_local_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=32,
    sliding_window=5,
    layer_types=["sliding_attention", "full_attention"] * 2,
    swiglu_limit=1.0,
    rope_parameters=dict(
        rope_type="yarn", rope_theta=500.0, factor=4.0, original_max_position_embeddings=8, beta_fast=4.0, beta_slow=0.5
    ),
    tie_word_embeddings=False,
)


def _random_gpt_oss(**changes):
    """A transformers gpt-oss of CONFIG with `changes`, every piece away from its trivial init.

    Biases and sinks off their zeros, norms off 1, weights large: a dropped piece would show.
    """
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**{**CONFIG, **changes})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
            elif name.endswith(("bias", "sinks")):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.mul_(4.0)
    return model


@pytest.fixture(scope="module")
def hf_gpt_oss(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.helpers import hf_oracle

    return hf_oracle(_random_gpt_oss(), tmp_path_factory.mktemp("hf_gpt_oss"))


def test_hf_gpt_oss_logits_and_greedy_tokens_match_both_frameworks(hf_gpt_oss):
    from jaxpar.core.config.schema import load_config
    from jaxpar.tools.convert import read
    from tests.helpers import assert_both_frameworks_give_hf_answers

    path, tokens, want, greedy = hf_gpt_oss
    flat, model = read("hf", str(path))
    keys = ("attention_bias", "attention_sinks", "moe_expert_bias", "moe_activation", "sliding_window")
    keys += ("full_attention_every", "rope_scaling")
    assert {k: model[k] for k in keys} == dict(
        attention_bias=True,
        attention_sinks=True,
        moe_expert_bias=True,
        moe_activation="gpt_oss",
        sliding_window=5,
        full_attention_every=2,
        rope_scaling="yarn",
    )
    cfg = load_config(None, [f"model.{k}={v}" for k, v in model.items()] + ["data.seq_len=24"]).model
    assert_both_frameworks_give_hf_answers(flat, cfg, tokens, want, greedy, "gpt-oss")


def test_gpt_oss_round_trip_through_a_jaxpar_run_is_bit_exact(hf_gpt_oss, tmp_path):
    import json

    import transformers

    from tests.helpers import assert_hf_round_trip_through_a_jaxpar_run

    assert_hf_round_trip_through_a_jaxpar_run(hf_gpt_oss, tmp_path, transformers.GptOssForCausalLM)
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (config["model_type"], config["swiglu_limit"], config["layer_types"]) == (
        "gpt_oss",
        1.0,
        CONFIG["layer_types"],
    )


def test_the_hubs_mxfp4_experts_and_bfloat16_weights_convert_to_the_oracles_answers(tmp_path):
    """gpt-oss as the Hub ships it: experts in MXFP4 (packed here from random codes), the rest bfloat16.

    The oracle is transformers' own dequantization (convert_moe_packed_tensors on the CPU) of the same blocks, loaded
    into its model: our import equals its experts bit for bit and both frameworks give its logits and greedy tokens.
    """
    import json

    import torch
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from jaxpar.core.config.schema import load_config
    from jaxpar.tools.convert import read
    from tests.helpers import assert_both_frameworks_give_hf_answers, hf_oracle

    model, rng, packed = _random_gpt_oss(intermediate_size=32), np.random.default_rng(0), {}  # 32: one MXFP4 group
    E, d, width = CONFIG["num_local_experts"], CONFIG["hidden_size"], 32
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                rows, length = (2 * width, d) if name.endswith("gate_up_proj") else (d, width)
                blocks = rng.integers(0, 256, (E, rows, length // 32, 16), dtype=np.uint8)
                scales = rng.integers(121, 126, (E, rows, length // 32), dtype=np.uint8)  # 2^-6 .. 2^-2
                p.copy_(
                    convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
                )
                packed[name] = (blocks, scales)
            else:  # bfloat16 on the Hub: the values it can hold
                p.copy_(p.to(torch.bfloat16).float())
    path, tokens, want, greedy = hf_oracle(model, tmp_path / "hub")
    tensors = {}
    for name, t in load_file(path / "model.safetensors").items():
        if name in packed:
            tensors[name + "_blocks"], tensors[name + "_scales"] = (torch.from_numpy(a) for a in packed[name])
        else:
            tensors[name] = t.to(torch.bfloat16)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (path / "config.json").write_text(json.dumps(config))

    flat, settings = read("hf", str(path))
    layer0 = model.model.layers[0].mlp.experts
    np.testing.assert_array_equal(flat["blocks.moe.gate"][0], layer0.gate_up_proj.detach().numpy()[..., ::2])
    np.testing.assert_array_equal(flat["blocks.moe.down"][0], layer0.down_proj.detach().numpy())
    cfg = load_config(None, [f"model.{k}={v}" for k, v in settings.items()] + ["data.seq_len=24"]).model
    assert_both_frameworks_give_hf_answers(flat, cfg, tokens, want, greedy, "gpt-oss (MXFP4)")


@pytest.mark.parametrize(
    "change,message",
    [
        ({"layer_types": ["full_attention", "sliding_attention"] * 2}, "slide except every N-th"),
        ({"quantization_config": {"quant_method": "bitsandbytes"}}, "only the Hub's MXFP4 expert blocks"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 500.0}}, "rope type 'llama3'"),
    ],
)
def test_what_our_model_cannot_hold_is_refused_in_one_line(hf_gpt_oss, tmp_path, change, message):
    import json

    from jaxpar.core.errors import UserError
    from jaxpar.formats import hf_gpt_oss as module

    config = json.loads((hf_gpt_oss[0] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(UserError, match=message) as e:
        module.read_config(str(tmp_path))
    assert "\n" not in str(e.value)


def test_the_gpu_preset_counts_as_transformers_does():
    """configs/gpt-oss-small.yaml's parameters (ours, by formula) are transformers' GptOssForCausalLM's of its shape."""
    import torch
    import transformers

    from jaxpar.core.config.schema import load_config
    from jaxpar.core.model.flops import count_params
    from tests.helpers import ROOT

    m = load_config(f"{ROOT}/configs/gpt-oss-small.yaml").model
    config = transformers.GptOssConfig(
        vocab_size=m.vocab_size,
        hidden_size=m.d_model,
        intermediate_size=m.moe_d_ff,
        num_hidden_layers=m.n_layer,
        num_attention_heads=m.n_head,
        num_key_value_heads=m.kv_heads,
        head_dim=m.head_width,
        num_local_experts=m.moe_experts,
        num_experts_per_tok=m.moe_top_k,
        tie_word_embeddings=m.tie_embeddings,
        layer_types=["full_attention"] * m.n_layer,
    )
    with torch.device("meta"):
        hf = transformers.GptOssForCausalLM(config)
    assert sum(p.numel() for p in hf.parameters()) == count_params(m)["total"] == 1_048_108_416


@pytest.mark.slow
def test_the_tiny_preset_trains_and_its_run_converts_to_hf(tmp_path):
    """python -m jaxpar.train --config configs/gpt-oss-tiny.yaml train.steps=2, then --to hf: transformers' logits."""
    import transformers

    from tests.helpers import assert_preset_trains_and_converts_to_hf

    flat = assert_preset_trains_and_converts_to_hf("gpt-oss-tiny", transformers.GptOssForCausalLM, tmp_path)
    assert np.abs(flat["blocks.moe.router.logit_bias"]).max() > 0  # trained off its zeros
