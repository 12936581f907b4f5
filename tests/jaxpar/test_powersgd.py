"""parallel.grad_compression=powersgd in jaxpar (jaxpar/parallel/powersgd.py).

The reduction against a numpy reading of the algorithm (Vogels et al. 2019, as torch's powerSGD_hook runs it: error
feedback, warm start), the warm-up, the planner's bytes against r(m+n) per matrix, and its state across checkpoints: bit
for bit after SIGKILL, averaged onto another data size, dropped where a layout runs without it.
"""

import math
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxpar.checkpoint import Checkpointer
from jaxpar.core.errors import UserError
from jaxpar.core.config.mesh_spec import parse_mesh
from jaxpar.core.weights.names import flatten
from jaxpar.layout import Layout
from jaxpar.mesh import make_mesh
from jaxpar.parallel import powersgd
from jaxpar.state import init_state, restore_latest
from tests.helpers import assert_resumes_exactly, metrics, run_cli, run_steps, tiny_config

PSGD = "parallel.grad_compression=powersgd"


def layout_of(mesh: str, *extra: str) -> Layout:
    sizes = parse_mesh(mesh)
    return Layout(tiny_config(PSGD, *extra), make_mesh(sizes, jax.devices()[: math.prod(sizes.values())]))


def numpy_powersgd(layout, grads: dict, error: dict, qs: dict) -> tuple[dict, dict, dict]:
    """(mean gradients, error buffers, Q) in numpy: per rank i, M_i = g_i + e_i.

    A matrix (first dim x the rest, one per layer of a stacked leaf): Q orthonormalised (here by QR), P = sum_i M_i
    Q, orthonormalised, Q' = sum_i M_i^T P / n, R = P Q'^T; anything else: R = mean_i M_i; e_i = M_i - R.
    """
    out, errors, new_q = {}, {}, {}
    for k, g in grads.items():
        m = g + error[k]
        n = m.shape[0]
        if k not in qs:
            out[k] = m.mean(0)
        else:
            layered = powersgd.layers_first(layout, k)
            stack = m if layered else m[:, None]
            q = qs[k] if layered else qs[k][None]
            r_all, q_all = [], []
            for layer in range(stack.shape[1]):
                mats = stack[:, layer].reshape(n, stack.shape[2], -1)
                ql = np.linalg.qr(q[layer].reshape(-1, q.shape[-1]))[0]
                p, _ = np.linalg.qr(sum(mi @ ql for mi in mats))
                qn = sum(mi.T @ p for mi in mats) / n
                r_all.append((p @ qn.T).reshape(stack.shape[2:]))
                q_all.append(qn.reshape(q.shape[1:]))
            out[k] = np.stack(r_all) if layered else r_all[0]
            new_q[k] = np.stack(q_all) if layered else q_all[0]
        errors[k] = m - out[k]
    return out, errors, new_q


def test_the_reduction_is_powersgd_with_error_feedback():
    """dp=2,fsdp=2,tp=2 (4 data ranks, tp inside), rank 2: random per-rank gradients and error buffers."""
    layout = layout_of("dp=2,fsdp=2,tp=2", "parallel.powersgd_rank=2")
    axes, n = ("dp", "fsdp"), 4
    state = jax.device_get(init_state(layout)["powersgd"])
    rng = np.random.default_rng(0)
    grads = {k: rng.normal(size=e.shape).astype(np.float32) for k, e in state["error"].items()}
    error = {k: 0.1 * rng.normal(size=e.shape).astype(np.float32) for k, e in state["error"].items()}
    assert state["q"] and all(q.shape[-1] == 2 for q in state["q"].values())  # r = parallel.powersgd_rank
    assert any(powersgd.layers_first(layout, k) for k in state["q"]) and set(state["q"]) < set(grads)

    def local(g, s):
        out, new = powersgd.reduce_powersgd(layout, {k: v[0] for k, v in g.items()}, s, axes, n)
        return out, new

    spec = {"error": P(axes), "q": P()}
    fn = jax.jit(
        jax.shard_map(
            local,
            mesh=layout.mesh,
            in_specs=(P(axes), spec),
            out_specs=(P(), spec),
            axis_names=set(axes),
            check_vma=False,
        )
    )
    got, new = jax.device_get(fn(grads, {"error": error, "q": state["q"]}))
    want, want_error, want_q = numpy_powersgd(layout, grads, error, state["q"])
    for k in grads:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-5, err_msg=k)
        np.testing.assert_allclose(new["error"][k], want_error[k], rtol=1e-4, atol=1e-5, err_msg=k)
    for k, q in want_q.items():  # QR's columns may differ from Gram-Schmidt's in sign (P Q^T does not)
        lead = int(powersgd.layers_first(layout, k))
        sign = np.sign(np.sum(q * new["q"][k], axis=tuple(range(lead, q.ndim - 1)), keepdims=True))
        np.testing.assert_allclose(new["q"][k] * sign, q, rtol=1e-3, atol=1e-5, err_msg=k)
    assert any(np.abs(e).max() > 1e-2 for k, e in new["error"].items() if k in want_q)  # it did compress


def test_warm_up_steps_run_plain_then_powersgd_moves_the_run(dataset, reference):
    """dp=2,tp=2, 3 plain steps: losses 1-4 are the one-device run's (the 4th follows the 3rd plain update).

    From the 5th on PowerSGD's first update shows.
    """
    got = run_steps(
        tiny_config(PSGD, "parallel.powersgd_warmup_steps=3"), "dp=2,tp=2", dataset, steps=6, devices=jax.devices()[:4]
    )
    np.testing.assert_allclose(got["loss"][:4], reference["loss"][:4], rtol=1e-5)
    assert np.all(np.abs(np.array(got["loss"][4:]) / reference["loss"][4:6] - 1) > 1e-5), got["loss"]


def test_state_fits_another_data_size(tmp_path):
    """A saved PowerSGD state fits another data-parallel layout.

    Saved on dp=2: restored on fsdp=2 as it was, on dp=4 each rank gets the mean of the two buffers, with another rank r
    the buffers as they were and Q afresh, on one device (a conversion's layout) dropped.
    """
    src = layout_of("dp=2")
    state = init_state(src)
    rng = np.random.default_rng(1)
    error = {k: rng.normal(size=e.shape).astype(np.float32) for k, e in state["powersgd"]["error"].items()}
    state["powersgd"]["error"] = jax.device_put(error, src.state_shardings["powersgd"]["error"])
    ckpt = Checkpointer(str(tmp_path), keep=2)
    ckpt.save(3, state, {"step": 3, "data_step": 3})
    ckpt.wait()
    same = restore_latest(ckpt, layout_of("fsdp=2"))[0]["powersgd"]
    wider = restore_latest(ckpt, layout_of("dp=4"))[0]["powersgd"]
    for k, e in error.items():
        np.testing.assert_array_equal(np.asarray(same["error"][k]), e)
        np.testing.assert_allclose(
            np.asarray(wider["error"][k]), np.broadcast_to(e.mean(0), (4, *e.shape[1:])), rtol=1e-6
        )
        assert wider["error"][k].sharding.spec[0] == "dp"
    for k, q in flatten(jax.device_get(state["powersgd"]["q"])).items():
        np.testing.assert_array_equal(np.asarray(wider["q"][k]), q)
    other_r = restore_latest(ckpt, layout_of("dp=2", "parallel.powersgd_rank=2"))[0]["powersgd"]  # Q afresh
    assert all(q.shape[-1] == 2 for q in other_r["q"].values())
    assert all(np.array_equal(np.asarray(other_r["error"][k]), e) for k, e in error.items())
    one = Layout(tiny_config(PSGD), make_mesh({"dp": 1}, jax.devices()[:1]))
    assert "powersgd" not in restore_latest(ckpt, one)[0]
    ckpt.close()


def test_powersgd_run_resumes_exactly_after_sigkill(dataset, tmp_path):
    common = (PSGD, "parallel.powersgd_warmup_steps=2", "checkpoint.every=4", "train.eval_every=0")
    args = ("--mesh", "dp=2", "train.steps=8", *common)
    assert_resumes_exactly(tmp_path, dataset, args, kill_after=6)
    # on another data size: the buffers averaged, said in one line, and the run goes on
    wider = run_cli(tmp_path / "k", dataset, "--mesh", "dp=4", "train.steps=10", *common)
    assert wider.returncode == 0 and "error buffers of 2 data ranks averaged onto 4" in wider.stderr, wider.stderr
    assert np.isfinite(metrics(tmp_path / "k")[10]["loss"])


def test_the_state_follows_the_stage_sharding():
    """PowerSGD's state follows the pipeline-stage sharding.

    dp=2,pp=2: a stacked leaf's error buffers and Q keep its layers on their stage (sharded over pp, as the parameter);
    Q of an unstacked one is whole.
    """
    layout = layout_of("dp=2,pp=2", "model.n_layer=4")
    shard = powersgd.shardings(layout)
    stacked = [k for k in shard["q"] if powersgd.layers_first(layout, k)]
    assert stacked and all(shard["q"][k].spec[0] == "pp" and shard["error"][k].spec[1] == "pp" for k in stacked)
    assert all(shard["q"][k].spec == P() for k in shard["q"] if k not in stacked)


@pytest.mark.parametrize(
    "mesh,setting,named",
    [
        ("sp=2,dp=2", PSGD, "sp with it is not built"),
        ("dp=4", "model.compute_dtype=float16", "powersgd with model.compute_dtype=float16"),
    ],
)
def test_what_jaxpar_powersgd_does_not_run_is_refused(mesh, setting, named, dataset):
    with pytest.raises(UserError, match=named):
        run_steps(tiny_config(PSGD, setting), mesh, dataset, devices=jax.devices()[:4])
