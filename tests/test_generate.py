"""Decoding: the KV-cache loop emits exactly what re-running the whole forward pass would (one device and
tp=4), sampling is reproducible from its seed, and a converted Hugging Face GPT-2 decodes as transformers does."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.context import use
from jaxpar.core.mesh_spec import parse_mesh
from jaxpar.core.weights import read_weights, save_weights, unflatten
from jaxpar.decode import make_generate
from jaxpar.layout import Layout
from jaxpar.mesh import make_mesh
from jaxpar.models.gpt import abstract_model
from jaxpar.parallelize import parallel_context
from jaxpar.state import init_state

from tests.helpers import ROOT, tiny_config

PROMPT = [[10, 20, 30, 40, 50]]


def model_on(mesh: str):
    """The tiny model with large random weights (so greedy decoding does not settle on one token)."""
    cfg = tiny_config("model.init_std=0.5")
    layout = Layout(cfg, make_mesh(parse_mesh(mesh), jax.devices()[:int(mesh.split("=")[1])]))
    return layout, abstract_model(cfg.model)[0], init_state(layout)["params"]


@pytest.mark.parametrize("mesh", ["dp=1", "tp=4"])
def test_kv_cache_decoding_equals_rerunning_the_full_forward(mesh):
    layout, graphdef, params = model_on(mesh)
    # the whole forward pass over a fixed 25-token buffer (compiled once; causal, so the zero padding after
    # position n cannot change the logits at n), re-run for every new token
    full_forward = jax.jit(lambda p, t, n: nnx.merge(graphdef, p)(t)[:, n].argmax(-1))
    with use(parallel_context(layout)):
        cached = np.asarray(make_generate(graphdef)(params, jnp.asarray(PROMPT), jax.random.key(0), new_tokens=20))
        tokens = jnp.zeros((1, 25), jnp.int32).at[:, :5].set(jnp.asarray(PROMPT))
        for n in range(5, 25):
            tokens = tokens.at[:, n].set(full_forward(params, tokens, n - 1).astype(jnp.int32))
    assert len(set(cached[0].tolist())) > 3, cached  # a degenerate run would prove nothing
    np.testing.assert_array_equal(cached, np.asarray(tokens[:, 5:]))


def test_sampling_is_reproducible_from_its_seed():
    layout, graphdef, params = model_on("dp=1")
    generate = make_generate(graphdef)
    prompt = jnp.asarray(PROMPT * 2)

    def draw(seed, **how):
        with use(parallel_context(layout)):
            return np.asarray(generate(params, prompt, jax.random.key(seed), new_tokens=12, **how))

    nucleus = {"temperature": 1.0, "top_k": 50, "top_p": 0.9}
    first = draw(1, **nucleus)
    np.testing.assert_array_equal(first, draw(1, **nucleus))
    assert not np.array_equal(first, draw(2, **nucleus)) and not np.array_equal(first[0], first[1])
    np.testing.assert_array_equal(draw(3, temperature=1.0, top_k=1), draw(4))  # top-1 sampling is greedy


def test_converted_hugging_face_gpt2_decodes_as_transformers(tmp_path):
    """A random GPT-2 from transformers -> shared weights -> `python -m jaxpar.generate` greedy, 20 tokens."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from jaxpar.tools.convert import read

    config = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                     initializer_range=0.5)
    torch.manual_seed(0)
    hf_model = transformers.GPT2LMHeadModel(config).eval()
    hf_model.save_pretrained(tmp_path / "hf")
    prompt = "def f(x):"
    with torch.no_grad():
        want = hf_model.generate(torch.tensor([list(prompt.encode())]), max_new_tokens=20, do_sample=False,
                                 pad_token_id=0)[0, len(prompt):].tolist()
    assert len(set(want)) > 3, want
    save_weights(str(tmp_path / "w.safetensors"), unflatten(read("hf", str(tmp_path / "hf"))[0]))
    out = subprocess.run([sys.executable, "-m", "jaxpar.generate", "--weights", str(tmp_path / "w.safetensors"),
                          "--prompt", prompt, "--max-new-tokens", "20", "--temperature", "0"],
                         cwd=ROOT, capture_output=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr
    assert out.stdout == (prompt + bytes(want).decode("utf-8", "replace") + "\n").encode(), (out.stdout, want)


def test_jaxpar_and_torchpar_decode_the_same_tokens(tmp_path):
    """The same shared weights through both commands, greedy: the same text; torchpar's sampling is
    reproducible from its seed too."""
    torch = pytest.importorskip("torch")
    from torchpar.decode import generate as torch_generate
    from torchpar.model import GPT
    from torchpar.weights import from_shared

    layout, _, params = model_on("dp=1")
    weights = str(tmp_path / "w.safetensors")
    save_weights(weights, jax.device_get(params))
    outs = [subprocess.run([sys.executable, "-m", f"{side}.generate", "--weights", weights, "--prompt", "def f(x):",
                            "--max-new-tokens", "20", "--temperature", "0"], cwd=ROOT, capture_output=True,
                           timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"}) for side in ("jaxpar", "torchpar")]
    assert outs[0].returncode == outs[1].returncode == 0, (outs[0].stderr, outs[1].stderr)
    assert outs[0].stdout == outs[1].stdout and len(set(outs[0].stdout)) > 5, outs[0].stdout

    model = GPT(layout.cfg.model)
    model.load_state_dict(from_shared(read_weights(weights), layout.cfg.model.n_layer))
    prompt = torch.tensor(PROMPT * 2)
    draw = lambda seed: torch_generate(model, prompt, 12, seed, temperature=1.0, top_k=50, top_p=0.9)  # noqa: E731
    first = draw(1)
    assert torch.equal(first, draw(1)) and not torch.equal(first, draw(2)) and not torch.equal(first[0], first[1])
