"""The planner against formulas written here, independently of jaxpar.tools.plan's own."""

import jax
import pytest

from jaxpar.core.config.schema import load_config
from jaxpar.core.config.mesh_spec import parse_mesh
from jaxpar.cost import hlo_collectives
from jaxpar.tools.plan import candidate_meshes, main as plan_main, plan, recommend
from tests.helpers import tiny_config

CFG = load_config("configs/gpt2-tiny.yaml")
m, B, T = CFG.model, CFG.train.global_batch_size, CFG.data.seq_len
d, L, V, f = m.d_model, m.n_layer, m.vocab_size, 4 * m.d_model
# parameters per block by kind: (count, sharded over tp?)
BLOCK = {
    "ln": (4 * d, False),
    "qkv": (3 * d * d + 3 * d, True),
    "out_w": (d * d, True),
    "out_b": (d, False),
    "fc": (d * f + f, True),
    "proj_w": (f * d, True),
    "proj_b": (d, False),
}
N = V * d + m.max_seq_len * d + L * sum(n for n, _ in BLOCK.values()) + 2 * d


def per_device_param_bytes(tp: int) -> float:
    sharded = V * d + L * sum(n for n, s in BLOCK.values() if s)
    return 4 * (sharded / tp + (N - sharded))


def run(mesh):
    sizes = parse_mesh(mesh)
    return plan(CFG, sizes, jax.devices()[:8])


def test_dp8_traffic_is_the_gradient_all_reduce():
    p = run("dp=8")
    bound = 2 * 4 * N * 7 / 8
    assert bound * 0.99 <= p["traffic_bytes"] <= 1.1 * bound


def test_dp2_tp4_traffic_is_megatron_plus_gradients():
    p = run("dp=2,tp=4")
    activation = (B // 2) * T * d * 4
    bound = (4 * L + 2) * activation * 2 * 3 / 4 + 2 * per_device_param_bytes(4) * 1 / 2
    assert bound * 0.99 <= p["traffic_bytes"] <= 1.1 * bound


def test_fsdp8_shards_state_and_explains_its_traffic():
    """Traffic between the bound (parameters gathered once, gradients reduce-scattered) and what GSPMD emits.

    Parameters gathered in the forward and again in the backward, gradients reduce-scattered or, on XLA:CPU (no
    ReduceScatterCreator: docs/benchmarks/README.md "Planner"), all-reduced whole and then sliced.
    """
    p = run("fsdp=8")
    assert p["params_bytes"] + p["opt_state_bytes"] <= 1.05 * (3 * 4 * N) / 8  # params + Adam mu, nu
    gather = 4 * N * 7 / 8  # one ring all-gather of all parameters; a gradient reduce-scatter moves the same
    bound = 2 * gather
    assert p["traffic_bytes"] >= 0.99 * bound
    scatter = gather if any(c["op"] == "reduce-scatter" for c in p["collectives"]) else 2 * gather  # all-reduce: 2x
    assert p["traffic_bytes"] <= 1.03 * (2 * gather + scatter)  # 3%: some gradients are reduced in parts
    if p["traffic_bytes"] > 1.1 * bound:
        assert any(note.startswith("fsdp:") for note in p["notes"]), p["notes"]
        assert any("XLA:CPU has no pass that forms reduce-scatter" in note for note in p["notes"]), p["notes"]


def test_plan_knows_the_pipeline_bubble(capsys):
    """pp=2 with ZB-H1 and the default 2 x stages microbatches: bubble (S-1)/(3M+S-1) = 1/13 (Qi et al.)."""
    cfg = load_config("configs/gpt2-tiny.yaml", ["parallel.pipeline_schedule=zb_h1"])
    p = plan(cfg, parse_mesh("pp=2"), jax.devices()[:2])
    assert p["pipeline"] == {"schedule": "zb_h1", "bubble": pytest.approx(1 / 13)}
    assert run("dp=8")["pipeline"] is None


def test_async_collectives_count_their_results_only():
    """XLA:GPU's `-start` ops return (operands, results): the operands are not traffic (shapes by hand)."""
    hlo = """ENTRY %main (p: f32[64,256]) -> f32[64,256] {
  %rs = ((f32[64,256]{1,0}), f32[8,256]{1,0}) reduce-scatter-start(%p), replica_groups={{0,1,2,3,4,5,6,7}}, \
dimensions={0}
  %ag = (f32[8,256]{1,0}, f32[64,256]{1,0}) all-gather-start(%q), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %ar = (f32[64,256]{1,0}, f32[4]{0}) all-reduce-start(%p, %s), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %cp = (f32[8,256]{1,0}, f32[8,256]{1,0}, u32[], u32[]) collective-permute-start(%q), source_target_pairs={{0,1},{1,0}}
}
"""
    got = {c.op: c.result_bytes for c in hlo_collectives.parse(hlo, 8)}
    assert got == {
        "reduce-scatter": 8 * 256 * 4,
        "all-gather": 64 * 256 * 4,
        "all-reduce": (64 * 256 + 4) * 4,
        "collective-permute": 8 * 256 * 4,
    }


def test_collectives_carry_the_source_files_of_their_stack():
    """The HLO's stack-frame tables (shapes by hand).

    Frame 3 is step.py -> jaxpar/optim.py, frame 2 step.py alone (a parent_frame_id is the parent's id + 1).
    """
    hlo = """HloModule m

FileNames
1 "/r/jaxpar/step.py"
2 "/r/jaxpar/optim.py"

FileLocations
1 {file_name_id=1 function_name_id=1 line=5 end_line=5 column=1 end_column=1}
2 {file_name_id=2 function_name_id=2 line=9 end_line=9 column=1 end_column=1}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=1 parent_frame_id=2}
3 {file_location_id=2 parent_frame_id=2}

ENTRY %main (p: f32[64,256]) -> f32[64,256] {
  %a = f32[8,256]{1,0} all-to-all(%p), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, \
metadata={op_name="x" stack_frame_id=3}
  %g = f32[64,256]{1,0} all-gather(%q), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, \
metadata={op_name="y" stack_frame_id=2}
}
"""
    got = {c.op: c.files for c in hlo_collectives.parse(hlo, 8)}
    assert got == {"all-to-all": {"/r/jaxpar/step.py", "/r/jaxpar/optim.py"}, "all-gather": {"/r/jaxpar/step.py"}}
    from jaxpar.cost.optimizer_traffic import is_optimizers

    assert is_optimizers(got["all-to-all"]) and not is_optimizers(got["all-gather"])


def test_recommend_rejects_meshes_over_budget(capsys):
    rows = recommend(CFG, 4, budget=10**12, peak_flops=1e12, bandwidth=1e10)
    peaks = sorted(r["peak_bytes"] for r in rows)
    assert len(rows) >= 4 and all(r["fits"] for r in rows)
    budget = (peaks[0] + peaks[-1]) // 2
    rows = recommend(CFG, 4, budget=budget, peak_flops=1e12, bandwidth=1e10)
    assert any(not r["fits"] for r in rows) and any(r["fits"] for r in rows)
    for r in rows:
        assert r["fits"] == (r["peak_bytes"] <= budget)
    proposed = [r for r in rows if r["fits"]]
    assert rows[: len(proposed)] == proposed  # every fitting mesh ranks above every rejected one
    assert [r["predicted_step_s"] for r in proposed] == sorted(r["predicted_step_s"] for r in proposed)


def test_recommend_says_each_mesh_as_it_is_compiled(capsys, monkeypatch):
    """--recommend compiles every candidate mesh (a minute for a small model).

    A line on stderr before the first and one per mesh compiled (each offload round's too), so a long run is never
    silent; the table stays on stdout. The compile is stubbed here: the lines are the subject, not the plans.
    """
    from jaxpar.core.config.mesh_spec import format_mesh
    from jaxpar.tools import plan as planner

    peaks = {"none": 100, "optimizer": 60, "params+optimizer": 40}  # only the last fits: three rounds
    monkeypatch.setattr(
        planner,
        "plan",
        lambda cfg, sizes, devices=None: {
            "mesh": format_mesh(sizes),
            "peak_bytes": peaks[cfg.parallel.offload],
            "host_bytes": 0,
            "traffic_bytes": 0,
        },
    )
    meshes = [format_mesh(s) for s in candidate_meshes(CFG, 4)]
    recommend(CFG, 4, budget=50, peak_flops=1e12, bandwidth=1e10)
    out, err = capsys.readouterr()
    lines, n = err.strip().splitlines(), len(meshes)
    assert out == "" and len(lines) == 3 + 3 * n and n == 6, err
    assert lines[0] == f"plan: compiling the train step on each of {n} meshes of 4 devices (nothing allocated)"
    assert lines[1 : 1 + n] == [
        f"plan: mesh {i} of {n}, {m} (offload none): peak 0.000 GiB, over the budget, "
        f"compiled in {line.rsplit(' in ', 1)[1]}"
        for i, (m, line) in enumerate(zip(meshes, lines[1:]), 1)
    ]
    assert lines[1 + n] == "plan: no mesh fits in the budget; compiling them again with parallel.offload=optimizer"
    assert "offload params+optimizer): peak 0.000 GiB, compiled in" in lines[-1]


def test_schedules_say_each_schedule_as_it_is_compiled(capsys, monkeypatch):
    """--schedules compiles the step of every pipeline schedule: a line on stderr for each (the compiles stubbed)."""
    from jaxpar.pipeline import auto as pipeline_auto
    from jaxpar.core.pipeline.schedules import PROGRAMS
    from jaxpar.tools import plan as planner

    monkeypatch.setattr(
        planner,
        "plan",
        lambda cfg, sizes, devices=None: {"pipeline": {"bubble": 0.1}, "peak_bytes": 1, "temp_bytes": 1},
    )
    monkeypatch.setattr(pipeline_auto, "flops_ratio", lambda *args: 1.0)
    planner.compare_schedules(tiny_config("model.n_layer=4"), {"pp": 2}, jax.devices()[:2])
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        f"plan: compiling parallel.pipeline_schedule={s} on pp=2" for s in PROGRAMS
    ], err


def test_plan_cli_bad_memory_size(capsys):
    assert (
        plan_main(
            ["--config", "configs/gpt2-tiny.yaml", "--recommend", "--devices", "4", "--memory-per-device", "lots"]
        )
        == 2
    )
    assert "lots" in capsys.readouterr().err


def test_offload_moves_the_state_to_host_bytes():
    """parallel.offload=optimizer.

    Host bytes are the optimizer state (2 Adam moments of this device's parameter shard: 2 x 4 N / 2 on fsdp=2) and
    the device peak drops by them.
    """
    sizes = parse_mesh("fsdp=2")
    base = plan(CFG, sizes, jax.devices()[:2])
    off_cfg = load_config("configs/gpt2-tiny.yaml", ["parallel.offload=optimizer"])
    off = plan(off_cfg, sizes, jax.devices()[:2])
    assert base["host_bytes"] == 0 and abs(off["host_bytes"] - 2 * 4 * N / 2) <= 0.01 * 4 * N
    assert off["peak_bytes"] == base["peak_bytes"] - off["host_bytes"]


def test_recommend_proposes_offload_when_nothing_else_fits():
    plain = recommend(CFG, 2, budget=10**12, peak_flops=1e12, bandwidth=1e10)
    smallest = min(r["peak_bytes"] for r in plain)
    rows = recommend(CFG, 2, budget=smallest - 1, peak_flops=1e12, bandwidth=1e10)
    assert any(r["fits"] for r in rows) and all(r["offload"] != "none" for r in rows if r["fits"])
    assert {r["offload"] for r in rows} >= {"none", "optimizer"}


def test_bf16_gradient_compression_halves_the_gradient_terms_of_the_bound():
    """Gradients travel at 2 bytes where the wire is bfloat16 (not on the CPU, which reduces in float32).

    The parameters' all-gather over fsdp stays at 4; only data-axis reductions count as gradient traffic.
    """
    from jaxpar.tools.plan import analytic_bounds, gradient_traffic

    sizes = {"dp": 4, "fsdp": 2, "tp": 1}
    plain, bf16 = tiny_config(), tiny_config("parallel.grad_compression=bf16")
    base, gpu = analytic_bounds(plain, sizes, 1000), analytic_bounds(bf16, sizes, 1000, "gpu")
    assert gpu["dp"] == base["dp"] / 2 and gpu["fsdp"] == base["fsdp"] * 3 / 4
    assert analytic_bounds(bf16, sizes, 1000, "cpu") == base
    ops = [
        {"op": "all-reduce", "axes": "dp", "traffic_bytes": 10},
        {"op": "reduce-scatter", "axes": "dp+fsdp", "traffic_bytes": 5},
        {"op": "all-gather", "axes": "fsdp", "traffic_bytes": 7},
        {"op": "all-reduce", "axes": "tp", "traffic_bytes": 3},
    ]
    assert gradient_traffic(ops) == 15


def test_powersgd_gradient_bytes_are_its_low_rank_factors():
    """PowerSGD rank 4 on dp=8.

    What the compiled step all-reduces over dp is r(m+n) per compressed matrix plus the uncompressed leaves, per
    rank 414,720 bytes for this model -- the figure torch's powerSGD_hook counted for torchpar's copy of it
    (docs/benchmarks/grad-compression.md) -- sent by a ring all-reduce (2 (n-1)/n).
    """
    r = 4
    compressed = L * r * (4 * d + 2 * (d + f)) + r * (V + d) + r * (m.max_seq_len + d)  # qkv, fc, proj; wte, wpe
    whole = N - L * (3 * d * d + 2 * d * f) - (V + m.max_seq_len) * d
    assert 4 * (compressed + whole) == 414_720
    cfg = load_config("configs/gpt2-tiny.yaml", ["parallel.grad_compression=powersgd"])
    got = plan(cfg, {"dp": 8}, jax.devices()[:8])
    bound = 2 * 414_720 * 7 / 8
    assert bound <= got["gradient_bytes"] <= 1.1 * bound and got["bounds"]["dp"] == bound
    assert got["gradient_bytes"] < 0.15 * run("dp=8")["gradient_bytes"]
    # its state on each device: one error buffer per parameter (float32, this rank's) and the replicated Q factors
    q = 4 * (L * r * (3 * d + f + d) + r * (d + d))  # qkv (3, heads, head_dim) x r, fc: f x r, proj: d x r; wte, wpe
    assert got["powersgd_bytes"] == 4 * N + q and got["peak_bytes"] > run("dp=8")["peak_bytes"] + 2 * N  # in the peak


def test_schedules_side_by_side():
    """--schedules on pp=2 (4 layers, M=4).

    Every schedule with its table's bubble (the textbook fractions), 1F1B at one device's matmul FLOPs and so are
    ZB-H1 and ZB-V (W: the projections' weight gradients alone), ZB-H1's memory within 1.05x of 1F1B's (W's stash:
    each projection's input and output gradient, which B hands out, mostly in residual buffers B has done with),
    ZB-V's within 1.1x; DualPipeV's bubble in lockstep (pipeline_schedules. lockstep_bubble) and one device's FLOPs;
    the modeled step time, and auto marked on its least.
    """
    from jaxpar.core.pipeline.schedules import lockstep_bubble, simulate
    from jaxpar.tools.plan import compare_schedules

    rows = {r["schedule"]: r for r in compare_schedules(tiny_config("model.n_layer=4"), {"pp": 2}, jax.devices()[:2])}
    S, M = 2, 4
    want = {
        "gpipe": (S - 1) / (M + S - 1),
        "1f1b": (S - 1) / (M + S - 1),
        "interleaved": (S - 1) / (2 * M + S - 1),
        "zb_h1": (S - 1) / (3 * M + S - 1),
        "zb_v": (S - 1) / (6 * M + S - 1),
        "dualpipev": lockstep_bubble("dualpipev", simulate("dualpipev", S, M)),
    }  # its FB ticks: 3 units
    assert {k: round(r["bubble"], 6) for k, r in rows.items()} == {k: round(v, 6) for k, v in want.items()}
    assert all(rows[s]["flops_ratio"] == pytest.approx(1.0, abs=0.01) for s in ("1f1b", "zb_h1", "zb_v", "dualpipev"))
    assert rows["zb_h1"]["temp_bytes"] <= 1.05 * rows["1f1b"]["temp_bytes"]
    assert rows["zb_v"]["temp_bytes"] <= 1.1 * rows["1f1b"]["temp_bytes"]
    # the modeled time column, and auto's mark on its least (every schedule fits: no --memory-per-device)
    times = {s: r["flops_ratio"] / (1 - r["bubble"]) for s, r in rows.items()}
    assert all(rows[s]["modeled_time"] == pytest.approx(t) for s, t in times.items())
    assert [s for s, r in rows.items() if r["auto"]] == [min(times, key=times.get)]


def test_plan_compiles_each_bucket_and_reports_the_highest_peak():
    """data.batching=buckets: as many rows x targets shapes as buckets, each with the same tokens.

    The longest holds the largest attention scores (rows x T^2), so its peak is the highest and the plan shown is
    its.
    """
    cfg = tiny_config("data.batching=buckets", "data.seq_len=32", "model.max_seq_len=32", "train.tokens_per_batch=512")
    p = plan(cfg, parse_mesh("dp=2"), jax.devices()[:2])
    assert [(s["rows"], s["seq_len"]) for s in p["shapes"]] == [(128, 4), (64, 8), (32, 16), (16, 32)]
    peaks = [s["peak_bytes"] for s in p["shapes"]]
    assert peaks == sorted(peaks) and p["peak_bytes"] == peaks[-1] > peaks[0]
    # 96 tokens a batch: the 32-token bucket has 3 rows, which no data axis of 4 devices divides: tp=4 alone
    three = tiny_config("data.batching=buckets", "data.seq_len=32", "model.max_seq_len=32", "train.tokens_per_batch=96")
    assert list(candidate_meshes(three, 4)) == [{"dp": 1, "fsdp": 1, "tp": 4}]


def test_the_experts_exchange_is_four_buffers_per_layer_and_microbatch():
    """ep=4,dp=2 on configs/moe-tiny.yaml.

    Per layer and step the experts' padded buffer [8 experts, 2 rows x 64 tokens, 128] float32 crosses ep four times
    (two all-to-alls forward, their two transposes backward), each sending 3/4 of it; within 1.1x, as the ragged
    figure counts top_k slots per token instead of 8.
    """
    cfg = load_config("configs/moe-tiny.yaml")
    p = plan(cfg, {"ep": 4, "dp": 2}, jax.devices()[:8])
    buffer = 8 * (16 // 8) * 64 * 128 * 4
    figure = 4 * cfg.model.n_layer * buffer * 3 / 4
    assert figure <= p["measured"]["ep"] <= 1.1 * figure
    assert p["ragged_exchange_bytes"] == figure * 2 / 8
    experts = 3 * 8 * 128 * 96 * 4 * cfg.model.n_layer  # gate, up, down of 8 experts, a quarter on each device
    assert p["expert_bytes"] == experts // 4


def test_recommend_proposes_ep_for_experts():
    cfg = load_config("configs/moe-tiny.yaml")
    meshes = list(candidate_meshes(cfg, 8))
    assert {"dp": 1, "fsdp": 1, "tp": 1, "ep": 8} in meshes and {"dp": 2, "fsdp": 1, "tp": 1, "ep": 4} in meshes
    assert all("ep" not in s for s in candidate_meshes(CFG, 8))  # a dense model: no ep


def muon_plan(layers: int) -> tuple[dict, float, float]:
    """The tiny model with optim.name=muon on fsdp=8.

    Its plan, the bound of spreading its Muon matrices (2 x 7/8 x 1/8 of their bytes per device: the momentum there,
    the update back) and that bound with each parameter's matrix count padded to a multiple of 8 (3 x layers q/k/v
    and `layers` of each other kind).
    """
    d, pad = 32, lambda b: b + -b % 8
    square, wide = 4 * d * d, 4 * d * 4 * d  # bytes of a q/k/v or out matrix; of an fc or proj
    bound = 2 * 7 / 8 * layers * (4 * square + 2 * wide) / 8
    padded = 2 * 7 / 8 * ((pad(3 * layers) + pad(layers)) * square + 2 * pad(layers) * wide) / 8
    return (
        plan(tiny_config("optim.name=muon", f"model.n_layer={layers}"), {"fsdp": 8}, jax.devices()[:8]),
        bound,
        padded,
    )


def test_muon_spreads_its_matrices_and_says_what_it_sends():
    """optim.name=muon, 4 layers on fsdp=8.

    The optimizer's row is what Muon adds to its AdamW twin's step, between the bound and the padded figure
    (gathering every whole matrix on every device would send 7/8 of the matrices' bytes, 2.2x the padded figure
    here), with a note that says why where it passes 1.1x the bound; the per-axis rows are the twin's, and the rows
    add up to the step's traffic.
    """
    p, bound, padded = muon_plan(4)
    assert p["bounds"]["optimizer"] == pytest.approx(bound)
    assert 0.99 * bound <= p["measured"]["optimizer"] <= 1.001 * padded
    assert sum(p["measured"].values()) == pytest.approx(p["traffic_bytes"])
    assert {c["op"] for c in p["collectives"] if c["optimizer"]} == {"all-to-all"}
    if p["measured"]["optimizer"] > 1.1 * bound:
        assert any(n.startswith("optimizer: ") for n in p["notes"]), p["notes"]
    adamw = plan(tiny_config("model.n_layer=4"), {"fsdp": 8}, jax.devices()[:8])
    assert adamw["bounds"]["optimizer"] == adamw["measured"]["optimizer"] == 0
    assert not any(c["optimizer"] for c in adamw["collectives"])


@pytest.mark.parametrize("layers", [4, 8])
def test_muon_sends_within_1_1x_of_its_bound_on_fsdp8(layers):
    """Issue 47's acceptance.

    Muon's optimizer collectives on fsdp=8 within 1.1x of their bound, 4 layers (each parameter's count of matrices
    no multiple of 8) and 8 (every count one).
    """
    p, bound, _ = muon_plan(layers)
    assert p["measured"]["optimizer"] <= 1.1 * bound, p["notes"]
