"""model.remat=offload in jaxpar.

Each layer's projection outputs wait in host memory (pinned_host) between the forward and the backward pass, the rest
recomputed (jaxpar/ops.py REMAT_POLICIES). Training equals the run without it; the traced step really holds those
residuals in host memory (XLA:CPU then keeps them in its one memory: what a CPU can and cannot show,
docs/architecture.md "Mixed precision and offload"); the planner counts them per device.
"""

import math

import jax
import numpy as np
import pytest

from jaxpar.core.errors import UserError
from tests.helpers import assert_params_close, run_steps, tiny_config

# tiny_config: 2 layers, batch 8 x 16 tokens, d_model 32 (gpt2: qkv 3d, attention output d, MLP 4d)
LAYERS, ROWS, T, D = 2, 8, 16, 32
PROJECTED = LAYERS * ROWS * T * (3 * D + D + 4 * D) * 4  # the down projection's output is the layer's: not kept


def _layout(cfg, mesh: dict):
    from jaxpar.layout import Layout
    from jaxpar.mesh import make_mesh

    return Layout(cfg, make_mesh(mesh, jax.devices()[: math.prod(mesh.values())]))


@pytest.mark.parametrize("mesh", ["dp=1", "fsdp=2,tp=2", "pp=2"])
def test_offload_equals_no_offload(mesh, dataset):
    """Activation offload gives the same losses and weights as no offload.

    Three steps: the same losses and weights within 1e-5 (pp=2: GPipe, whose vmap over the stages keeps the projections'
    names).
    """
    n = math.prod(int(a.split("=")[1]) for a in mesh.split(","))
    ref = run_steps(tiny_config(), mesh, dataset, steps=3, devices=jax.devices()[:n])
    got = run_steps(tiny_config("model.remat=offload"), mesh, dataset, steps=3, devices=jax.devices()[:n])
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5)
    assert_params_close(got["params"], ref["params"])


def host_residuals(jaxpr) -> list:
    """The arrays in host memory that the outermost loops (or unrolled layers) of a traced step produce."""
    from jax.extend.core import jaxprs_in_params

    found = []
    for eqn in jaxpr.eqns:
        host = [v.aval for v in eqn.outvars if getattr(v.aval, "memory_space", None) == jax.memory.Space.Host]
        if host:
            found += host
            continue
        for inner in jaxprs_in_params(eqn.params):
            found += host_residuals(inner)
    return found


@pytest.mark.parametrize("remat", ["offload", "save_matmuls"])
def test_the_step_keeps_the_projections_in_host_memory(remat):
    """The traced train step.

    With offload, the layers' loop stacks each projection's output in host memory (qkv, attention output, MLP up),
    nothing else; save_matmuls keeps its matmuls on the device.
    """
    from jaxpar.state import abstract_state
    from jaxpar.step import make_train_step

    layout = _layout(tiny_config(f"model.remat={remat}"), {"dp": 1})
    batch = jax.ShapeDtypeStruct(layout.batch_shape, "int32", sharding=layout.batch_sharding)
    jaxpr = jax.make_jaxpr(make_train_step(layout))(abstract_state(layout), batch).jaxpr
    host = host_residuals(jaxpr)
    if remat == "save_matmuls":
        assert host == []
        return
    assert sorted(a.shape for a in host) == sorted(
        [(LAYERS, ROWS, T, 3, 4, D // 4), (LAYERS, ROWS, T, D), (LAYERS, ROWS, T, 4 * D)]
    )
    assert sum(a.size * a.dtype.itemsize for a in host) == PROJECTED


@pytest.mark.parametrize(
    "mesh,share",
    [({"dp": 1}, 1.0), ({"fsdp": 2, "tp": 2}, (3 * D / 4 + D / 2 + D) / (8 * D)), ({"dp": 2}, 0.5)],
    ids=["dp=1", "fsdp=2,tp=2", "dp=2"],
)
def test_offloaded_bytes_per_device(mesh, share):
    """What the planner counts (jaxpar/cost/activations.py): one device's shard of them as GSPMD places it.

    fsdp halves the rows, tp the heads and the MLP width; the attention output is whole on each tp device.
    """
    from jaxpar.cost.activations import offloaded_bytes

    assert offloaded_bytes(_layout(tiny_config("model.remat=offload"), mesh)) == PROJECTED * share
    assert offloaded_bytes(_layout(tiny_config("model.remat=save_matmuls"), mesh)) == 0


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_the_executor_schedules_refuse_it_in_one_line(schedule):
    with pytest.raises(UserError, match=f"parallel.pipeline_schedule={schedule} does not run model.remat=offload"):
        _layout(tiny_config("model.remat=offload", f"parallel.pipeline_schedule={schedule}"), {"pp": 2})


def test_the_planner_shows_the_device_bytes_falling():
    """The planner shows offload lowering the device's activation bytes and peak.

    jaxpar.tools.plan: offload's activations per device, and the peak on the device below save_matmuls' by them (on
    XLA:CPU by subtraction: its memory analysis counts host memory with the device's).
    """
    from jaxpar.core.config.mesh_spec import parse_mesh
    from jaxpar.tools.plan import plan

    plans = {
        r: plan(tiny_config(f"model.remat={r}"), parse_mesh("dp=1"), jax.devices()[:1])
        for r in ("save_matmuls", "offload")
    }
    assert plans["save_matmuls"]["activation_host_bytes"] == 0 and not plans["save_matmuls"]["peak_estimated"]
    got = plans["offload"]
    assert got["activation_host_bytes"] == PROJECTED and got["peak_estimated"]
    assert got["peak_bytes"] == plans["save_matmuls"]["peak_bytes"] - PROJECTED
    assert any(n.startswith("model.remat=offload: 0.25 MiB of activations per device") for n in got["notes"])
