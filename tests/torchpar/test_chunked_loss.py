"""torchpar's output head and cross-entropy in chunks of positions (model.loss_chunks, torchpar/models/head.py).

The whole logits' loss and gradients on the plain model, and the same training on every backend's engine.
"""

import json
import sys

import numpy as np
import pytest
import torch

from tests.helpers import assert_params_close, free_port, run_in_session, tiny_config, torch_env
from torchpar.models.decoder import Decoder


def rows(cfg, seed: int = 0) -> torch.Tensor:
    """Random token rows with packed documents and a third of the targets masked out.

    Rows [batch, seq + 1] of random tokens with packed documents (token 0 starts one) and a third of the targets skipped
    by the loss (negative).
    """
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, cfg.model.vocab_size, (cfg.train.global_batch_size, cfg.data.seq_len + 1))
    tokens[rng.random(tokens.shape) < 0.1] = 0
    return torch.as_tensor(np.where(rng.random(tokens.shape) < 0.3, ~tokens, tokens))


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        ("model.family=llama", "model.n_kv_head=2", "model.tie_embeddings=false"),
        ("model.moe_experts=4", "model.moe_aux_loss=0.01"),
    ],
    ids=["gpt2", "llama-untied", "moe"],
)
def test_chunks_give_the_whole_logits_loss_and_gradients(overrides):
    """Loss masks and packed documents; with experts their statistics (read by the balance loss) as well."""
    cfg = tiny_config(*overrides)
    model, batch = Decoder(cfg.model, eod=0), rows(cfg)
    model.init_weights(0)

    def loss_and_grads(n: int):
        cfg.model.loss_chunks = n
        model.zero_grad()
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        stats = None if model.expert_stats is None else model.expert_stats.detach().clone()
        return float(loss), {k: p.grad.clone() for k, p in model.named_parameters()}, stats

    (whole, grads, stats), (got, got_grads, got_stats) = loss_and_grads(1), loss_and_grads(4)
    assert got == pytest.approx(whole, rel=1e-6)
    if stats is not None:
        assert torch.equal(got_stats, stats)
    for name, g in grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_the_compiled_chunk_equals_the_eager_one_in_bfloat16():
    """train.compile compiles the loss's chunk too (parallelize.compile_blocks): loss and gradients within 1e-5.

    bfloat16 compute, so the compiled chunk's casts are those the eager one makes; masked targets included.
    """
    from torchpar.models.head import chunk_loss
    from torchpar.parallelize import compile_blocks

    cfg = tiny_config("model.compute_dtype=bfloat16", "model.loss_chunks=4")
    model, batch = Decoder(cfg.model), rows(cfg)
    compiled_model = Decoder(cfg.model)
    compile_blocks(compiled_model)  # what train.compile runs: it compiles the loss's chunk as well
    assert model.loss_chunk is chunk_loss and compiled_model.loss_chunk is not chunk_loss
    model.init_weights(0)

    def loss_and_grads():
        model.zero_grad()
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        return float(loss), {k: p.grad.float().clone() for k, p in model.named_parameters()}

    eager = loss_and_grads()
    model.loss_chunk = torch.compile(chunk_loss)
    compiled = loss_and_grads()
    assert compiled[0] == pytest.approx(eager[0], abs=1e-5)
    for name, g in eager[1].items():
        torch.testing.assert_close(compiled[1][name], g, rtol=1e-5, atol=1e-5, msg=name)


BACKENDS = {
    "none": ("none", 0, ()),
    "ddp": ("ddp", 2, ()),
    "fsdp": ("fsdp", 2, ()),
    "deepspeed-zero3": ("deepspeed", 2, ("parallel.zero_stage=3",)),
    "pipeline-1f1b": ("pipeline", 2, ("parallel.pipeline_schedule=1f1b",)),
}


@pytest.mark.parametrize("backend,nproc,overrides", BACKENDS.values(), ids=BACKENDS.keys())
def test_a_backend_trains_in_chunks_as_with_the_whole_logits(backend, nproc, overrides, tmp_path):
    """tests/torchpar/chunked_loss_ranks.py: two updates in 4 chunks equal two with the whole logits.

    The table's gradient taken in the model's forward reaches each wrapper's reduction (DDP's all-reduce, FSDP2's
    and ZeRO-3's reduce-scatter, the pipeline's last stage and tied-embedding sum) -- and only the chunked run
    chunks.
    """
    script = ["tests/torchpar/chunked_loss_ranks.py", backend, str(tmp_path), *overrides]
    command = (
        [sys.executable, *script]
        if nproc == 0
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            f"--master_port={free_port()}",
            *script,
        ]
    )
    out = run_in_session(command, torch_env(), 240, f"chunked loss on {backend}")
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    np.testing.assert_allclose(result["chunked"], result["whole"], rtol=1e-5)
    assert result["calls"][0] == 0 and result["calls"][1] > 0
    assert_params_close(dict(np.load(tmp_path / "chunked.npz")), dict(np.load(tmp_path / "whole.npz")))
