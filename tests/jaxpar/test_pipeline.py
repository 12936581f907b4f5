"""Every pipeline schedule over pp reproduces the single-device float32 run.

Bad pipeline layouts are one-line errors; the hand-scheduled executor keeps ~S microbatches of residuals for 1F1B
whatever M is.
"""

import re

import jax
import numpy as np
import pytest

from jaxpar.core.errors import UserError
from jaxpar.core.config.mesh_spec import parse_mesh
from jaxpar.pipeline.auto import resolve_schedule
from jaxpar.cost.peak_bytes import peak_bytes
from tests.helpers import assert_params_close, assert_resumes_exactly, run_steps, tiny_config
from jaxpar.pipeline.tick_plan import tick_plan

# 4 layers so that pp=4 has a layer per stage. At the tiny config's lr=1e-2 a 4-layer model lets Adam
# amplify float32 rounding to ~3e-5 in parameters on *any* sharded layout (dp=2,tp=2 too, no pipeline);
# at 3e-3 every layout stays within the 1e-5 bound.
DEEP = ("model.n_layer=4", "optim.lr=3e-3", "optim.min_lr=3e-4")
DEEPER = ("model.n_layer=8", "optim.lr=3e-3", "optim.min_lr=3e-4")  # interleaved pp=4: 2 chunks of 1 layer
SCHEDULES = {"gpipe": (), "1f1b": (), "interleaved": ("parallel.pipeline_virtual_stages=2",)}


@pytest.fixture(scope="module")
def references(dataset):
    one = jax.devices()[:1]
    return {n: run_steps(tiny_config(*model), "dp=1", dataset, devices=one) for n, model in ((4, DEEP), (8, DEEPER))}


@pytest.mark.parametrize(
    "mesh,n,schedule",
    [(mesh, n, s) for mesh, n in (("pp=2", 2), ("pp=4", 4), ("pp=2,dp=2,tp=2", 8)) for s in SCHEDULES]
    + [("pp=4", 4, "auto")],
)
def test_schedule_matches_single_device(schedule, mesh, n, dataset, references):
    """auto: the schedule jaxpar.train resolves it to (jaxpar/pipeline/auto.py), whichever that is."""
    model = DEEPER if schedule == "interleaved" and mesh == "pp=4" else DEEP
    cfg = tiny_config(*model, f"parallel.pipeline_schedule={schedule}", *SCHEDULES.get(schedule, ()))
    if schedule == "auto":
        cfg, line = resolve_schedule(cfg, parse_mesh(mesh), jax.devices()[:n], peak_bytes)
        assert cfg.parallel.pipeline_schedule != "auto" and line.startswith("pipeline schedule auto -> "), line
    got = run_steps(cfg, mesh, dataset, devices=jax.devices()[:n])
    reference = references[cfg.model.n_layer]
    np.testing.assert_allclose(got["loss"], reference["loss"], rtol=1e-5)
    assert_params_close(got["params"], reference["params"])


@pytest.mark.parametrize(
    "schedule,mesh,n,remat",
    [
        ("zb_h1", "pp=4", 4, "none"),
        ("zb_h1", "pp=4", 4, "full"),
        ("zb_h1", "pp=2,dp=2,tp=2", 8, "none"),
        ("zb_v", "pp=4", 4, "none"),
        ("zb_v", "pp=4", 4, "save_matmuls"),
        ("zb_v", "pp=2,dp=2,tp=2", 8, "none"),
    ],
)
def test_zero_bubble_matches_single_device(schedule, mesh, n, remat, dataset, references):
    """ZB-H1 and ZB-V give one device's gradients.

    Input and weight gradients at different ticks (W deferred into the bubbles) sum to the same gradients as one
    device's; ZB-V's chunks run down the devices and back up (pp=4: 8 layers, one per chunk). W is the projections'
    weight gradients from the inputs and output gradients B kept, with remat too.
    """
    model = DEEPER if schedule == "zb_v" and mesh == "pp=4" else DEEP
    cfg = tiny_config(*model, f"parallel.pipeline_schedule={schedule}", f"model.remat={remat}")
    got = run_steps(cfg, mesh, dataset, devices=jax.devices()[:n])
    np.testing.assert_allclose(got["loss"], references[cfg.model.n_layer]["loss"], rtol=1e-5)
    assert_params_close(got["params"], references[cfg.model.n_layer]["params"])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb_h1", "zb_v"])
def test_schedule_resumes_exactly_after_sigkill(schedule, dataset, tmp_path):
    """pp=2, killed after step 4 (checkpoint of step 3).

    The resumed steps 4-6 equal the uninterrupted run's bit for bit.
    """
    args = (
        "--mesh",
        "pp=2",
        *DEEP,
        f"parallel.pipeline_schedule={schedule}",
        "train.steps=6",
        "checkpoint.every=3",
        "train.eval_every=0",
        *(("parallel.pipeline_virtual_stages=2",) if schedule == "interleaved" else ()),
    )
    assert_resumes_exactly(tmp_path, dataset, args, kill_after=4)


def test_1f1b_composes_with_fsdp_and_sequence_parallel(dataset, references):
    cfg = tiny_config(*DEEP, "parallel.pipeline_schedule=1f1b", "parallel.sequence_attention=ulysses")
    got = run_steps(cfg, "pp=2,fsdp=2,sp=2", dataset, devices=jax.devices()[:8])
    np.testing.assert_allclose(got["loss"], references[4]["loss"], rtol=1e-5)
    assert_params_close(got["params"], references[4]["params"])


@pytest.mark.parametrize(
    "schedule,attention", [("1f1b", "all_gather"), pytest.param("zb_v", "ulysses", marks=pytest.mark.slow)]
)
def test_hand_scheduled_pipeline_runs_sequence_parallel_in_natural_order(schedule, attention, dataset, references):
    """parallel.sequence_zigzag=false.

    gpt2's positional rows for the sp-sharded sequence are sliced from a replicated table (models/decoder.py embed);
    left to GSPMD the slice was a collective-permute inside the first stage's branches, which XLA's rendezvous waits
    for on every device (fuzz seed 48002's deadlock).
    """
    cfg = tiny_config(
        *DEEP,
        f"parallel.pipeline_schedule={schedule}",
        f"parallel.sequence_attention={attention}",
        "parallel.sequence_zigzag=false",
    )
    got = run_steps(cfg, "pp=2,sp=2", dataset, devices=jax.devices()[:4])
    np.testing.assert_allclose(got["loss"], references[4]["loss"], rtol=1e-5)
    assert_params_close(got["params"], references[4]["params"])


HAND_SCHEDULED = {
    "1f1b": (),
    "interleaved": ("parallel.pipeline_virtual_stages=2",),
    "zb_h1": (),
    "zb_v": (),
    "dualpipev": (),
}


@pytest.mark.parametrize("schedule", list(HAND_SCHEDULED))
def test_hand_scheduled_pipeline_runs_ring_attention(schedule, dataset, references):
    """sp=2,pp=2 with ring attention.

    Its K/V hops inside a tick's branch are all_to_alls (a collective-permute's rendezvous there spans the other
    stage's devices: wrong values; jaxpar/parallel/ring_attention.py).
    """
    cfg = tiny_config(
        *DEEP, f"parallel.pipeline_schedule={schedule}", "parallel.sequence_attention=ring", *HAND_SCHEDULED[schedule]
    )
    got = run_steps(cfg, "pp=2,sp=2", dataset, devices=jax.devices()[:4])
    np.testing.assert_allclose(got["loss"], references[4]["loss"], rtol=1e-5)
    assert_params_close(got["params"], references[4]["params"])


def test_executor_runs_ring_attention_not_another_strategy():
    """The pipeline executor runs ring attention, not another sequence strategy.

    The compiled 1f1b step's sequence collectives are ring's hops (named scope ring_hop), as all_to_alls, none a
    collective-permute: ring is neither replaced by all_gather nor left with the ppermute that breaks there.
    """
    from jaxpar.step import build_step

    cfg = tiny_config(*DEEP, "parallel.pipeline_schedule=1f1b", "parallel.sequence_attention=ring")
    hlo = build_step(cfg, parse_mesh("pp=2,sp=2"), jax.devices()[:4], abstract=True)[2].as_text()
    ops = re.findall(r" (all-to-all|collective-permute|all-gather)(?:-start)?\(.*?op_name=\"([^\"]*)\"", hlo)
    hops = {kind for kind, name in ops if "ring_hop" in name}
    assert hops == {"all-to-all"}, hops


def test_executor_holds_residuals_for_schedule_in_flight_not_all_microbatches():
    S = 4
    for M in (4, 8, 16):
        assert tick_plan("1f1b", S, M, 1).res_slots - 1 == S  # the extra slot is scratch
        assert tick_plan("gpipe", S, M, 1).res_slots - 1 == M
        assert tick_plan("1f1b", S, M, 1).act_slots - 1 == 1  # an arrived input waits one tick for its forward
    assert tick_plan("1f1b", S, 16, 1).tables.shape[0] == 2 * (16 + S - 1)  # every stage busy but the bubble
    # ZB-V: 2S residual slots of half a stage's layers each: 1F1B's S of a whole stage
    assert all(tick_plan("zb_v", S, M, 1).res_slots - 1 <= 2 * S for M in (4, 8, 16))
    # ZB-H1: residual slots as 1F1B's; W reads the projections' inputs and output gradients B kept, so an arrived
    # cotangent is dropped at B, as in 1F1B; the "tap" buffers hold the microbatches between B and W
    zb = tick_plan("zb_h1", S, 16, 1)
    assert zb.res_slots - 1 == S and zb.cot_slots == tick_plan("1f1b", S, 16, 1).cot_slots
    assert zb.tables.shape[0] == 3 * 16 + S - 1 and 1 < zb.tap_slots <= zb.res_slots


def _branch_matmuls(*overrides) -> list[int]:
    """dot_general equations in each branch of the executor's tick (jaxpr level; a layer scan's body once)."""
    from jax.extend.core import jaxprs_in_params

    from jaxpar.context import use
    from jaxpar.layout import Layout
    from jaxpar.mesh import make_mesh
    from jaxpar.pipeline.tick_plan import BRANCHES
    from jaxpar.state import abstract_state
    from jaxpar.step import loss_and_grad

    layout = Layout(tiny_config(*DEEP, *overrides), make_mesh({"pp": 2}, jax.devices()[:2]))
    fn, context = loss_and_grad(layout)

    def traced(params, batch):
        with use(context):
            return fn(params, batch)

    jaxpr = jax.make_jaxpr(traced)(abstract_state(layout)["params"], jax.ShapeDtypeStruct(layout.batch_shape, "int32"))
    walk = lambda j: [e for e in j.eqns for e in [e, *(x for sub in jaxprs_in_params(e.params) for x in walk(sub))]]
    tick = next(e for e in walk(jaxpr.jaxpr) if e.primitive.name == "cond" and len(e.params["branches"]) == BRANCHES)
    return [sum(e.primitive.name == "dot_general" for e in walk(b.jaxpr)) for b in tick.params["branches"]]


def test_executor_backward_does_not_recompute_the_forward_unless_remat_says_so():
    """A middle stage's backward applies the residuals its forward kept.

    Two matmuls per forward matmul (the gradients of both operands), none recomputed; model.remat=full trades memory
    for a recomputed forward.
    """
    from jaxpar.pipeline.tick_plan import B_MID, F_MID

    kept = _branch_matmuls("parallel.pipeline_schedule=1f1b")
    assert kept[F_MID] == 6 and kept[B_MID] == 2 * kept[F_MID]  # qkv, QK^T, PV, out, fc, proj per layer
    remat = _branch_matmuls("parallel.pipeline_schedule=1f1b", "model.remat=full")
    assert remat[B_MID] > 2 * remat[F_MID]


def test_matmul_flops_count_loops_and_find_what_each_schedule_adds():
    """A 10-step scan of a 64x64 matmul is 10 matmuls (XLA's cost analysis reports one).

    1F1B on the executor does one device's matmul work, GPipe on GSPMD (M+S-1)/M of it (its bubble ticks compute
    too).
    """
    import jax.numpy as jnp

    from jaxpar.cost.jaxpr_flops import matmul_flops
    from jaxpar.cost.loss_and_grad import step_flops

    x = jnp.ones((64, 64))
    scan = jax.make_jaxpr(lambda x: jax.lax.scan(lambda c, _: (c @ x, None), x, None, length=10)[0])(x)
    assert matmul_flops(scan.jaxpr) == 10 * 2 * 64**3
    S, M = 2, 4
    cfg = lambda schedule: tiny_config(*DEEP, f"parallel.pipeline_schedule={schedule}")  # 8 rows, M=4
    one = step_flops(cfg("gpipe"), {"pp": 1}, jax.devices()[:1], None)
    assert step_flops(cfg("1f1b"), {"pp": S}, jax.devices()[:S], "1f1b") == pytest.approx(one)
    # ZB's W: the projections' weight gradients alone (x^T dy from what B kept), so F + B + W is one device's work
    # (with remat too: test_zero_bubble_weight_pass_is_the_weight_matmuls_alone)
    assert step_flops(cfg("zb_h1"), {"pp": S}, jax.devices()[:S], "zb_h1") == pytest.approx(one)
    gpipe = step_flops(cfg("gpipe"), {"pp": S}, jax.devices()[:S], None)
    assert one < gpipe <= (M + S - 1) / M * one


@pytest.mark.parametrize("remat", ["none", "full", "save_matmuls"])
def test_zero_bubble_weight_pass_is_the_weight_matmuls_alone(remat):
    """Zero-bubble's W pass computes the weight matmuls alone.

    Under every remat policy a middle stage's W (ZB-H1, pp=2) computes the projections' weight gradients x^T dy and no
    other matmul (a W that recomputed the forward or the activation gradients fails here), B does 1F1B's backward less
    exactly those, and the step is one device's matmul work, ZB-V's too.
    """
    from jaxpar.core.pipeline.schedules import resolve_microbatches
    from jaxpar.pipeline.tick_plan import B_MID, BRANCHES, F_MID, W_MID
    from jaxpar.cost.jaxpr_flops import branch_flops
    from jaxpar.cost.loss_and_grad import step_flops
    from jaxpar.cost.loss_and_grad import loss_and_grad_program

    S, devices = 2, jax.devices()[:2]
    cfg = lambda schedule: tiny_config(*DEEP, f"parallel.pipeline_schedule={schedule}", f"model.remat={remat}")

    def per_branch(schedule):
        traced, params, batch = loss_and_grad_program(cfg(schedule), {"pp": S}, devices, schedule)
        return branch_flops(jax.make_jaxpr(traced)(params, batch).jaxpr, BRANCHES), batch.shape

    zb, (rows, width) = per_branch("zb_h1")
    one_f_one_b, _ = per_branch("1f1b")
    m, M = cfg("zb_h1").model, resolve_microbatches(S, cfg("zb_h1").parallel.pipeline_microbatches)
    d, f, tokens = m.d_model, m.ff_dim, rows // M * (width - 1)
    # qkv d -> 3d, attention out d -> d, fc d -> f, proj f -> d: 2 x tokens x in x out each, per layer of the stage
    assert zb[W_MID] == 2 * tokens * (3 * d * d + d * d + 2 * d * f) * m.n_layer // S
    assert zb[F_MID] == one_f_one_b[F_MID] and zb[B_MID] + zb[W_MID] == pytest.approx(one_f_one_b[B_MID])
    one = step_flops(cfg("gpipe"), {"pp": 1}, devices[:1], None)
    assert all(step_flops(cfg(s), {"pp": S}, devices, s) == pytest.approx(one) for s in ("zb_h1", "zb_v"))


@pytest.mark.parametrize(
    "overrides,message",
    [
        (("model.n_layer=3",), "not divisible by stages x virtual stages"),
        (("parallel.pipeline_microbatches=3",), "not divisible by parallel.pipeline_microbatches=3"),
        (
            ("parallel.pipeline_schedule=1f1b", "parallel.pipeline_microbatches=1", "train.global_batch_size=2"),
            "1f1b needs microbatches >= stages",
        ),
        (
            (
                "parallel.pipeline_schedule=interleaved",
                "parallel.pipeline_virtual_stages=2",
                "parallel.pipeline_microbatches=3",
                "train.global_batch_size=6",
            ),
            "divisible by stages",
        ),
    ],
)
def test_bad_pipeline_layouts(overrides, message, dataset):
    with pytest.raises(UserError, match=message):
        run_steps(tiny_config(*DEEP, *overrides), "pp=2", dataset, steps=1, devices=jax.devices()[:2])


DILATED = (*DEEP, "model.attention=dilated", "model.segment_lengths=4,8,16", "model.dilation_rates=1,2,4")


@pytest.fixture(scope="module")
def dilated_reference(dataset):
    return run_steps(tiny_config(*DILATED), "dp=1", dataset, devices=jax.devices()[:1])


@pytest.mark.parametrize("schedule", ["1f1b", "zb_v"])
def test_hand_scheduled_pipeline_runs_dilated_attention_over_sp(schedule, dataset, dilated_reference):
    """Each hand-scheduled pipeline runs dilated attention over sp.

    Dilated attention's segments of 8 and 16 tokens span both sp shards of a 16-token row (GSPMD moves the selected keys
    across sp inside a tick's branch).
    """
    got = run_steps(
        tiny_config(*DILATED, f"parallel.pipeline_schedule={schedule}"), "pp=2,sp=2", dataset, devices=jax.devices()[:4]
    )
    np.testing.assert_allclose(got["loss"], dilated_reference["loss"], rtol=1e-5)
    assert_params_close(got["params"], dilated_reference["params"])


@pytest.mark.parametrize("mesh,n,schedule", [("dp=1", 1, "gpipe"), ("pp=2", 2, "gpipe"), ("pp=2", 2, "1f1b")])
def test_unrolled_layers_compute_the_scans_run(mesh, n, schedule, dataset, references):
    """train.scan_layers=off (each layer traced on its own, on GPipe and the hand-scheduled executor alike).

    The single-device scan's numbers, and no loop over layers left in the step.
    """
    from jaxpar.core.config.mesh_spec import parse_mesh
    from jaxpar.step import build_step

    cfg = tiny_config(*DEEP, "train.scan_layers=off", f"parallel.pipeline_schedule={schedule}")
    got = run_steps(cfg, mesh, dataset, devices=jax.devices()[:n])
    np.testing.assert_allclose(got["loss"], references[4]["loss"], rtol=1e-5)
    assert_params_close(got["params"], references[4]["params"])
    if mesh == "dp=1":  # the loss in one chunk: model.loss_chunks' own loop is not a loop over layers
        hlo = {
            s: build_step(
                tiny_config(*DEEP, f"train.scan_layers={s}", "model.loss_chunks=1"),
                parse_mesh(mesh),
                jax.devices()[:1],
                abstract=True,
            )[2].as_text()
            for s in ("on", "off")
        }
        assert " while(" in hlo["on"] and " while(" not in hlo["off"]


def test_scan_layers_auto_unrolls_on_a_gpu_only():
    from types import SimpleNamespace

    from jaxpar.parallelize import unrolled_layers

    mesh = lambda platform: SimpleNamespace(devices=np.array([SimpleNamespace(platform=platform)]))
    assert unrolled_layers("auto", mesh("gpu")) and not unrolled_layers("auto", mesh("cpu"))
    assert unrolled_layers("off", mesh("cpu")) and not unrolled_layers("on", mesh("gpu"))
