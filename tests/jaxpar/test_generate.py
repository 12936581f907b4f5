"""Decoding: the KV-cache loop, sampling, and a converted Hugging Face GPT-2.

The KV-cache loop emits exactly what re-running the whole forward pass would (one device and tp=4; every family and
variant, jaxpar and torchpar, and during training), sampling is reproducible from its seed, top_p keeps exactly the
nucleus, and a converted Hugging Face GPT-2 decodes as transformers does.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.context import use
from jaxpar.core.config.mesh_spec import parse_mesh
from jaxpar.core.weights.names import read_weights, save_weights, unflatten
from jaxpar.decode import make_generate
from jaxpar.layout import Layout
from jaxpar.mesh import make_mesh
from jaxpar.models.decoder import abstract_model
from jaxpar.parallelize import parallel_context
from jaxpar.state import init_state

from tests.helpers import ROOT, run_cli, tiny_config
from tests.jaxpar.test_variants import VARIANTS as TWIN_VARIANTS

PROMPT = [[10, 20, 30, 40, 50]]
# tests/jaxpar/test_variants.py's variants (plain llama: tests/jaxpar/test_llama.py); a 32-token training row (the tiny
# context), so that one forward pass over the whole context is the training forward for dilated attention too
# (its segments depend on the row length)
VARIANTS = {
    "mla": ("model.attention=mla", "model.q_latent_dim=16", "model.kv_latent_dim=8", "model.rope_head_dim=4"),
    "dilated": ("model.attention=dilated", "model.segment_lengths=4,8,16", "model.dilation_rates=1,2,4"),
    "sketched": ("model.linear=sketched", "model.sketch_ratio=0.5"),
    "llama_dilated": (
        "model.family=llama",
        "model.n_kv_head=1",
        "model.d_ff=48",
        "model.attention=dilated",
        "model.segment_lengths=4,8,16",
        "model.dilation_rates=1,2,4",
    ),
    # gpt-oss's attention (biases, sinks), a window on layer 0 and none on 1; Qwen3's q/k norms and head width
    "llama_sinks_window": (
        *TWIN_VARIANTS["llama_sinks"],
        "model.full_attention_every=2",
        "model.qk_norm=true",
        "model.head_dim=12",
    ),
    "dilated_sparse": (
        "model.attention=dilated",
        "model.segment_lengths=8,16,32",
        "model.dilation_rates=1,2,4",
        "model.sparsity_ratio=0.5",
        "model.sparsity_block=2",
    ),  # rows of 8: 4 blocks, 2 kept at most
}
ROW = ("data.seq_len=32",)


def model_on(mesh: str, *overrides: str):
    """The tiny model with large random weights (so greedy decoding does not settle on one token)."""
    cfg = tiny_config("model.init_std=0.5", *overrides)
    layout = Layout(cfg, make_mesh(parse_mesh(mesh), jax.devices()[: int(mesh.split("=")[1])]))
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


@pytest.mark.parametrize("documents", [False, True])
def test_prompts_of_different_lengths_decode_in_one_batch_as_each_alone(documents):
    """make_generate_ragged (lm-eval's generation requests, jaxpar/scoring.py) against make_generate row by row."""
    from jaxpar.decode import make_generate_ragged

    overrides = ("data.document_mask=true",) if documents else ()
    layout, graphdef, params = model_on("dp=1", *overrides)
    eod = 0 if documents else None
    prompts = [[7, 9, 0, 11, 5, 3, 8], [4, 2, 6], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [5, 5, 5, 5]]
    batch = np.zeros((4, 16), np.int32)
    for i, p in enumerate(prompts):
        batch[i, : len(p)] = p
    with use(parallel_context(layout)):
        ragged = make_generate_ragged(graphdef, eod)(
            params,
            jnp.asarray(batch),
            jnp.asarray([len(p) for p in prompts]),
            jax.random.key(0),
            prefill=2,
            new_tokens=10,
        )
        alone = [
            np.asarray(make_generate(graphdef, eod)(params, jnp.asarray([p]), jax.random.key(0), new_tokens=10))[0]
            for p in prompts
        ]
    assert len({tuple(a) for a in alone}) == 4 and len(set(alone[0].tolist())) > 3, alone  # not degenerate
    np.testing.assert_array_equal(np.asarray(ragged), np.stack(alone))


def continue_by_forward(next_token, prompt: list[int], length: int, new: int | None = None) -> list[int]:
    """The independent reference.

    `prompt` continued by `new` tokens (default: to `length`), each one next_token(row, n) of the whole forward pass
    over a fixed row of `length` tokens at position n (causal: the zero padding after n cannot change the logits
    there), re-run for every token.
    """
    row = prompt + [0] * (length - len(prompt))
    end = length if new is None else len(prompt) + new
    for n in range(len(prompt) - 1, end - 1):
        row[n + 1] = next_token(row, n)
    return row[len(prompt) : end]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_variant_decodes_as_its_training_forward(variant):
    layout, graphdef, params = model_on("dp=1", *ROW, *VARIANTS[variant])
    full_forward = jax.jit(lambda p, t, n: nnx.merge(graphdef, p)(t)[0, n].argmax(-1))
    with use(parallel_context(layout)):
        cached = make_generate(graphdef)(params, jnp.asarray(PROMPT), jax.random.key(0), new_tokens=27)
        want = continue_by_forward(lambda row, n: int(full_forward(params, jnp.asarray([row]), n)), PROMPT[0], 32)
    assert len(set(want)) > 3, want  # a degenerate run would prove nothing
    assert np.asarray(cached)[0].tolist() == want


@pytest.mark.parametrize("variant", VARIANTS)
def test_torchpar_decodes_every_variant_as_its_forward(variant):
    torch = pytest.importorskip("torch")
    from torchpar.decode import generate as torch_generate
    from torchpar.models.decoder import Decoder

    model = Decoder(tiny_config("model.init_std=0.5", *ROW, *VARIANTS[variant]).model).eval()
    model.init_weights(0)
    with torch.no_grad():
        want = continue_by_forward(lambda row, n: int(model(torch.tensor([row]))[0, n].argmax()), PROMPT[0], 32)
    assert len(set(want)) > 3, want
    assert torch_generate(model, torch.tensor(PROMPT), 27)[0].tolist() == want


def _assert_samples_of(run_dir, train_out: str, generate_out: str, logits_at, draw) -> None:
    """The run (train.sample_every=2, train.steps=2) printed the sample its final model draws.

    The validation prompt continued token by token with draw(logits_at(row, n), index of the new token); the
    generate command (greedy, 8 tokens after "def ", from the run) printed the argmax continuation.
    """
    from jaxpar.core.data.order import open_splits
    from jaxpar.core.run.hooks import sample_lengths
    from jaxpar.core.run.resume import read_run_config
    from jaxpar.core.data.tokens import text_codec

    cfg = read_run_config(str(run_dir))
    decode = text_codec(cfg.data.tokenizer)[1]
    prompt_len, new = sample_lengths(cfg.model.max_seq_len)
    prompt = open_splits(cfg)[1].rows(0, 0, 1)[0, :prompt_len].tolist()
    sampled = continue_by_forward(lambda row, n: draw(logits_at(row, n), n + 1 - prompt_len), prompt, prompt_len + new)
    assert f"sample at step 2: {decode(prompt + sampled)!r}" in train_out.splitlines(), train_out[-2000:]
    greedy = continue_by_forward(lambda row, n: int(logits_at(row, n).argmax()), list(b"def "), len(prompt) + new, 8)
    assert generate_out == "def " + decode(greedy) + "\n", (generate_out, greedy)


def _run(module: str, *args: str) -> subprocess.CompletedProcess:
    from tests.helpers import torch_env

    r = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, env=torch_env(), capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r


GREEDY_FROM_RUN = ("--prompt", "def ", "--max-new-tokens", "8", "--temperature", "0")


SAMPLED = ["mla", "dilated"]


@pytest.mark.parametrize("variant", SAMPLED)
def test_samples_during_training_come_from_the_trained_model(variant, dataset, tmp_path):
    """Samples drawn during training come from the trained model.

    jaxpar: train.sample_every's sample (temperature 0.8, top_k 40, key = the step) is the final checkpoint's
    continuation drawn from the whole forward pass with the decoder's keys; `jaxpar.generate --run` decodes it.
    """
    from jaxpar.core.run.resume import read_run_config
    from jaxpar.decode import sample
    from jaxpar.generate import restore_params

    train = run_cli(tmp_path, dataset, *ROW, *VARIANTS[variant], "train.steps=2", "train.sample_every=2")
    assert train.returncode == 0, train.stderr[-3000:]
    generate = _run("jaxpar.generate", "--run", str(tmp_path), *GREEDY_FROM_RUN)
    cfg = read_run_config(str(tmp_path))
    params = restore_params(str(tmp_path), Layout(cfg, make_mesh({"dp": 1}, jax.devices()[:1])))[0]
    graphdef, key = abstract_model(cfg.model)[0], jax.random.key(2)
    forward = jax.jit(lambda p, t, n: nnx.merge(graphdef, p)(t)[:, n])
    _assert_samples_of(
        tmp_path,
        train.stdout,
        generate.stdout,
        lambda row, n: forward(params, jnp.asarray([row]), n),
        lambda logits, i: int(sample(logits, jax.random.fold_in(key, i), 0.8, 40, 1.0)[0]),
    )


@pytest.mark.parametrize("variant", SAMPLED)
def test_torchpar_samples_during_training_come_from_the_trained_model(variant, dataset, tmp_path):
    """The same with `torchpar.train --backend none` (a generator seeded with the step) and `torchpar.generate`."""
    torch = pytest.importorskip("torch")
    from torchpar.decode import sample
    from torchpar.models.decoder import Decoder
    from torchpar.weights import from_shared

    from tests.helpers import TINY

    weights = str(tmp_path / "final.safetensors")
    train = _run(
        "torchpar.train",
        "--backend",
        "none",
        *TINY,
        *ROW,
        *VARIANTS[variant],
        f"data.dataset={dataset}",
        f"run.dir={tmp_path}",
        "train.steps=2",
        "train.sample_every=2",
        "--write-final",
        weights,
    )
    generate = _run("torchpar.generate", "--run", str(tmp_path), *GREEDY_FROM_RUN)
    model = Decoder(tiny_config(*ROW, *VARIANTS[variant]).model).eval()
    model.load_state_dict(from_shared(read_weights(weights), model.cfg.n_layer))
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        _assert_samples_of(
            tmp_path,
            train.stdout,
            generate.stdout,
            lambda row, n: model(torch.tensor([row]))[:, n],
            lambda logits, i: int(sample(logits, generator, 0.8, 40, 1.0)[0]),
        )


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


# A distribution with a known nucleus: the probabilities below, at shuffled vocabulary positions. Sorted, the
# mass before each token is 0, .4, .7, .9, .96, ...: top_p = 0.85 keeps the first three tokens (the third starts
# at .7 < .85, the fourth at .9), top_p = 0.3 only the likeliest (it always stays), 0.95 the first four.
NUCLEUS_PROBS = [0.4, 0.3, 0.2, 0.06, 0.03, 0.01]
NUCLEUS_ORDER = [3, 0, 5, 1, 4, 2]  # vocabulary position of each probability above


@pytest.mark.parametrize("top_p,size", [(0.85, 3), (0.3, 1), (0.95, 4)])
@pytest.mark.parametrize("side", ["jaxpar", "torchpar"])
def test_top_p_draws_exactly_the_nucleus_in_proportion(side, top_p, size):
    """4000 draws at temperature 1.

    Every token of the nucleus and nothing else, each about as often as its probability renormalised over the
    nucleus (binomial standard deviation < 0.008; tolerance 0.04).
    """
    probs = np.zeros(len(NUCLEUS_PROBS))
    probs[NUCLEUS_ORDER] = NUCLEUS_PROBS
    logits = np.log(probs)[None].repeat(4000, 0)
    if side == "jaxpar":
        from jaxpar.decode import sample

        drawn = np.asarray(sample(jnp.asarray(logits, jnp.float32), jax.random.key(0), 1.0, 0, top_p))
    else:
        torch = pytest.importorskip("torch")
        from torchpar.decode import sample

        generator = torch.Generator().manual_seed(0)
        drawn = sample(torch.tensor(logits, dtype=torch.float32), generator, 1.0, 0, top_p).numpy()
    nucleus = NUCLEUS_ORDER[:size]
    assert set(drawn.tolist()) == set(nucleus)
    want = np.asarray(NUCLEUS_PROBS[:size]) / sum(NUCLEUS_PROBS[:size])
    np.testing.assert_allclose([np.mean(drawn == t) for t in nucleus], want, atol=0.04)


def test_converted_hugging_face_gpt2_decodes_as_transformers(tmp_path):
    """A random GPT-2 from transformers -> shared weights -> `python -m jaxpar.generate` greedy, 20 tokens."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from jaxpar.tools.convert import read

    config = transformers.GPT2Config(
        vocab_size=256, n_positions=64, n_embd=32, n_layer=2, n_head=4, initializer_range=0.5
    )
    torch.manual_seed(0)
    hf_model = transformers.GPT2LMHeadModel(config).eval()
    hf_model.save_pretrained(tmp_path / "hf")
    prompt = "def f(x):"
    with torch.no_grad():
        want = hf_model.generate(
            torch.tensor([list(prompt.encode())]), max_new_tokens=20, do_sample=False, pad_token_id=0
        )[0, len(prompt) :].tolist()
    assert len(set(want)) > 3, want
    save_weights(str(tmp_path / "w.safetensors"), unflatten(read("hf", str(tmp_path / "hf"))[0]))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxpar.generate",
            "--weights",
            str(tmp_path / "w.safetensors"),
            "--prompt",
            prompt,
            "--max-new-tokens",
            "20",
            "--temperature",
            "0",
        ],
        cwd=ROOT,
        capture_output=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == (prompt + bytes(want).decode("utf-8", "replace") + "\n").encode(), (out.stdout, want)


def test_jaxpar_and_torchpar_decode_the_same_tokens(tmp_path):
    """jaxpar and torchpar decode the same tokens from the same weights.

    The same shared weights through both commands, greedy, without --max-new-tokens (the tiny model's 32 positions hold
    fewer than 200 new tokens; both decode what the context leaves): the same text; torchpar's sampling is reproducible
    from its seed too.
    """
    torch = pytest.importorskip("torch")
    from torchpar.decode import generate as torch_generate
    from torchpar.models.decoder import Decoder
    from torchpar.weights import from_shared

    layout, _, params = model_on("dp=1")
    weights = str(tmp_path / "w.safetensors")
    save_weights(weights, jax.device_get(params))
    outs = [
        subprocess.run(
            [
                sys.executable,
                "-m",
                f"{side}.generate",
                "--weights",
                weights,
                "--prompt",
                "def f(x):",
                "--temperature",
                "0",
            ],
            cwd=ROOT,
            capture_output=True,
            timeout=300,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
        )
        for side in ("jaxpar", "torchpar")
    ]
    assert outs[0].returncode == outs[1].returncode == 0, (outs[0].stderr, outs[1].stderr)
    assert outs[0].stdout == outs[1].stdout and len(set(outs[0].stdout)) > 5, outs[0].stdout

    model = Decoder(layout.cfg.model)
    model.load_state_dict(from_shared(read_weights(weights), layout.cfg.model.n_layer))
    prompt = torch.tensor(PROMPT * 2)
    draw = lambda seed: torch_generate(model, prompt, 12, seed, temperature=1.0, top_k=50, top_p=0.9)
    first = draw(1)
    assert torch.equal(first, draw(1)) and not torch.equal(first, draw(2)) and not torch.equal(first[0], first[1])
