"""What a (config, mesh) pair needs before anything is traced, stated in the user's terms, one line each.

`validate` is the one entry that runs them all (torchpar/checks.py's `validate` is its twin). A (config, mesh) pair
is checked once per process: the automatic pipeline schedule checks its candidates, the trainer the chosen one, and
each Layout its own, and a pair accepted before is not checked again.
"""

from __future__ import annotations

import json

from jaxpar.core.data.batch_shapes import for_each_shape
from jaxpar.core.config.schema import Config
from jaxpar.core.config.contract import Run, check_contract
from jaxpar.core.model.experts import check_expert_axis
from jaxpar.core.errors import UserError
from jaxpar.core.pipeline.schedules import check_schedule, chunks, concrete, resolve_microbatches
from jaxpar.core.run.resume import check_resume
from jaxpar.core.run.directory import check_run_dir_framework
from jaxpar.core.evaluation.tasks import check_eval_tasks
from jaxpar.core.run.trackers import check_trackers
from jaxpar.core.optimizer.outer import check_diloco
from jaxpar.parallel.sequence import check_sequence, check_window


def validate(cfg: Config, sizes, is_main: bool = True) -> None:
    """Everything jaxpar refuses before it traces, in this order.

    run.dir and what a resume may change (every process refuses alike; the main one says what changed), the
    trackers, the config contract, the layout at every batch shape. sizes: the mesh's axis -> size.
    """
    check_run_dir_framework(cfg, "jaxpar")
    check_resume(cfg, is_main)
    check_trackers(cfg)
    check_eval_tasks(cfg)
    check_config(cfg, sizes)


_ACCEPTED: set[str] = set()  # the (check, config, mesh) triples accepted so far in this process


def once(what: str, cfg: Config, sizes, check) -> None:
    """Run `check()` unless it accepted this config on this mesh before in this process; remember it if it does."""
    key = json.dumps([what, cfg.to_dict(), sorted(dict(sizes).items())], default=str)
    if key not in _ACCEPTED:
        check()
        _ACCEPTED.add(key)


def check_config(cfg: Config, sizes) -> None:
    """The config contract, then the layout at every batch shape (sizes: mesh axis -> size)."""

    def check():
        check_contract(Run(cfg, "jaxpar", mesh=dict(sizes)))
        for_each_shape(cfg, lambda at: check_layout(at, sizes))

    once("config", cfg, sizes, check)


def check_layout(cfg: Config, sizes) -> None:
    """Divisibility the sharded program needs (sizes: mesh axis -> size)."""
    once("layout", cfg, sizes, lambda: divisibility(cfg, sizes))


def batch_ways(sizes) -> tuple[str, int]:
    """The axes a batch's rows are split over as a user reads them, and their product.

    "dp*fsdp*ep", with DiLoCo's groups "diloco*dp*fsdp*ep".
    """
    names = ("diloco",) * (sizes.get("diloco", 1) > 1) + ("dp", "fsdp", "ep")
    return "*".join(names), sizes["dp"] * sizes["fsdp"] * sizes["ep"] * sizes.get("diloco", 1)


def divisibility(cfg: Config, sizes) -> None:
    """check_layout's checks, each time it is called."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    if m.n_head % sizes["tp"]:
        raise UserError(f"model.n_head={m.n_head} is not divisible by tp={sizes['tp']}")
    names, data_ways = batch_ways(sizes)
    micro = t.global_batch_size // t.microbatches
    if micro % data_ways:
        raise UserError(
            f"batch per microbatch {micro} (train.global_batch_size={t.global_batch_size} / "
            f"train.microbatches={t.microbatches}) is not divisible by the data axes {names}={data_ways}"
        )
    check_diloco(cfg, sizes)
    check_experts(cfg, sizes)
    if m.attention == "dilated":  # its own exchange over sp, in natural token order (models/dilated.py)
        check_sequence(cfg.data.seq_len, m.n_head, sizes, "all_gather", zigzag=False)
    else:
        check_sequence(cfg.data.seq_len, m.n_head, sizes, p.sequence_attention, p.sequence_zigzag)
        if sizes["sp"] > 1:
            check_window(m.sliding_window, p.sequence_attention, m.attention_sinks)
    check_pipeline(cfg, sizes)
    check_window_cycle(cfg, sizes)
    check_compression(cfg, sizes)


def check_window_cycle(cfg: Config, sizes) -> None:
    """model.full_attention_every=N: each layer stack, and each pipeline chunk of one, is whole cycles of N layers.

    jaxpar's layer runner steps through a cycle at a time (jaxpar/models/decoder.py _run_stack), so every stack and
    every stage's share of one must start a cycle; torchpar's layers carry their windows themselves.
    """
    m, N = cfg.model, cfg.model.full_attention_every
    if not N or not m.sliding_window:
        return
    first = m.moe_first_dense if m.moe_experts else 0
    schedule, pp = concrete(cfg.parallel.pipeline_schedule), sizes["pp"]
    # (layers, the pipeline chunks they split into): the executor runs the dense stack whole, gpipe splits it too
    stacks = {
        "dense first layers (model.moe_first_dense)": (first, pp if schedule == "gpipe" else 1),
        "layers": (m.n_layer - first, pp * chunks(schedule, cfg.parallel.pipeline_virtual_stages) if pp > 1 else 1),
    }
    for what, (n, parts) in stacks.items():
        if n % (parts * N):
            share = f"{n} {what} in {parts} pipeline chunks" if parts > 1 else f"{n} {what}"
            raise UserError(
                f"model.full_attention_every={N}: jaxpar runs the layers in cycles of {N}, and {share} are not whole "
                f"cycles (make each a multiple of {N})"
            )


def check_experts(cfg: Config, sizes) -> None:
    """The ep axis needs a mixture of experts whose experts it divides (core/model/experts.py).

    What jaxpar's experts do not run beside.
    """
    check_expert_axis(cfg.model, sizes["ep"])
    E, first, pp = cfg.model.moe_experts, cfg.model.moe_first_dense, sizes["pp"]
    # gpipe splits each stack over the stages; the hand-scheduled executor runs the dense stack whole on its first
    # stage and splits the expert stack alone (check_pipeline's check_schedule)
    gpipe = concrete(cfg.parallel.pipeline_schedule) == "gpipe"
    if E and first and gpipe and (first % pp or cfg.model.moe_layers % pp):
        raise UserError(
            f"model.moe_first_dense={first}: the gpipe schedule splits the dense first layers and the "
            f"{cfg.model.moe_layers} expert layers after them over the pipeline, each stack: pp={pp} must divide "
            "both (the hand-scheduled schedules, e.g. parallel.pipeline_schedule=1f1b, run the dense layers whole "
            "on the first stage)"
        )
    if E and cfg.model.moe_ragged and sizes["ep"] > 1:
        raise UserError(
            f"model.moe_ragged with ep={sizes['ep']}: jaxpar's ragged exchange of the filled rows over ep is not "
            "built yet (ep=1 runs it; torchpar runs it over ep)"
        )
    zigzag = sizes["sp"] > 1 and cfg.parallel.sequence_zigzag and cfg.model.attention != "dilated"
    if E and cfg.model.moe_capacity_factor and zigzag and cfg.data.document_mask:
        raise UserError(
            "model.moe_capacity_factor with data.document_mask under zig-zag sequence parallelism: the "
            "capacity's token order is not built for that combination (parallel.sequence_zigzag=false "
            "runs it)"
        )
    if E and cfg.parallel.grad_compression != "none":
        raise UserError(
            f"parallel.grad_compression={cfg.parallel.grad_compression} with a mixture of experts is "
            "not built yet in jaxpar (its reduction runs outside the experts' exchange)"
        )


def check_compression(cfg: Config, sizes) -> None:
    """parallel.grad_compression: what jaxpar runs (over dp/fsdp, tp and pp beside them), else one line."""
    method = cfg.parallel.grad_compression
    if method != "none" and sizes["sp"] > 1:
        raise UserError(
            f"parallel.grad_compression={method} runs on dp, fsdp, tp and pp meshes in jaxpar (sp "
            "with it is not built yet)"
        )
    sharded = sizes["fsdp"] > 1 or (cfg.parallel.zero_stage == 3 and sizes["dp"] > 1)
    schedule = concrete(cfg.parallel.pipeline_schedule)
    if method != "none" and sizes["pp"] > 1 and schedule != "gpipe" and sharded:
        # the executor pins its gradients to the parameters' layout, which names the data axes that are manual
        # in compression's shard_map (jaxpar/pipeline/gradients.py hand_scheduled): jax refuses that constraint
        raise UserError(
            f"parallel.grad_compression={method} with parallel.pipeline_schedule={schedule} does not run "
            "parameters sharded over fsdp or ZeRO-3 yet (gpipe runs it)"
        )
    if method == "powersgd" and cfg.model.compute_dtype == "float16":
        raise UserError(
            "parallel.grad_compression=powersgd with model.compute_dtype=float16: an overflowing step's "
            "inf would stay in PowerSGD's error feedback and poison every later step; use bfloat16"
        )


def check_pipeline(cfg: Config, sizes) -> None:
    """One-line errors for layouts the pipeline cannot run."""
    stages = sizes["pp"]
    if stages == 1:
        return
    p, t = cfg.parallel, cfg.train
    schedule = concrete(p.pipeline_schedule)  # auto unresolved: what the layout runs
    M = resolve_microbatches(stages, p.pipeline_microbatches)
    # the stack the stages split: model.moe_first_dense's dense layers run whole on the executor's first stage
    # (gpipe splits them too: check_experts)
    check_schedule(
        schedule,
        stages,
        M,
        p.pipeline_virtual_stages,
        cfg.model.n_layer - (cfg.model.moe_first_dense if cfg.model.moe_experts else 0),
    )
    names, data_ways = batch_ways(sizes)
    batch = t.global_batch_size // t.microbatches
    if batch % (M * data_ways):
        raise UserError(
            f"batch per microbatch {batch} is not divisible by parallel.pipeline_microbatches={M} "
            f"x data axes {names}={data_ways}"
        )
    if cfg.model.float8 and schedule in ("zb_h1", "zb_v", "dualpipev"):
        raise UserError(
            f"parallel.pipeline_schedule={schedule} does not run model.float8 yet (its split "
            "backward computes each projection's weight gradient itself, in the compute dtype; gpipe, 1f1b "
            "and interleaved run it)"
        )
    if cfg.model.remat == "offload" and schedule != "gpipe":
        # the executor keeps each microbatch's residuals in device buffers it writes slot by slot in a tick's
        # branch; residuals in host memory would need host buffers there, which it does not have
        raise UserError(
            f"parallel.pipeline_schedule={schedule} does not run model.remat=offload (it runs "
            "with the gpipe schedule; or model.remat=full)"
        )
    sharded_params = sizes["fsdp"] > 1 or (p.zero_stage == 3 and sizes["dp"] > 1)
    what = (
        "model.linear=sketched"
        if cfg.model.linear == "sketched"
        else "model.attention=mla"
        if cfg.model.attention == "mla"
        else None
    )
    if what and schedule != "gpipe" and sizes["tp"] > 1 and sharded_params:
        # XLA reshards a sketched factor or MLA's latent projections between the data and tp axes with a
        # collective-permute inside one tick's branch of the executor, which the devices taking another branch
        # never reach: a deadlock (docs/fuzz.md)
        raise UserError(
            f"parallel.pipeline_schedule={schedule} does not run {what} with tp>1 and "
            "parameters sharded over fsdp or ZeRO-3 (it runs with the gpipe schedule)"
        )
