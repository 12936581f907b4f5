"""Weight conversion: HF GPT-2 <-> shared weight format <-> jaxpar checkpoint, bit-exact; HF logits match."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxpar.tools import convert
from jaxpar.formats.hf_gpt2 import hf_to_shared

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=97, n_positions=24, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # non-trivial biases and norms, so a mix-up would show
        for name, p in model.named_parameters():
            if "ln" in name or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("hf")
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_tensors(path):
    return {
        k.removeprefix("transformer."): v
        for k, v in load_file(str(path / "model.safetensors")).items()
        if not k.startswith("lm_head")
    }


def test_hf_logits_match_jaxpar(hf_dir):
    import jax
    from flax import nnx

    from jaxpar.core.weights.names import unflatten
    from jaxpar.core.config.schema import load_config
    from jaxpar.models.decoder import Decoder

    flat, dims = hf_to_shared(str(hf_dir))
    cfg = load_config(None, [f"model.{k}={v}" for k, v in dims.items()] + ["data.seq_len=24"]).model
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))), nnx.Param)
    model = nnx.merge(graphdef, unflatten({k: jax.numpy.asarray(v) for k, v in flat.items()}))
    tokens = np.random.default_rng(0).integers(0, 97, (3, 24))
    with jax.default_matmul_precision("highest"):
        ours = np.asarray(model(jax.numpy.asarray(tokens)))
    hf = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        theirs = hf(torch.as_tensor(tokens)).logits.numpy()
    assert np.max(np.abs(ours - theirs)) < 1e-4


@pytest.mark.parametrize("via", ["shared", "jaxpar"])
def test_hf_round_trip_is_bit_exact(hf_dir, tmp_path, via):
    mid, back = tmp_path / ("w.safetensors" if via == "shared" else "run"), tmp_path / "hf_back"
    assert convert.main(["--from", "hf", str(hf_dir), "--to", via, str(mid)]) == 0
    assert convert.main(["--from", via, str(mid), "--to", "hf", str(back)]) == 0
    original, returned = hf_tensors(hf_dir), hf_tensors(back)
    assert set(original) <= set(returned) | {k for k in original if k.endswith(("attn.bias", "masked_bias"))}
    for name, value in original.items():
        if name in returned:
            assert returned[name].dtype == value.dtype and np.array_equal(returned[name], value), name
    back_cfg = json.loads((back / "config.json").read_text())
    assert (back_cfg["n_layer"], back_cfg["n_head"], back_cfg["n_embd"]) == (2, 4, 32)


def test_convert_errors_are_one_line(tmp_path, capsys):
    assert convert.main(["--from", "hf", str(tmp_path), "--to", "shared", str(tmp_path / "x.safetensors")]) == 2
    assert "config.json is missing" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,named",
    [
        (["--from", "state", "a", "--to", "state", "b"], "the training state converts from"),
        (["--from", "deepspeed", "a", "--to", "jaxpar", "b"], "a DeepSpeed run is read with --from torchpar"),
        (["--from", "deepspeed", "a", "--to", "hf", "b"], "a DeepSpeed run is read with --from torchpar"),
        (["--from", "jaxpar", "a", "--to", "torchpar", "b", "--zero-stage", "2"], "--zero-stage is for --to deepspeed"),
        (["--from", "jaxpar", "a", "--to", "shared", "b", "--zero-stage", "2"], "--zero-stage is for --to deepspeed"),
        (["--from", "state", "missing.safetensors", "--to", "torchpar", "b"], "training-state file not found"),
        (["--from", "jaxpar", "a", "--to", "deepspeed", "held"], "held already holds checkpoints; refusing to mix"),
    ],
)
def test_whole_state_conversions_refused_in_one_line(argv, named, tmp_path, capsys, monkeypatch):
    """The last one fails in torchpar.tools.convert (a subprocess): its error line comes back as this one's."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "held" / "checkpoints").mkdir(parents=True)
    assert convert.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0], err
    assert not (tmp_path / "b").exists()
