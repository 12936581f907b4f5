"""model.remat=offload in torchpar (torchpar/parallelize.py).

Every tensor a block saves for its backward is packed to host memory by torch's save_on_cpu and nothing is recomputed;
under --backend deepspeed, DeepSpeed's activation checkpointing with cpu_checkpointing (each block's input on the host,
the block recomputed). Training equals the run without it.
"""

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from tests.helpers import metrics, tiny_config
from tests.torchpar.runs import run


def _step(remat: str, compiled: bool = False):
    """Run one forward and backward of the tiny model, its blocks set up by torchpar's parallelize stage.

    Returns (loss, gradients, modules' forward calls, sizes of the tensors save_on_cpu packed).
    """
    from torchpar.models.decoder import next_token_loss
    from torchpar.parallelize import checkpoint_blocks, compile_blocks
    from torchpar.trainer import build_model

    cfg = tiny_config(f"model.remat={remat}")
    model = build_model(cfg)
    checkpoint_blocks(model, remat)
    if compiled:
        compile_blocks(model)
    calls, packed = [], []
    for module in model.modules():
        module.register_forward_hook(lambda *_: calls.append(1))

    class Counting(torch.autograd.graph.save_on_cpu):  # torch's, its pack hook counted
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            pack = self.pack_hook
            self.pack_hook = lambda t: packed.append(t.numel()) or pack(t)

    batch = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (4, cfg.data.seq_len + 1))).long()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.autograd.graph, "save_on_cpu", Counting)
        loss = next_token_loss(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
    return loss.item(), {n: p.grad.numpy().copy() for n, p in model.named_parameters()}, len(calls), packed


def test_offload_packs_the_blocks_activations_and_changes_nothing():
    """Activation offload packs each block's activations and changes nothing else.

    The same loss and gradients as plain blocks, no forward run twice, and save_on_cpu packed tensors in each block's
    forward (without the setting it packs none).
    """
    loss, grads, calls, packed = _step("none")
    got_loss, got_grads, got_calls, got_packed = _step("offload")
    assert packed == [] and len(got_packed) >= 2 * 10  # 2 blocks, each saving its norms', projections', ... inputs
    assert got_calls == calls
    assert got_loss == loss
    for name, g in grads.items():
        np.testing.assert_allclose(got_grads[name], g, rtol=1e-6, atol=1e-8)


def test_compiled_blocks_offload_alike():
    """train.compile's torch.compile of each block compiles the offloading forward (a GPU's default).

    Equal within 1e-5, and save_on_cpu's hooks still pack.
    """
    loss, grads, _, _ = _step("none")
    got_loss, got_grads, _, packed = _step("offload", compiled=True)
    assert packed
    np.testing.assert_allclose(got_loss, loss, rtol=1e-6)
    for name, g in grads.items():
        np.testing.assert_allclose(got_grads[name], g, rtol=1e-5, atol=1e-7)


def _final(base, name: str, backend: str, *overrides: str):
    run_dir, final = base["tmp"] / name, base["tmp"] / f"{name}.safetensors"
    out = run(
        [
            "--backend",
            backend,
            *base["args"],
            f"run.dir={run_dir}",
            "train.steps=4",
            "train.eval_every=0",
            "--write-final",
            str(final),
            *overrides,
        ],
        nproc=2,
    )
    return metrics(run_dir), load_file(str(final)), out.stdout


@pytest.mark.parametrize("backend,overrides", [("fsdp", ()), ("deepspeed", ("parallel.zero_stage=2",))])
def test_offload_equals_no_offload(backend, overrides, base):
    """Two processes, four steps: losses and final weights within 1e-5.

    DeepSpeed's config carries the section that turns its cpu_checkpointing on (read by
    deepspeed.checkpointing.configure).
    """
    ref_m, ref_w, _ = _final(base, f"{backend}-ref", backend, *overrides)
    got_m, got_w, out = _final(base, f"{backend}-offload", backend, *overrides, "model.remat=offload")
    if backend == "deepspeed":
        assert '"activation_checkpointing": {"cpu_checkpointing": true, "partition_activations": true}' in out, out
    np.testing.assert_allclose(
        [got_m[s]["loss"] for s in range(1, 5)], [ref_m[s]["loss"] for s in range(1, 5)], rtol=1e-5
    )
    for name, w in ref_w.items():
        np.testing.assert_allclose(got_w[name], w, rtol=1e-5, atol=1e-6)
