"""Recomputation is applied by the parallelize functions, never by the models.

Both parallelize functions (jaxpar/parallelize.py, torchpar/parallelize.py) apply recomputation (model.remat) from
outside the models, in their fixed order; the models alone never recompute.
"""

import jax
import numpy as np
import pytest
import torch

from tests.helpers import tiny_config


def jaxpr_primitives(jaxpr) -> set[str]:
    """Every primitive's name in a closed jaxpr, nested jaxprs (scans, checkpoints, shard_maps) included."""
    from jax.extend.core import jaxprs_in_params

    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for inner in jaxprs_in_params(eqn.params):
            names |= jaxpr_primitives(inner)
    return names


def recomputes(primitives: set[str]) -> bool:
    """A checkpointed region among them (jax.checkpoint's primitive: "checkpoint", "remat2" once differentiated)."""
    return any("remat" in name or "checkpoint" in name for name in primitives)


def jax_step_primitives(cfg) -> set[str]:
    from jaxpar.layout import Layout
    from jaxpar.mesh import make_mesh
    from jaxpar.state import abstract_state
    from jaxpar.step import make_train_step

    layout = Layout(cfg, make_mesh({"dp": 1}, jax.devices()[:1]))
    batch = jax.ShapeDtypeStruct(layout.batch_shape, "int32", sharding=layout.batch_sharding)
    return jaxpr_primitives(jax.make_jaxpr(make_train_step(layout))(abstract_state(layout), batch).jaxpr)


def torch_run(cfg, checkpointed: bool):
    """Run one forward and backward of the tiny model, its blocks checkpointed or plain.

    Returns (loss, gradients, modules' forward calls, bytes autograd saved outside recomputed regions); the blocks are
    checkpointed by torchpar's parallelize stage or left plain.
    """
    from torchpar.models.decoder import next_token_loss
    from torchpar.parallelize import checkpoint_blocks
    from torchpar.trainer import build_model

    model = build_model(cfg)
    if checkpointed:
        checkpoint_blocks(model, cfg.model.remat)
    calls, saved = [], []
    for module in model.modules():
        module.register_forward_hook(lambda *_: calls.append(1))
    batch = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (4, cfg.data.seq_len + 1))).long()
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t
    ):
        loss = next_token_loss(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
    grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
    return loss.item(), grads, len(calls), sum(saved), list(model.state_dict())


def test_model_remat_recomputes_in_both_trainers():
    """The contract's evidence for model.remat (jaxpar/core/config/contract.py).

    jaxpar's train step holds a checkpointed region exactly when model.remat is set, and torchpar's parallelized
    blocks run their forward again in the backward pass.
    """
    assert not recomputes(jax_step_primitives(tiny_config()))
    assert recomputes(jax_step_primitives(tiny_config("model.remat=full")))
    plain = torch_run(tiny_config(), checkpointed=True)[2]
    assert torch_run(tiny_config("model.remat=full"), checkpointed=True)[2] > plain


@pytest.mark.parametrize("remat", ["full", "save_matmuls"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_torchpar_checkpointed_blocks_keep_names_and_numbers(remat, family):
    """Checkpointed torchpar blocks keep the parameter names and numbers and recompute the forward.

    checkpoint_blocks: the same parameter names (the shared weight format, DCP), the same loss and gradients, the
    forward recomputed, less kept for the backward pass; under no_grad the blocks run as plain ones.
    """
    cfg = tiny_config(f"model.remat={remat}", f"model.family={family}")
    loss, grads, calls, saved, names = torch_run(cfg, checkpointed=False)
    c_loss, c_grads, c_calls, c_saved, c_names = torch_run(cfg, checkpointed=True)
    assert c_names == names and c_grads.keys() == grads.keys()
    np.testing.assert_allclose(c_loss, loss, rtol=1e-6)
    for name, g in grads.items():
        np.testing.assert_allclose(c_grads[name], g, rtol=1e-6, atol=1e-7, err_msg=name)
    assert c_calls > calls and c_saved < saved


def test_torchpar_parallelize_checkpoints_then_compiles_then_wraps(monkeypatch):
    """torchpar's order: activation checkpointing -> compile -> the backend's wrapper (torchtitan's)."""
    from torchpar import backends
    from torchpar import parallelize as stages
    from torchpar.dist import Env
    from torchpar.trainer import build_model

    seen = []
    checkpointed = lambda model: all(isinstance(b, stages.CheckpointedBlock) for b in model.blocks)
    monkeypatch.setattr(stages, "compile_blocks", lambda model: seen.append(("compile", checkpointed(model))))
    monkeypatch.setattr(backends, "build", lambda backend, model, *a, **k: seen.append(("wrap", checkpointed(model))))
    cfg = tiny_config("model.remat=full", "train.compile=on")
    stages.parallelize(build_model(cfg), cfg, Env(0, 1, 0, torch.device("cpu")), "none")
    assert seen == [("compile", True), ("wrap", True)]
