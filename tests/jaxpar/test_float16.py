"""float16 compute with dynamic loss scaling, in jaxpar and torchpar.

jaxpar/loss_scale.py, torchpar: torch.amp.GradScaler. An overflowing step is skipped exactly and halves the scale, clean
steps grow it, the scaler resumes exactly after SIGKILL, layouts agree with one device within the float16 band
(docs/parity.md), refusals are one line.
jaxpar vs torchpar float16 trajectories: parity_tests (configs/parity/float16.yaml).
"""

import math
import os
import signal

import jax
import numpy as np
import pytest

from jaxpar.core.errors import UserError
from jaxpar.core.config.mesh_spec import parse_mesh
from tests.helpers import deepspeed_cpu_has_float16, metrics, run_cli, run_steps, tiny_config

FP16 = ("model.compute_dtype=float16",)
# the float16 band of a layout against one device (docs/parity.md "float16"): float16 rounds at 2^-11, and
# layouts sum partial products in another order; measured: loss 4e-5, grad_norm 2e-4, parameters 2e-3 relative
# norm (Adam amplifies the rounding in near-zero gradients; 2026-11-23)
LOSS_RTOL, GNORM_RTOL, PARAM_RTOL = 2e-4, 2e-3, 1e-2


@pytest.fixture(scope="module")
def fp16_reference(dataset):
    return run_steps(tiny_config(*FP16), "dp=1", dataset, devices=jax.devices()[:1])


# dp=8 and fsdp=8 also run against torchpar in parity_tests --parity-full (float16 rows)
@pytest.mark.parametrize("mesh", ["dp=8", "fsdp=8", "dp=2,tp=4"])
def test_float16_layout_matches_single_device(mesh, dataset, fp16_reference):
    ref = fp16_reference
    got = run_steps(tiny_config(*FP16), mesh, dataset, devices=jax.devices()[: math.prod(parse_mesh(mesh).values())])
    assert ref["loss"][-1] < ref["loss"][0] - 0.1, "the reference run should learn something"
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=LOSS_RTOL)
    np.testing.assert_allclose(got["grad_norm"], ref["grad_norm"], rtol=GNORM_RTOL)
    diff = np.sqrt(sum(np.sum((got["params"][k] - v) ** 2) for k, v in ref["params"].items()))
    assert diff / np.sqrt(sum(np.sum(v**2) for v in ref["params"].values())) < PARAM_RTOL


def test_float16_is_not_float32_under_another_name(fp16_reference, reference):
    assert fp16_reference["loss"] != reference["loss"]
    np.testing.assert_allclose(fp16_reference["loss"], reference["loss"], rtol=5e-3)


def test_overflow_skips_exactly_that_update_and_halves_the_scale(dataset):
    """An overflowing step skips exactly its update and halves the loss scale.

    In process: a step with overflowing gradients leaves parameters and optimizer state bit-identical, halves the scale,
    counts one skipped step; the next clean step grows it back (growth interval 1).
    """
    from jaxpar.data import TokenBatches, device_batch
    from jaxpar.layout import Layout
    from jaxpar.mesh import make_mesh
    from jaxpar.state import init_state
    from jaxpar.step import make_train_step

    cfg = tiny_config(*FP16, "optim.loss_scale_growth_interval=1", "optim.loss_scale_init=1024")
    layout = Layout(cfg, make_mesh({"dp": 2}, jax.devices()[:2]))
    data = TokenBatches(dataset, cfg.data.seq_len, cfg.train.global_batch_size, 0, "train", cfg.data.val_fraction)
    state = init_state(layout)
    before = jax.device_get(state)
    state, m = make_train_step(layout, inject_overflow=True)(state, device_batch(data, 0, layout.batch_sharding))
    after = jax.device_get(state)
    for a, b in zip(
        jax.tree.leaves((before["params"], before["opt_state"])), jax.tree.leaves((after["params"], after["opt_state"]))
    ):
        np.testing.assert_array_equal(a, b)
    assert (float(m["loss_scale"]), int(m["skipped_steps"]), float(after["loss_scale"]["scale"])) == (1024, 1, 512)
    assert not math.isfinite(float(m["grad_norm"])) and math.isfinite(float(m["loss"]))
    state, m = make_train_step(layout)(state, device_batch(data, 1, layout.batch_sharding))
    changed = jax.device_get(state)
    assert float(m["loss_scale"]) == 512 and float(changed["loss_scale"]["scale"]) == 1024
    from jaxpar.core.optimizer.lr_schedule import lr_at

    assert np.isclose(float(m["lr"]), lr_at(0, cfg.optim, cfg.train.steps))  # the schedule counts applied updates
    assert not np.array_equal(changed["params"]["wte"], after["params"]["wte"])


RUN = [*FP16, "train.steps=12", "checkpoint.every=4", "train.eval_every=0", "optim.loss_scale_growth_interval=3"]
# an overflow at step 3 halves the scale; after 3 clean steps (4, 5, 6) it doubles from step 7, and again from 10
SCALES = [65536] * 3 + [32768] * 3 + [65536] * 3 + [131072] * 3


def _overflow_run_resumes_exactly(tmp_path, dataset, args, prefix: str, module: str):
    """Check an injected overflow's records and an exact resume after SIGKILL; return the full run.

    An injected overflow at step 3 shows in metrics.jsonl (skipped_steps, loss_scale, the schedule held), and a run
    killed after step 6 resumes from its step-4 checkpoint to the same numbers.
    """
    fault = {f"{prefix}_FAULT_OVERFLOW_AT_STEP": "3"}
    full = run_cli(tmp_path / "full", dataset, *args, env=fault, module=module)
    assert full.returncode == 0, full.stderr
    m = metrics(tmp_path / "full")
    assert [m[s]["skipped_steps"] for s in range(1, 13)] == [0, 0] + [1] * 10
    assert [m[s]["loss_scale"] for s in range(1, 13)] == SCALES
    assert m[4]["lr"] == m[3]["lr"]  # the skipped update did not advance the schedule
    killed = run_cli(
        tmp_path / "k", dataset, *args, env={**fault, f"{prefix}_FAULT_KILL_AFTER_STEP": "6"}, module=module
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert sorted(os.listdir(tmp_path / "k" / "checkpoints")) == ["4"]
    resumed = run_cli(tmp_path / "k", dataset, *args, module=module)
    assert resumed.returncode == 0, resumed.stderr
    r = metrics(tmp_path / "k")
    for step in range(5, 13):
        for key in ("loss", "grad_norm", "lr", "loss_scale", "skipped_steps"):
            assert r[step][key] == m[step][key], (step, key)
    return full


def test_float16_run_with_an_overflow_resumes_exactly_after_sigkill(dataset, tmp_path):
    full = _overflow_run_resumes_exactly(tmp_path, dataset, ("--mesh", "dp=2", *RUN), "JAXPAR", "jaxpar.train")
    assert "scale 32768" in full.stdout and "skipped 1" in full.stdout  # the console line


@pytest.mark.parametrize(
    "overrides,message",
    [
        (("optim.loss_scale_init=1024",), "optim.loss_scale_init applies to model.compute_dtype=float16 only"),
        ((*FP16, "optim.loss_scale_min=4096", "optim.loss_scale_init=1024"), "optim.loss_scale_min=4096.0 exceeds"),
    ],
)
def test_loss_scale_refusals_are_one_line(overrides, message):
    with pytest.raises(UserError, match=message):
        tiny_config(*overrides)


def test_resume_may_not_switch_into_float16(tmp_path):
    import json

    from jaxpar.core.run.resume import check_resume

    (tmp_path / "checkpoints" / "0").mkdir(parents=True)
    (tmp_path / "config.json").write_text(json.dumps(tiny_config(f"run.dir={tmp_path}").to_dict()))
    check_resume(tiny_config(f"run.dir={tmp_path}", "model.compute_dtype=bfloat16"))  # free
    with pytest.raises(UserError, match="model.compute_dtype"):
        check_resume(tiny_config(f"run.dir={tmp_path}", *FP16))


# --- torchpar: torch.amp.GradScaler with the same keys and rule -----------------------------------------


def test_torchpar_overflow_skips_exactly_that_update_and_halves_the_scale(tmp_path):
    import torch

    from jaxpar.core.optimizer.lr_schedule import lr_at
    from torchpar import backends, dist
    from torchpar.models.decoder import Decoder

    cfg = tiny_config(*FP16, "optim.loss_scale_growth_interval=1", "optim.loss_scale_init=1024", f"run.dir={tmp_path}")
    model = Decoder(cfg.model)
    model.init_weights(0)
    engine = backends.build("none", model, cfg, dist.init(False, 60.0))
    batch = torch.randint(0, 256, (8, cfg.data.seq_len + 1), generator=torch.Generator().manual_seed(0))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine.inject_overflow()
    _, norm, _, extra = engine.update(batch)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not engine.optimizer.state  # AdamW never stepped: no moments, no step count
    assert extra == {"loss_scale": 1024.0, "skipped_steps": 1} and engine.scaler.get_scale() == 512
    assert not torch.isfinite(norm)
    _, norm, lr, extra = engine.update(batch)
    assert extra == {"loss_scale": 512.0, "skipped_steps": 1} and engine.scaler.get_scale() == 1024
    assert lr == lr_at(0, cfg.optim, cfg.train.steps) and torch.isfinite(norm)
    assert not torch.equal(model.wte, before["wte"])


def test_torchpar_float16_overflow_run_resumes_exactly_after_sigkill(dataset, tmp_path):
    """--backend none: the same scale pattern as jaxpar's; the scaler and skipped count resume from meta.json."""
    _overflow_run_resumes_exactly(tmp_path, dataset, ("--backend", "none", *RUN), "TORCHPAR", "torchpar.train")


@pytest.mark.parametrize(
    "backend,overrides,message",
    [
        ("deepspeed", FP16, "accelerator has no float16 support on this machine"),
        ("deepspeed", (*FP16, "optim.loss_scale_init=1000"), "DeepSpeed's loss scaler grows x2"),
        ("pipeline", FP16, "runs on --backend none, ddp, fsdp or deepspeed, not pipeline"),
    ],
)
def test_torchpar_float16_refusals_are_one_line(backend, overrides, message, dataset, tmp_path):
    if "no float16 support" in message and deepspeed_cpu_has_float16():
        pytest.skip("this CPU has oneDNN float16 kernels: DeepSpeed's CPU accelerator runs float16 here")
    r = run_cli(tmp_path, dataset, "--backend", backend, *overrides, module="torchpar.train")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert message in r.stderr, r.stderr


@pytest.mark.parametrize(
    "section,message",
    [
        ({"activation_checkpointing": {"partition_activations": True}}, "recomputes blocks by model.remat"),
        ({"fp16": {"enabled": True}}, "enables fp16, but model.compute_dtype=float32"),
    ],
)
def test_deepspeed_json_that_contradicts_the_shared_keys_is_refused(section, message, tmp_path):
    """A DeepSpeed section that contradicts the shared keys is refused in one line.

    A user's DeepSpeed section the model would not act on (activation checkpointing: the model recomputes by
    model.remat) or a precision other than model.compute_dtype: one line before any process group.
    """
    import json

    from torchpar.backends import deepspeed

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(section))
    with pytest.raises(UserError, match=message):
        deepspeed.check_deepspeed(tiny_config(), str(path))
