"""parallel.offload: state kept in host memory between steps reproduces the on-device run.

jaxpar offloads by memory kinds, torchpar by DeepSpeed's offload_optimizer/offload_param. A resumed offloaded run is
exact; where a backend cannot offload on this machine, one line says why.
"""

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxpar.core.errors import UserError
from tests.helpers import (
    assert_resumes_exactly,
    metrics,
    run_cli,
    run_in_session,
    run_steps,
    tiny_config,
    torch_command,
    torch_env,
)


@pytest.mark.parametrize("mesh,offload", [("fsdp=4", "optimizer"), ("dp=2,tp=2", "params+optimizer")])
def test_jaxpar_offloaded_run_equals_the_one_on_devices(mesh, offload, dataset):
    from jaxpar.core.config.mesh_spec import parse_mesh
    from jaxpar.layout import Layout
    from jaxpar.mesh import make_mesh
    from jaxpar.state import init_state

    n = int(np.prod(list(parse_mesh(mesh).values())))
    ref = run_steps(tiny_config(), mesh, dataset, steps=5, devices=jax.devices()[:n])
    got = run_steps(tiny_config(f"parallel.offload={offload}"), mesh, dataset, steps=5, devices=jax.devices()[:n])
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-6)
    for name, value in ref["params"].items():
        np.testing.assert_allclose(got["params"][name], value, rtol=1e-6, atol=1e-7)
    # the state really rests in host memory: what was offloaded, and only that
    layout = Layout(tiny_config(f"parallel.offload={offload}"), make_mesh(parse_mesh(mesh), jax.devices()[:n]))
    kinds = {k: {x.sharding.memory_kind for x in jax.tree.leaves(v)} for k, v in init_state(layout).items()}
    host = {"opt_state"} | ({"params"} if offload == "params+optimizer" else set())
    assert all(kinds[k] == ({"pinned_host"} if k in host else {"device"}) for k in kinds), kinds


def test_jaxpar_offloaded_run_resumes_exactly_after_sigkill(dataset, tmp_path):
    """The checkpoint of host-memory arrays: the resumed run equals the uninterrupted one."""
    args = (
        "--mesh",
        "fsdp=4",
        "parallel.offload=params+optimizer",
        "train.steps=8",
        "checkpoint.every=4",
        "train.eval_every=0",
    )
    assert_resumes_exactly(tmp_path, dataset, args, kill_after=6)


def _deepspeed_final(tmp_path, dataset, name, *overrides):
    from tests.helpers import TINY

    final = tmp_path / f"{name}.safetensors"
    args = [
        "--backend",
        "deepspeed",
        *TINY,
        f"data.dataset={dataset}",
        f"run.dir={tmp_path / name}",
        "train.steps=4",
        "train.eval_every=0",
        "--write-final",
        str(final),
        *overrides,
    ]
    proc = run_in_session(torch_command(args, 2), torch_env(), 300, name)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return metrics(tmp_path / name), load_file(str(final)), proc.stdout


@pytest.mark.parametrize("stage,offload", [(3, "params+optimizer"), (2, "optimizer")])
def test_deepspeed_offload_equals_no_offload(stage, offload, dataset, tmp_path):
    """Two processes on CPU with torch's AdamW on the host (no DeepSpeed C++ op build)."""
    ref_m, ref_w, _ = _deepspeed_final(tmp_path, dataset, "ref", f"parallel.zero_stage={stage}")
    got_m, got_w, out = _deepspeed_final(
        tmp_path, dataset, "off", f"parallel.zero_stage={stage}", f"parallel.offload={offload}"
    )
    assert '"offload_optimizer": {"device": "cpu"}' in out and ('"offload_param"' in out) == (stage == 3), out
    np.testing.assert_allclose(
        [got_m[s]["loss"] for s in range(1, 5)], [ref_m[s]["loss"] for s in range(1, 5)], rtol=1e-6
    )
    # all parameters within 1e-6 relative norm (per element, the attention key bias moves by rounding noise
    # alone: its true gradient is zero, tests/helpers.assert_params_close)
    diff = np.sqrt(sum(np.sum((got_w[k].astype(np.float64) - v) ** 2) for k, v in ref_w.items()))
    assert diff / np.sqrt(sum(np.sum(v.astype(np.float64) ** 2) for v in ref_w.values())) < 1e-6


@pytest.mark.parametrize(
    "backend,overrides,message",
    [
        (
            "ddp",
            ("parallel.offload=optimizer",),
            "needs --backend fsdp or deepspeed (ddp keeps its state on the device)",
        ),
        (
            "fsdp",
            ("parallel.offload=optimizer",),
            "FSDP2 offloads parameters, gradients and the optimizer step together",
        ),
        ("fsdp", ("parallel.offload=params+optimizer",), "needs a GPU to offload from"),
        ("deepspeed", ("parallel.offload=optimizer",), "needs parallel.zero_stage >= 1"),
        ("deepspeed", ("parallel.offload=params+optimizer", "parallel.zero_stage=2"), "needs parallel.zero_stage=3"),
    ],
)
def test_torchpar_offload_refusals_are_one_line(backend, overrides, message):
    import torch

    from torchpar.checks import check_offload

    if backend == "fsdp" and "params+optimizer" in overrides[0] and torch.cuda.is_available():
        pytest.skip("this machine has a GPU: FSDP2 offloads")
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_offload(tiny_config(*overrides), backend)


def test_cpu_offload_flag_names_its_replacement(dataset, tmp_path):
    r = run_cli(tmp_path, dataset, "--backend", "none", "--cpu-offload", module="torchpar.train")
    assert r.returncode == 2 and "replaced by the config key parallel.offload" in r.stderr
