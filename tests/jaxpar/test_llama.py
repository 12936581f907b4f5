"""model.family=llama: layouts, Hugging Face conversion, grouped-KV decoding and refusals.

Every layout equals one device, a random Hugging Face LlamaForCausalLM (GQA, untied head) converts into both frameworks
with transformers' logits and back bit-exactly, decoding with a grouped KV cache equals the full forward in both
frameworks, and the family's one-line refusals.
jaxpar == torchpar loss and gradients: tests/jaxpar/test_variants.py ("llama", "llama_dilated"); trajectories:
parity_tests (configs/parity/llama.yaml).
"""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.core.config.schema import load_config
from jaxpar.core.errors import UserError
from jaxpar.core.config.mesh_spec import parse_mesh
from jaxpar.core.weights.names import unflatten
from jaxpar.models.decoder import Decoder, abstract_model
from tests.helpers import assert_params_close, run_steps, tiny_config

LLAMA = ("model.family=llama", "model.n_kv_head=2", "model.tie_embeddings=false", "model.d_ff=64")
ONE_F_ONE_B = ("parallel.pipeline_schedule=1f1b",)
MESHES = [
    ("dp=2,tp=4", ()),
    ("pp=2,dp=2,tp=2", ONE_F_ONE_B),
    ("sp=4,dp=2", ()),
    ("dp=8", ()),
    ("fsdp=8", ()),
    ("pp=2,dp=2,tp=2", ("parallel.pipeline_schedule=gpipe",)),
    ("pp=2,dp=2", ("parallel.pipeline_schedule=interleaved", "parallel.pipeline_virtual_stages=2", "model.n_layer=4")),
    ("sp=2,tp=2", ("parallel.sequence_attention=ulysses",)),
    ("dp=4,tp=2", ("parallel.zero_stage=3",)),
]
_REFERENCES: dict = {}


def _reference(dataset, extra):
    key = tuple(e for e in extra if e.startswith("model."))  # only model keys change the one-device run
    if key not in _REFERENCES:
        _REFERENCES[key] = run_steps(tiny_config(*LLAMA, *key), "dp=1", dataset, devices=jax.devices()[:1])
    return _REFERENCES[key]


@pytest.mark.parametrize("mesh,extra", MESHES, ids=[m + "".join(f",{e.split('=')[1]}" for e in x) for m, x in MESHES])
def test_llama_layout_matches_single_device(mesh, extra, dataset):
    """tp=4 with 2 kv heads: kv heads replicated over tp (indivisible), query heads split."""
    ref = _reference(dataset, extra)
    n = math.prod(parse_mesh(mesh).values())
    got = run_steps(tiny_config(*LLAMA, *extra), mesh, dataset, devices=jax.devices()[:n])
    assert ref["loss"][-1] < ref["loss"][0] - 0.1, "the reference run should learn something"
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5)
    np.testing.assert_allclose(got["grad_norm"], ref["grad_norm"], rtol=1e-4)
    assert_params_close(got["params"], ref["params"])


# --- Hugging Face LlamaForCausalLM <-> both frameworks -------------------------------------------------


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=56,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        rms_norm_eps=1e-6,
        rope_theta=500.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1 and large weights, so a mix-up (or a rotary permutation) would show
        for name, p in model.named_parameters():
            p.add_(0.3 * torch.randn_like(p)) if "norm" in name else p.mul_(8.0)
    path = tmp_path_factory.mktemp("hf_llama")
    model.save_pretrained(path, safe_serialization=True)
    tokens = np.random.default_rng(0).integers(0, 97, (2, 24))
    with torch.no_grad():
        logits = model(torch.as_tensor(tokens)).logits.numpy()
    return path, tokens, logits


def _jaxpar_logits(flat, cfg, tokens):
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))), nnx.Param)
    model = nnx.merge(graphdef, unflatten({k: jnp.asarray(v) for k, v in flat.items()}))
    with jax.default_matmul_precision("highest"):
        return np.asarray(model(jnp.asarray(tokens)))


def test_hf_llama_logits_match_both_frameworks(hf_llama):
    import torch

    from jaxpar.tools.convert import read
    from torchpar.models.decoder import Decoder as TorchGPT
    from torchpar.weights import from_shared

    path, tokens, want = hf_llama
    flat, model = read("hf", str(path))
    assert (model["family"], model["n_kv_head"], model["tie_embeddings"], model["rope_theta"]) == (
        "llama",
        2,
        False,
        500.0,
    )
    cfg = load_config(None, [f"model.{k}={v}" for k, v in model.items()] + ["data.seq_len=24"]).model
    scale = np.max(np.abs(want))
    assert scale > 1.0  # logits far from zero: a 1e-5 agreement means something
    np.testing.assert_allclose(_jaxpar_logits(flat, cfg, tokens), want, atol=1e-5 * scale)
    torch_model = TorchGPT(cfg)
    torch_model.load_state_dict(from_shared(flat, cfg.n_layer))
    with torch.no_grad():
        got = torch_model(torch.as_tensor(tokens)).numpy()
    np.testing.assert_allclose(got, want, atol=1e-5 * scale)


def test_jaxpar_run_exports_to_hf_llama_bit_exact_and_transformers_reproduces_it(hf_llama, tmp_path):
    """HF -> jaxpar run (step-0 checkpoint) -> HF: every tensor bit-exact.

    transformers loads the export and its logits equal jaxpar's on the run's own weights.
    """
    import torch
    import transformers
    from safetensors.numpy import load_file

    from jaxpar.tools import convert

    path, tokens, _ = hf_llama
    assert convert.main(["--from", "hf", str(path), "--to", "jaxpar", str(tmp_path / "run")]) == 0
    assert convert.main(["--from", "jaxpar", str(tmp_path / "run"), "--to", "hf", str(tmp_path / "back")]) == 0
    original, returned = (
        load_file(str(path / "model.safetensors")),
        load_file(str(tmp_path / "back" / "model.safetensors")),
    )
    assert set(returned) == set(original)
    for name, value in original.items():
        assert np.array_equal(returned[name], value), name
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (back["num_key_value_heads"], back["rope_theta"], back["rms_norm_eps"]) == (2, 500.0, 1e-6)

    flat, model = convert.read("jaxpar", str(tmp_path / "run"))
    cfg = load_config(None, [f"model.{k}={v}" for k, v in model.items()] + ["data.seq_len=24"]).model
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        theirs = hf(torch.as_tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(theirs, _jaxpar_logits(flat, cfg, tokens), atol=1e-5 * np.max(np.abs(theirs)))


def test_kv_cache_decoding_with_grouped_heads_in_both_frameworks():
    """jaxpar on tp=4 (2 kv heads replicated, query heads split) and torchpar.

    20 greedy tokens each equal to re-running the whole forward pass.
    """
    import torch

    from jaxpar.context import use
    from jaxpar.decode import make_generate
    from jaxpar.layout import Layout
    from jaxpar.mesh import make_mesh
    from jaxpar.parallelize import parallel_context
    from jaxpar.state import init_state
    from torchpar.decode import generate as torch_generate
    from torchpar.models.decoder import Decoder as TorchGPT
    from torchpar.weights import from_shared

    cfg = tiny_config(*LLAMA, "model.init_std=0.5")
    layout = Layout(cfg, make_mesh({"tp": 4}, jax.devices()[:4]))
    graphdef, params = abstract_model(cfg.model)[0], init_state(layout)["params"]
    prompt = jnp.asarray([[10, 20, 30, 40, 50]])
    full_forward = jax.jit(lambda p, t, n: nnx.merge(graphdef, p)(t)[:, n].argmax(-1))
    with use(parallel_context(layout)), jax.default_matmul_precision("highest"):
        cached = np.asarray(make_generate(graphdef)(params, prompt, jax.random.key(0), new_tokens=20))
        tokens = jnp.zeros((1, 25), jnp.int32).at[:, :5].set(prompt)
        for n in range(5, 25):
            tokens = tokens.at[:, n].set(full_forward(params, tokens, n - 1).astype(jnp.int32))
    assert len(set(cached[0].tolist())) > 3, cached  # a degenerate run would prove nothing
    np.testing.assert_array_equal(cached, np.asarray(tokens[:, 5:]))

    from jaxpar.core.weights.names import flatten

    torch_model = TorchGPT(cfg.model)
    torch_model.load_state_dict(from_shared(flatten(jax.device_get(params)), cfg.model.n_layer))
    got = torch_generate(torch_model, torch.as_tensor(np.asarray(prompt)).long(), 20)
    np.testing.assert_array_equal(got.numpy(), cached)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (("model.family=llama", "model.linear=sketched"), "model.linear=sketched is a GPT-2-family variant"),
        (("model.n_kv_head=2",), "model.n_kv_head applies to model.family=llama only"),
        (("model.tie_embeddings=false",), "model.tie_embeddings applies to model.family=llama only"),
        (("model.family=llama", "model.n_kv_head=3"), "model.n_kv_head=3 must divide model.n_head=4"),
        (("model.family=llama", "model.n_head=8", "model.d_model=40"), "needs an even head dimension"),
        (("model.family=llama", "model.head_dim=7"), "needs an even head dimension"),
    ],
)
def test_family_refusals_are_one_line(overrides, message):
    with pytest.raises(UserError, match=message):
        tiny_config(*overrides)


def test_converted_run_may_change_data_and_batch_but_not_the_model(tmp_path):
    """A converted run may change its data and batch but not its model.

    A step-0 run written by jaxpar.tools.convert (config.json with converted_from) fine-tunes with its own data and
    batch; a trained run may not change them; neither may change the model.
    """
    from jaxpar.core.run.resume import check_resume

    (tmp_path / "checkpoints" / "0").mkdir(parents=True)
    saved = tiny_config(*LLAMA, f"run.dir={tmp_path}").to_dict()
    for converted in (True, False):
        record = {**saved, "converted_from": "/hf/dir"} if converted else saved
        (tmp_path / "config.json").write_text(json.dumps(record))
        changed = tiny_config(*LLAMA, f"run.dir={tmp_path}", "data.seq_len=8", "train.global_batch_size=4")
        if converted:
            check_resume(changed)
        else:
            with pytest.raises(UserError, match="data.seq_len/train.global_batch_size"):
                check_resume(changed)
        with pytest.raises(UserError, match="model.n_kv_head"):
            check_resume(tiny_config(*LLAMA, f"run.dir={tmp_path}", "model.n_kv_head=4"))
