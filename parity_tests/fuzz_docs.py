"""What the docs say of the fuzzer's cases (parity_tests/fuzz_cases.py).

PROMISES and DOCUMENTED_REFUSALS are the docs' own words, kept as a small table; a refusal that no DOCUMENTED_REFUSALS
line explains is a failure of the case (the docs promise it works).
"""

from __future__ import annotations

from parity_tests.fuzz_cases import BASE, Case

# Each claim of the docs that a drawn setting works; a refused case whose every setting some claim covers,
# and that no DOCUMENTED_REFUSALS line explains, is a failure (`refused-promised`).
PROMISES = (
    (
        "jaxpar mesh",
        lambda c: c.side == "jax",
        "docs/features.md 'Parallelism' (dp/fsdp/tp/pp/sp); docs/architecture.md 'Numerical equivalence': "
        "every supported mesh "
        "reproduces the one-device run; docs/torchpar.md: jaxpar composes pp with dp/fsdp/tp/sp",
    ),
    (
        "DiLoCo",
        lambda c: c.mesh()["diloco"] > 1,
        "docs/diloco.md: dp, fsdp, tp, pp (every schedule), ep and sp inside DiLoCo's groups, equal to the groups "
        "alone; torchpar's groups of ranks on ddp and fsdp equal jaxpar's",
    ),
    (
        "ZeRO stages",
        lambda c: "parallel.zero_stage" in dict(c.settings),
        "docs/features.md 'ZeRO vocabulary' (jaxpar 0-3 on dp); docs/torchpar.md fsdp and deepspeed bullets (0-3)",
    ),
    (
        "pipeline schedules",
        lambda c: c.mesh()["pp"] > 1,
        "docs/features.md 'Pipeline' and docs/architecture.md 'Pipeline parallelism' (gpipe, 1f1b, "
        "interleaved, zb_h1, zb_v, "
        "virtual stages); docs/torchpar.md pipeline bullet (one stage per rank, interleaved >= 2, zb_v two, "
        "pp x dp with "
        "1f1b)",
    ),
    (
        "sequence attention",
        lambda c: c.mesh()["sp"] > 1,
        "docs/features.md 'Sequence parallelism' (ring, all_gather, ulysses, zig-zag); docs/architecture.md 'Sequence "
        "parallelism (sp)'",
    ),
    (
        "model variants and families",
        lambda c: any(k in ("model.attention", "model.linear", "model.family") for k, _ in c.settings),
        "docs/architecture.md 'Model variants': any combination, jaxpar and torchpar alike, under every layout; "
        "docs/features.md 'Llama': every mesh and torchpar backend; 'Model families': llama with attention=dilated",
    ),
    (
        "sliding-window attention",
        lambda c: "model.sliding_window" in dict(c.settings),
        "docs/architecture.md 'Sliding-window attention': every family, mha and mla, every mesh (sp with all_gather "
        "or ulysses), pipeline schedule and torchpar backend",
    ),
    (
        "Qwen3's attention",
        lambda c: any(
            k
            in (
                "model.qk_norm",
                "model.head_dim",
                "model.rope_scaling",
                "model.attention_bias",
                "model.attention_sinks",
            )
            for k, _ in c.settings
        ),
        "docs/architecture.md 'Model families' (Qwen3: model.qk_norm, model.head_dim and YaRN's model.rope_scaling; "
        "gpt-oss's model.attention_bias and model.attention_sinks: every mesh, pipeline schedule and torchpar backend)",
    ),
    (
        "remat, accumulation, unrolled layers",
        lambda c: any(k in ("model.remat", "train.microbatches", "train.scan_layers") for k, _ in c.settings),
        "docs/features.md 'Model' (model.remat none/full/save_matmuls; train.scan_layers) and 'Optimiser' "
        "(train.microbatches); "
        "docs/torchpar.md 'Same math as jaxpar'",
    ),
    (
        "offload",
        lambda c: "parallel.offload" in dict(c.settings),
        "docs/features.md 'Offload'; docs/architecture.md 'Mixed precision and offload' (jaxpar: host memory kinds; "
        "deepspeed: optimizer at stages 1-3, params+optimizer at stage 3)",
    ),
    (
        "gradient compression",
        lambda c: "parallel.grad_compression" in dict(c.settings),
        "docs/torchpar.md 'Gradient compression' (ddp bf16 and powersgd, fsdp and deepspeed bf16; jaxpar both on dp, "
        "fsdp and tp meshes)",
    ),
    (
        "mixture of experts",
        lambda c: "model.moe_experts" in dict(c.settings),
        "docs/architecture.md 'Mixture of experts': ep composes with dp, fsdp, tp, sp and the pipeline schedules; "
        "torchpar runs it on "
        "none/ddp/fsdp/deepspeed/pipeline, split over ep under ddp (docs/torchpar.md ddp and pipeline bullets)",
    ),
    (
        "multi-token prediction",
        lambda c: "model.mtp_depth" in dict(c.settings),
        "docs/architecture.md 'Multi-token prediction': every layout, every schedule of a jaxpar pipeline, "
        "torchpar none/ddp/fsdp/deepspeed, and pipeline with gpipe, 1f1b or interleaved (pp x dp too, not pp x fsdp)",
    ),
    (
        "batching",
        lambda c: any(k in ("data.document_mask", "data.batching", "train.batch_rampup") for k, _ in c.settings),
        "docs/features.md 'Data' (data.document_mask), 'Variable-length batches' (data.batching=buckets) and "
        "'Optimiser' "
        "(train.batch_rampup): both trainers, every layout but torchpar's pipeline",
    ),
    (
        "torchpar backends",
        lambda c: c.side == "torch",
        "docs/torchpar.md 'Backends': none, ddp, fsdp (HSDP with parallel.mesh=dp=D,fsdp=F), deepspeed, pipeline",
    ),
)


# a case without parallel.pipeline_schedule runs auto (the default), which falls back to gpipe where the settings
# refuse the hand-scheduled executor: what gpipe runs, auto runs
GPIPE_RUNS = ("gpipe", "auto")


def _pipeline_resharded(c: Case) -> bool:
    m = c.mesh()
    return (
        c.side == "jax"
        and m["pp"] > 1
        and c.get("parallel.pipeline_schedule", "auto") not in GPIPE_RUNS
        and (c.get("model.linear") == "sketched" or c.get("model.attention") == "mla")
        and m["tp"] > 1
        and (m["fsdp"] > 1 or (m["dp"] > 1 and c.get("parallel.zero_stage") == "3"))
    )


def invalid_config(c: Case) -> bool:
    from jaxpar.core.config.schema import load_config
    from jaxpar.core.errors import UserError

    try:
        load_config(None, [*BASE, *c.overrides])
    except UserError:
        return True
    return False


def indivisible(c: Case) -> bool:
    """Sizes the layout does not divide.

    Heads by tp (x sp for Ulysses), the batch per microbatch by the data ways (x pipeline microbatches), the
    sequence by sp (2 sp with zig-zag), layers by stages x virtual stages, pipeline microbatches by the schedule's
    rules.
    """
    g = lambda key, default: int(c.get(key, default))
    m, micro, heads = c.mesh(), g("train.global_batch_size", 8) // g("train.microbatches", 1), g("model.n_head", 4)
    jax_ways = m["diloco"] * m["dp"] * m["fsdp"] * m["ep"]
    ways = (
        jax_ways if c.side == "jax" else m["dp"] * m["fsdp"] * m["ep"] if c.backend == "pipeline" else max(c.world, 1)
    )
    bad = heads % m["tp"] or micro % ways
    if m["sp"] > 1:
        zigzag = c.get("parallel.sequence_zigzag", "true") == "true"
        bad = (
            bad
            or g("data.seq_len", 16) % (m["sp"] * (2 if zigzag else 1))
            or (c.get("parallel.sequence_attention") == "ulysses" and heads % (m["tp"] * m["sp"]))
        )
    if m["pp"] > 1:
        S, V, schedule = m["pp"], g("parallel.pipeline_virtual_stages", 1), c.get("parallel.pipeline_schedule", "auto")
        V = 2 if schedule in ("zb_v", "dualpipev") else 1 if schedule == "auto" else V  # auto: refused as gpipe (V 1)
        M = g("parallel.pipeline_microbatches", 0) or 2 * S
        bad = (
            bad
            or g("model.n_layer", 2) % (S * V)
            or micro % (M * ways)
            or (schedule not in GPIPE_RUNS and M < S)
            or (schedule == "dualpipev" and M < 2 * S)
            or (schedule == "interleaved" and M % S)
        )
    return bool(bad)


def fragments_misfit(c: Case) -> bool:
    """Streaming DiLoCo's fragments (parallel.diloco_fragments) do not divide a layer stack's layers."""
    F = int(c.get("parallel.diloco_fragments", "1"))
    n, mtp = int(c.get("model.n_layer", "2")), int(c.get("model.mtp_depth", "0"))
    first = int(c.get("model.moe_first_dense", "0")) if c.get("model.moe_experts", "0") != "0" else 0
    return c.mesh()["diloco"] > 1 and any(k % F for k in (first, n - first, mtp))


# (where the docs say it, predicate): combinations the docs say are refused with one line
DOCUMENTED_REFUSALS = (
    ("docs/diloco.md 'What a step does': F must divide every stack's number of layers", fragments_misfit),
    (
        "docs/diloco.md 'Not yet': PowerSGD, offload and float16 inside DiLoCo's groups",
        lambda c: (
            c.mesh()["diloco"] > 1
            and (c.get("parallel.offload", "none") != "none" or c.get("parallel.grad_compression") == "powersgd")
        ),
    ),
    (
        "docs/features.md 'Config' (unknown keys, types, ranges are errors); docs/architecture.md 'Model "
        "families' (keys of "
        "the other family, llama with mla or sketched)",
        invalid_config,
    ),
    (
        "docs/architecture.md 'Sharding' (divisibility the user controls is checked up front with one line), "
        "'Sequence parallelism' (its checks); docs/torchpar.md (a world size that does not divide the batch per "
        "microbatch); the pipeline's sizes (jaxpar/core/pipeline/schedules.py)",
        indivisible,
    ),
    (
        "docs/architecture.md 'Pipeline parallelism': model.linear=sketched or model.attention=mla in the executor "
        "with tp>1 and parameters sharded over fsdp or ZeRO-3",
        _pipeline_resharded,
    ),
    (
        "docs/torchpar.md pipeline: zb_h1, zb_v and dualpipev with model.remat=save_matmuls (torch's selective "
        "checkpoint "
        "allows "
        "one backward per region)",
        lambda c: (
            c.side == "torch"
            and c.backend == "pipeline"
            and c.get("parallel.pipeline_schedule") in ("zb_h1", "zb_v", "dualpipev")
            and c.get("model.remat") == "save_matmuls"
        ),
    ),
    (
        "docs/architecture.md 'Sliding-window attention' and 'Model families' (gpt-oss's attention): ring attention "
        "with a window or attention sinks is refused (all_gather and ulysses run them)",
        lambda c: (
            c.side == "jax"
            and c.mesh()["sp"] > 1
            and ("model.sliding_window" in dict(c.settings) or "model.attention_sinks" in dict(c.settings))
            and c.get("parallel.sequence_attention", "ring") == "ring"
        ),
    ),
    (
        "docs/torchpar.md ddp: parallel.zero_stage must be 0",
        lambda c: c.side == "torch" and c.backend == "ddp" and c.get("parallel.zero_stage", "0") != "0",
    ),
    (
        "docs/torchpar.md fsdp: CPUOffloadPolicy is GPU only; optimizer alone is refused",
        lambda c: c.side == "torch" and c.backend == "fsdp" and c.get("parallel.offload", "none") != "none",
    ),
    (
        "docs/architecture.md offload / docs/torchpar.md deepspeed: optimizer offload needs stages 1-3, "
        "params+optimizer stage 3",
        lambda c: (
            c.side == "torch"
            and c.backend == "deepspeed"
            and (
                (c.get("parallel.offload", "none") != "none" and c.get("parallel.zero_stage", "0") == "0")
                or (c.get("parallel.offload") == "params+optimizer" and c.get("parallel.zero_stage") != "3")
            )
        ),
    ),
    (
        "docs/torchpar.md pipeline: interleaved needs parallel.pipeline_virtual_stages >= 2",
        lambda c: (
            c.side == "torch"
            and c.backend == "pipeline"
            and c.get("parallel.pipeline_schedule") == "interleaved"
            and int(c.get("parallel.pipeline_virtual_stages", "1")) < 2
        ),
    ),
    (
        "docs/torchpar.md pipeline: pp x dp (parallel.mesh=pp=S,dp=D) runs the 1f1b schedule only",
        lambda c: (
            c.side == "torch"
            and c.backend == "pipeline"
            and c.mesh()["dp"] > 1
            and c.get("parallel.pipeline_schedule", "auto") not in ("1f1b", "auto")
        ),
    ),  # auto: 1f1b
    (
        "docs/torchpar.md pipeline: pp x fsdp (parallel.mesh=pp=S,fsdp=F) runs gpipe and 1f1b",
        lambda c: (
            c.side == "torch"
            and c.backend == "pipeline"
            and c.mesh()["fsdp"] > 1
            and c.get("parallel.pipeline_schedule", "auto") not in ("gpipe", "1f1b", "auto")
        ),
    ),
    (
        "docs/torchpar.md 'Gradient compression': jaxpar compresses on dp, fsdp, tp and pp meshes (sp: refused; "
        "the hand-scheduled schedules with fsdp or ZeRO-3: refused); PowerSGD runs on ddp only",
        lambda c: (
            c.get("parallel.grad_compression", "none") != "none"
            and (
                (c.side == "jax" and c.mesh()["sp"] > 1)
                or (
                    c.side == "jax"
                    and c.mesh()["pp"] > 1
                    and c.get("parallel.pipeline_schedule", "auto") not in ("gpipe", "auto")
                    and (c.mesh()["fsdp"] > 1 or c.mesh()["dp"] > 1 and c.get("parallel.zero_stage") == "3")
                )
                or (c.get("parallel.grad_compression") == "powersgd" and c.side == "torch" and c.backend != "ddp")
            )
        ),
    ),
    (
        "docs/torchpar.md: offload needs --backend fsdp or deepspeed",
        lambda c: (
            c.side == "torch" and c.backend not in ("fsdp", "deepspeed") and "parallel.offload" in dict(c.settings)
        ),
    ),
)


def documented_refusal(case: Case) -> str | None:
    return next((doc for doc, applies in DOCUMENTED_REFUSALS if applies(case)), None)


def promises(case: Case) -> list[str]:
    return [f"{name}: {doc}" for name, applies, doc in PROMISES if applies(case)]
