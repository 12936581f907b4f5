"""Ahead-of-time plan of a layout: per-device memory and per-step collectives of the compiled train step.

python -m jaxpar.tools.plan --config C --mesh M [--schedules] [--recommend --devices N --memory-per-device 80GiB]

Ahead of time, nothing trained or allocated: compile the real train step for a layout, then
report per-device memory from XLA's memory analysis and every collective per step (with loop
trip counts) next to the analytic lower bound of each parallelism axis, and of Muon's spread of its
matrices (jaxpar/cost/optimizer_traffic.py). With parallel.offload the state kept in host memory between
steps is reported apart (`host`) from the device's peak.
`--recommend` compiles every mesh that divides the model, drops those over the memory budget and ranks
the rest by a predicted step time (compute at a peak FLOP rate + communication at a link bandwidth);
when no mesh fits it tries them again with the optimizer state, then the parameters too, offloaded.
`--schedules` (a mesh with pp > 1) sets every pipeline schedule side by side for the config and mesh: the
table's bubble, the compiled step's peak and temporary memory per device, matmul FLOPs against one device's, the
modeled step time FLOPs / (1 - bubble), and the schedule parallel.pipeline_schedule=auto picks (the least modeled
time within --memory-per-device; jaxpar/core/pipeline/choice.py).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import sys
import time

import jax

from jaxpar.core.data.batch_shapes import batch_shapes, bucket_shapes, shape_config
from jaxpar.core.config.schema import Config, load_config
from jaxpar.core.errors import UserError, cli
from jaxpar.core.model.experts import row_capacity, slots_for
from jaxpar.core.model.flops import flops_per_token
from jaxpar.core.pipeline.schedules import concrete, configured_bubble, resolve_microbatches
from jaxpar.core.config.mesh_spec import format_mesh, parse_mesh
from jaxpar.mesh import setup_devices
from jaxpar.cost.peak_bytes import compile_layout, device_memory, peak_bytes, shard_bytes
from jaxpar.models.mla import kv_cache_width
from jaxpar.parallel import diloco, powersgd
from jaxpar.pipeline.auto import resolve_schedule
from jaxpar.step import compiled_train_step
from jaxpar.cost import (
    activations as plan_activations,
    hlo_collectives,
    optimizer_traffic as plan_optimizer,
    schedule_times as plan_schedules,
)


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?i?B?)\s*", text, re.I)
    if not m:
        raise UserError(f"cannot read a memory size from {text!r} (try 80GiB or 16GB)")
    unit = m[2].upper().rstrip("B")
    scale = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
    return int(float(m[1]) * scale)


def exchange_bytes(cfg: Config, sizes: dict[str, int], ragged: bool = False) -> float:
    """Bytes each device sends per step over ep by the experts' exchange (jaxpar/parallel/expert_parallel.py).

    Per layer and microbatch two all-to-alls of the buffer [experts, slots, embed] forward and two backward (a third
    and fourth forward with model.remat), each sending (ep-1)/ep of it. `ragged`: the slots filled alone (each
    token's top_k choices), what an exchange without padding would send.
    """
    m, t, ep = cfg.model, cfg.train, sizes.get("ep", 1)
    if ep == 1 or not m.moe_experts:
        return 0.0
    rows = t.global_batch_size // t.microbatches // (sizes["dp"] * sizes["fsdp"] * ep)
    T = cfg.data.seq_len // sizes["sp"]
    slots = slots_for(rows * T, rows, row_capacity(m, cfg.data.seq_len))
    buffer = (
        (rows * T * m.moe_top_k if ragged else m.moe_experts * slots)
        * m.d_model
        * (4 if m.compute_dtype == "float32" else 2)
    )
    passes = 4 + 2 * (m.remat != "none")
    S = sizes["pp"]  # GPipe: a stage's L/S layers run every one of M + S - 1 ticks on a pipeline microbatch
    M = resolve_microbatches(S, cfg.parallel.pipeline_microbatches) if S > 1 else 1
    return m.moe_layers * t.microbatches * passes * buffer * (ep - 1) / ep * (M + S - 1) / (M * S)


def analytic_bounds(
    cfg: Config,
    sizes: dict[str, int],
    param_bytes_per_device: int,
    platform: str = "gpu",
    powersgd_bytes: int = 0,
    expert_bytes: int = 0,
) -> dict[str, float]:
    """Per-device bytes sent per step by bandwidth-optimal collectives, one term per mesh axis.

    Gradients travel at half their float32 bytes with parallel.grad_compression=bf16, except on the CPU (rounded to
    bfloat16 there, reduced in float32: jaxpar/parallel/compression.py); with powersgd, `powersgd_bytes` (a rank's
    payload: r(m+n) per matrix, the rest whole; divided by tp here, an estimate there) all-reduced over dp x fsdp at
    once, after the parameters are gathered whole over fsdp.
    """
    m, t = cfg.model, cfg.train
    grads = 0.5 if cfg.parallel.grad_compression == "bf16" and platform != "cpu" else 1.0
    dp, fsdp, tp, ep = sizes["dp"], sizes["fsdp"], sizes["tp"], sizes.get("ep", 1)
    act_bytes = 4 if m.compute_dtype == "float32" else 2
    rows = t.global_batch_size // (dp * fsdp * ep)  # per device, all microbatches together
    activation = rows * cfg.data.seq_len * m.d_model * act_bytes
    unsharded_over_fsdp = param_bytes_per_device * fsdp
    if cfg.parallel.grad_compression == "powersgd":
        n, payload = dp * fsdp, powersgd_bytes / tp
        data = 2 * payload * (n - 1) / n  # one all-reduce group over both data axes: the planner files it by fsdp
        return {
            "dp": 0.0 if fsdp > 1 else data,
            "fsdp": unsharded_over_fsdp * (fsdp - 1) / fsdp + (data if fsdp > 1 else 0.0),
            "tp": (4 * m.n_layer + 2) * activation * 2 * (tp - 1) / tp,
        }
    dense, data = param_bytes_per_device - expert_bytes, dp * ep  # ep is a data axis for all but the experts
    return {
        # gradients of this device's parameter shard, all-reduced over dp (and ep, the experts' over dp alone)
        "dp": 2 * grads * (dense * (data - 1) / data + expert_bytes * (dp - 1) / dp),
        # parameters all-gathered once, gradients reduce-scattered once
        "fsdp": (1 + grads) * unsharded_over_fsdp * (fsdp - 1) / fsdp,
        # Megatron: 2 activation all-reduces per block forward and 2 backward, plus the
        # vocab-parallel embedding (forward) and tied head (backward)
        "tp": (4 * m.n_layer + 2) * activation * 2 * (tp - 1) / tp,
        "ep": exchange_bytes(cfg, sizes),
    }


def plan(cfg: Config, sizes: dict[str, int], devices=None) -> dict:
    """The plan of the step at the config's batch shape.

    With data.batching=buckets, of each bucket's shape, the one with the highest peak returned, every shape's peak
    under "shapes". (A train.batch_rampup's largest batch is the config's own.)
    """
    if cfg.data.batching != "buckets":
        return plan_shape(cfg, sizes, devices)
    plans = [(rows, T, plan_shape(shape_config(cfg, rows, T), sizes, devices)) for rows, T in bucket_shapes(cfg)]
    worst = max((p for _, _, p in plans), key=lambda p: p["peak_bytes"])
    return {
        **worst,
        "shapes": [
            {"rows": r, "seq_len": T, "peak_bytes": p["peak_bytes"], "traffic_bytes": p["traffic_bytes"]}
            for r, T, p in plans
        ],
    }


def plan_shape(cfg: Config, sizes: dict[str, int], devices=None) -> dict:
    compiled, layout, state = compile_layout(cfg, sizes, devices)
    memory = device_memory(compiled, layout, state)
    full = dict(layout.mesh.shape)
    n_dev = layout.mesh.devices.size
    params, opt = shard_bytes(state["params"]), shard_bytes(state["opt_state"])
    collectives = []
    for c in hlo_collectives.parse(compiled.as_text(), n_dev):
        axes = hlo_collectives.group_axes(c.groups, layout.mesh) if c.op != "collective-permute" else ("pp/sp",)
        collectives.append(
            {
                "op": c.op,
                "axes": "+".join(axes) or "-",
                "result_bytes": c.result_bytes,
                "group": c.group_size,
                "count": c.count,
                "traffic_bytes": c.traffic_bytes * c.count,
                "optimizer": plan_optimizer.is_optimizers(c.files),
            }
        )

    payload = powersgd.payload_bytes(layout) if powersgd.enabled(layout) else 0
    experts = shard_bytes(
        {k: v for k, v in state["params"]["blocks"].get("moe", {}).items() if k != "shared" and k != "router"}
    )
    bounds = analytic_bounds(cfg, full, params, layout.mesh.devices.flat[0].platform, payload, experts)
    bounds["optimizer"], padded = plan_optimizer.muon_bounds(cfg, state["params"], n_dev)
    measured = measure(collectives, bounds)

    width = kv_cache_width(cfg.model)  # per token per layer: MLA its latent + rope key, MHA/GQA keys + values
    itemsize = 4 if cfg.model.compute_dtype == "float32" else 2
    model = {
        "compute_dtype": cfg.model.compute_dtype,
        "family": cfg.model.family,
        "attention": cfg.model.attention,
        "linear": cfg.model.linear,
        "kv_cache_width": width,
        "kv_cache_bytes_per_token": width * cfg.model.n_layer * itemsize,
    }
    par = cfg.parallel
    pipeline = (
        None
        if full["pp"] == 1
        else {
            "schedule": concrete(par.pipeline_schedule),
            "bubble": configured_bubble(
                par.pipeline_schedule, full["pp"], par.pipeline_microbatches, par.pipeline_virtual_stages
            ),
        }
    )
    p = {
        "mesh": format_mesh(full),
        "devices": n_dev,
        "model": model,
        "pipeline": pipeline,
        "params_bytes": params,
        "opt_state_bytes": opt,
        "expert_bytes": experts,
        "ragged_exchange_bytes": exchange_bytes(cfg, full, ragged=True),
        "powersgd_bytes": shard_bytes(state.get("powersgd", {})),  # error buffers and Q (in argument/peak too)
        "offload": cfg.parallel.offload,
        **memory,
        "collectives": collectives,
        "bounds": bounds,
        "measured": measured,
        "traffic_bytes": sum(c["traffic_bytes"] for c in collectives),
        "bound_bytes": sum(bounds.values()),
        "gradient_bytes": gradient_traffic(collectives),
        "notes": explain(
            collectives, bounds, measured, layout.mesh.devices.flat[0].platform, bool(cfg.model.moe_experts)
        ),
    }
    if layout.group is not None:
        p["diloco"] = between_groups(layout, state, collectives)
    plan_activations.account(p, layout)  # model.remat=offload's activations in host memory
    return plan_optimizer.against_adamw(p, cfg, lambda adamw: plan_shape(adamw, sizes, devices), padded)


def between_groups(layout, state, collectives) -> dict:
    """DiLoCo's bytes sent between groups per device, from the compiled inner step and meetings.

    Each inner step's (0: it is manual over `diloco`), each fragment's meeting (its mean delta's all-reduce; with
    parallel.diloco_delay, read off the inner step that carries it), and their mean per step: every fragment meets once
    in parallel.diloco_inner_steps steps.
    """
    meetings = []
    for f in range(layout.cfg.parallel.diloco_fragments):
        if layout.cfg.parallel.diloco_delay:
            compiled = compiled_train_step(layout, state, carry=f)
        else:
            compiled = diloco.make_outer_step(layout, f).lower(state, 0).compile()
        meetings.append(
            sum(
                c.traffic_bytes * c.count
                for c in hlo_collectives.parse(compiled.as_text(), layout.mesh.devices.size)
                if diloco.AXIS in hlo_collectives.group_axes(c.groups, layout.mesh)
            )
        )
    H = layout.cfg.parallel.diloco_inner_steps
    inner = sum(c["traffic_bytes"] for c in collectives if diloco.AXIS in c["axes"].split("+"))
    return {
        "groups": diloco.groups(layout.mesh),
        "inner_steps": H,
        "inner_step_bytes": inner,
        "meeting_bytes": meetings,
        "per_step_bytes": inner + sum(meetings) / H,
    }


def measure(collectives, bounds) -> dict[str, float]:
    """Bytes sent per device per step against each bound: the experts' exchange on ep, others by their axes."""
    measured = {a: 0.0 for a in bounds}
    for c in collectives:
        axes = c["axes"].split("+")
        key = (
            "optimizer"
            if c["optimizer"]
            else "ep"
            if c["op"] == "all-to-all" and "ep" in axes
            else next((a for a in ("tp", "fsdp", "dp") if a in axes), "dp" if "ep" in axes else None)
        )
        if key:
            measured[key] += c["traffic_bytes"]
    return measured


def gradient_traffic(collectives) -> float:
    """Bytes sent per device per step by the reductions over the data axes alone (dp, fsdp).

    The gradients (and the loss, 4 bytes); parallel.grad_compression shows here.
    """
    return sum(
        c["traffic_bytes"]
        for c in collectives
        if c["op"] in ("all-reduce", "reduce-scatter") and set(c["axes"].split("+")) <= {"dp", "fsdp", "ep"}
    )


# what tests/jaxpar/test_plan.py and the HLO showed (docs/benchmarks/README.md "Planner"): jax 0.10.2's XLA:CPU
CPU_REDUCE_SCATTER = (
    "XLA:CPU has no pass that forms reduce-scatter (ReduceScatterCreator runs in XLA:GPU's "
    "collective pipeline only), so GSPMD's all-reduce + dynamic-slice stays; on a GPU the same "
    "step should show reduce-scatter here (check: this command on a GPU)"
)


def explain(collectives, bounds, measured, platform: str = "cpu", experts: bool = False) -> list[str]:
    """Why an axis moves more than its lower bound, collective by collective."""
    notes = []
    for axis in ("dp", "fsdp", "tp"):
        if measured[axis] <= 1.1 * bounds[axis] + 1024:
            continue
        if axis == "tp" and experts:
            notes.append(
                "tp: the experts' partial outputs are summed over tp on the padded buffer [experts, slots, "
                "embed] (parallel/expert_parallel.py), not in the bound"
            )
        ops = [c for c in collectives if axis in c["axes"].split("+") and not c["optimizer"]]  # Muon's: its own note
        if (
            axis != "tp"
            and any(c["op"] == "all-reduce" for c in ops)
            and not any(c["op"] == "reduce-scatter" for c in ops)
        ):
            notes.append(
                f"{axis}: gradients are all-reduced and then sliced, where a reduce-scatter would do: up to "
                "2x the gradient term. "
                + (CPU_REDUCE_SCATTER if platform == "cpu" else "This backend formed no reduce-scatter: worth a look.")
            )
        gathered = sum(c["result_bytes"] * c["count"] for c in ops if c["op"] == "all-gather")
        if axis == "fsdp" and gathered:
            notes.append(
                f"fsdp: {gathered:,} bytes all-gathered per step: parameters are gathered again in "
                "the backward pass instead of being kept from the forward (saves memory, costs traffic)"
            )
        if any(c["op"] == "all-to-all" for c in ops):
            notes.append(f"{axis}: all-to-all resharding (e.g. the embedding gather's output), not in the bound")
    return notes


def print_plan(p: dict) -> None:
    gib = lambda b: f"{b / 2**20:,.2f} MiB"
    m = p["model"]
    print(
        f"model: family={m['family']} attention={m['attention']} linear={m['linear']}, key/value cache per token: "
        f"{m['kv_cache_width']} values per layer ({m['kv_cache_bytes_per_token']:,} bytes over all layers)"
    )
    print(
        f"mesh {p['mesh']} ({p['devices']} devices), compute {m['compute_dtype']}, offload {p['offload']}, per device:"
    )
    for key in (
        "params_bytes",
        "expert_bytes",
        "opt_state_bytes",
        "powersgd_bytes",
        "argument_bytes",
        "temp_bytes",
        "peak_bytes",
        "host_bytes",
    ):
        print(f"  {key.removesuffix('_bytes'):<10} {gib(p[key])}")
    if p["host_bytes"]:
        print(
            "  (peak: device memory; host: the offloaded state, in host memory between steps"
            + (
                "; this backend's memory analysis does not count host memory apart: peak is the compiled peak less "
                "the offloaded state, a lower bound where the step holds all of it on the device at once)"
                if p["peak_estimated"]
                else ")"
            )
        )
    if p["pipeline"]:
        print(
            f"  pipeline {p['pipeline']['schedule']}: bubble {p['pipeline']['bubble']:.3f} of the stages' time "
            "idle (python -m jaxpar.tools.pipeline_table shows the schedule)"
        )
    if "shapes" in p:
        print("  data.batching=buckets: each bucket's batch (rows x targets) compiled; shown: the highest peak")
        for s in p["shapes"]:
            print(
                f"    {s['rows']:>5} x {s['seq_len']:<6} peak {gib(s['peak_bytes'])}, sends {s['traffic_bytes']:,.0f} B"
            )
    print(f"collectives per step ({len(p['collectives'])}):")
    print(f"  {'op':<18} {'axes':<10} {'group':>5} {'count':>5} {'result bytes':>14} {'sent bytes/step':>16}")
    for c in sorted(p["collectives"], key=lambda c: -c["traffic_bytes"]):
        print(
            f"  {c['op']:<18} {c['axes']:<10} {c['group']:>5} {c['count']:>5} {c['result_bytes']:>14,} "
            f"{c['traffic_bytes']:>16,.0f}"
        )
    print("per axis: measured vs analytic lower bound (bytes sent per device per step)")
    for axis, bound in ((a, b) for a, b in p["bounds"].items() if a != "optimizer" or b or p["measured"][a]):
        ratio = f"{p['measured'][axis] / bound:.2f}x" if bound else "-"
        print(f"  {axis:<9} {p['measured'][axis]:>14,.0f} {bound:>14,.0f}  {ratio}")
    print(
        f"  total     {p['traffic_bytes']:>14,.0f} {p['bound_bytes']:>14,.0f}  "
        f"{p['traffic_bytes'] / max(p['bound_bytes'], 1):.2f}x"
    )
    print(f"  gradient reductions over dp/fsdp: {p['gradient_bytes']:,.0f}")
    if p["bounds"]["ep"]:
        print(
            f"  ep: the padded exchange's figure; a ragged one would send {p['ragged_exchange_bytes']:,.0f} "
            "(the chosen slots alone; not built: XLA:CPU has no ragged all-to-all)"
        )
    if "diloco" in p:
        d = p["diloco"]
        print(
            f"DiLoCo, {d['groups']} groups: sent between groups per device: {d['inner_step_bytes']:,.0f} B by each "
            f"inner step, {' + '.join(f'{b:,.0f}' for b in d['meeting_bytes'])} B by each fragment's meeting (its "
            f"mean delta's all-reduce), {d['per_step_bytes']:,.0f} B per step over {d['inner_steps']} steps"
        )
    for note in p["notes"]:
        print(f"  note: {note}")


def candidate_meshes(cfg: Config, n: int):
    """Every dp x fsdp x tp (x ep, with experts) factorisation of n that the model and batch divide."""
    divisors = lambda k: (d for d in range(1, k + 1) if k % d == 0)
    E = cfg.model.moe_experts
    for ep in (d for d in divisors(n) if E % d == 0 and (E or d == 1)):
        for tp in divisors(n // ep):
            for fsdp in divisors(n // ep // tp):
                dp = n // ep // tp // fsdp
                micro = [rows // cfg.train.microbatches for rows, _ in batch_shapes(cfg)]  # every batch shape's
                if cfg.model.n_head % tp == 0 and all(m % (dp * fsdp * ep) == 0 for m in micro):
                    yield {"dp": dp, "fsdp": fsdp, "tp": tp, **({"ep": ep} if E else {})}


def say_progress(line: str) -> None:
    """A long tool's progress, on stderr (its result goes to stdout)."""
    print(line, file=sys.stderr, flush=True)


def recommend(
    cfg: Config, n: int, budget: int, peak_flops: float, bandwidth: float, progress=say_progress
) -> list[dict]:
    """Every candidate mesh of n devices compiled and ranked.

    `progress(line)` hears of each as it is compiled (the whole takes a minute for a small model).
    """
    tokens = max(rows * T for rows, T in batch_shapes(cfg))  # the largest batch (a ramp's end; about each bucket's)
    compute_s = tokens * flops_per_token(cfg.model, cfg.data.seq_len) / n / peak_flops
    rows, meshes = [], list(candidate_meshes(cfg, n))
    progress(f"plan: compiling the train step on each of {len(meshes)} meshes of {n} devices (nothing allocated)")
    for offload in ("none", "optimizer", "params+optimizer"):  # offload only when nothing fits without it
        trial = copy.deepcopy(cfg)
        trial.parallel.offload = offload
        if offload != "none":
            progress(f"plan: no mesh fits in the budget; compiling them again with parallel.offload={offload}")
        for i, sizes in enumerate(meshes, 1):
            t0 = time.perf_counter()
            p = plan(trial, sizes, jax.devices()[:n])
            fits = p["peak_bytes"] <= budget
            progress(
                f"plan: mesh {i} of {len(meshes)}, {p['mesh']} (offload {offload}): peak "
                f"{p['peak_bytes'] / 2**30:.3f} GiB{'' if fits else ', over the budget'}, compiled in "
                f"{time.perf_counter() - t0:.1f} s"
            )
            rows.append(
                {
                    "mesh": p["mesh"],
                    "offload": offload,
                    "peak_bytes": p["peak_bytes"],
                    "host_bytes": p["host_bytes"],
                    "fits": fits,
                    "traffic_bytes": p["traffic_bytes"],
                    "predicted_step_s": compute_s + p["traffic_bytes"] / bandwidth,
                }
            )
        if any(r["fits"] for r in rows):
            break
    return sorted(rows, key=lambda r: (not r["fits"], r["predicted_step_s"]))


def compare_schedules(cfg: Config, sizes: dict[str, int], devices=None, budget: int | None = None) -> list[dict]:
    """Every pipeline schedule's row of the `--schedules` table (plan_schedules.compare).

    Each schedule is said on stderr as it is compiled.
    """

    def planned(c: Config, sizes: dict[str, int], devices=None) -> dict:
        say_progress(
            f"plan: compiling parallel.pipeline_schedule={c.parallel.pipeline_schedule} on {format_mesh(sizes)}"
        )
        return plan(c, sizes, devices)

    return plan_schedules.compare(cfg, sizes, planned, devices, budget)


@cli
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m jaxpar.tools.plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config")
    ap.add_argument("--mesh", help="layout to plan (default: parallel.mesh)")
    ap.add_argument("--recommend", action="store_true", help="rank every mesh of --devices that fits")
    ap.add_argument("--devices", type=int, help="device count for --recommend (simulated on CPU)")
    ap.add_argument("--memory-per-device", default="80GiB")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="per-device compute rate for predictions")
    ap.add_argument("--bandwidth-gbs", type=float, default=400.0, help="per-device link bandwidth, GB/s")
    ap.add_argument(
        "--schedules", action="store_true", help="every pipeline schedule side by side (pp > 1), auto's choice marked"
    )
    ap.add_argument("--json", help="also write the result as JSON here")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args(argv)
    cfg = load_config(args.config, args.overrides)
    if args.recommend and args.schedules:
        raise UserError(
            "--schedules compares pipeline schedules on one --mesh; --recommend ranks meshes: one or the other"
        )
    if args.recommend:
        if not args.devices or args.devices < 1:
            raise UserError("--recommend needs --devices N")
        budget = parse_bytes(args.memory_per_device)
        os.environ.setdefault("JAXPAR_CPU_DEVICES", str(args.devices))
        setup_devices({"dp": args.devices})
        result = recommend(cfg, args.devices, budget, args.peak_tflops * 1e12, args.bandwidth_gbs * 1e9)
        print(
            f"{'mesh':<22} {'offload':<17} {'peak/device':>14} {'host/device':>14} {'fits':>5} {'predicted step':>15}"
        )
        for r in result:
            print(
                f"{r['mesh']:<22} {r['offload']:<17} {r['peak_bytes'] / 2**30:>10.3f} GiB "
                f"{r['host_bytes'] / 2**30:>10.3f} GiB {'yes' if r['fits'] else 'NO':>5} "
                f"{r['predicted_step_s'] * 1e3:>12.3f} ms"
            )
        if not any(r["fits"] for r in result):
            print(f"no mesh of {args.devices} devices fits in {args.memory_per_device} per device")
    else:
        sizes = parse_mesh(args.mesh or cfg.parallel.mesh)
        setup_devices(sizes)
        if args.schedules:
            result = compare_schedules(cfg, sizes, budget=parse_bytes(args.memory_per_device))
            plan_schedules.print_schedules(result)
        else:
            cfg, chosen = resolve_schedule(cfg, sizes, None, peak_bytes, parse_bytes(args.memory_per_device))
            if chosen:  # parallel.pipeline_schedule=auto's choice
                print(chosen)
            result = plan(cfg, sizes)
            print_plan(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
