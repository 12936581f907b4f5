"""Who consumes each config key: the contract beside the schema (jaxpar/core/config/schema.py).

Every key of the schema has one row: the trainers and torchpar backends that act on it, the mode in which
they do (e.g. `model.q_latent_dim` only under `model.attention=mla`), and how its effect shows (what
tests/core/test_contract.py measures). `check_contract` refuses, in one line, any key set away from its
default that the run at hand will not consume: a setting is acted on or refused, never silently dropped.
A key added to the schema without a row here fails that test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from jaxpar.core.config.schema import Config
from jaxpar.core.errors import UserError
from jaxpar.core.config.mesh_spec import TORCH_BACKENDS
from jaxpar.core.config.modes import (  # noqa: F401 - Run: the contract's callers import it from here
    BLOCK_SPARSE,
    DEEPSPEED_ADAMW,
    DILATED,
    DILOCO,
    FLOAT16,
    GQA,
    LLAMA,
    MLA,
    MOE,
    MUON,
    NOT_DEEPSPEED,
    NOT_PIPELINE,
    NO_BIAS_UPDATE,
    NO_TORCH_SP,
    ONE_SHAPE,
    OUTER,
    PIPELINE,
    ROTARY,
    Run,
    SKETCHED,
    TORCHFT,
    _always,
    _buckets,
    _data_parallel,
    _dense_width,
    _documents,
    _llama_or_mla,
    _model,
    _powersgd,
    _stages,
    _virtual,
    _whole_model,
    _zero,
    _zigzag,
)

BACKENDS = TORCH_BACKENDS  # torchpar's (torchpar/backends)
BOTH = BACKENDS
# How a consumed key shows in a run; tests/core/test_contract.py has one probe for each:
#   params  the initial parameters (shapes or values)      step  the traced train step (and its shardings)
#   data    the batches read                               loop  the shared loop's calls (log, eval, save, ...)
#   engine  torchpar's engine settings (DeepSpeed JSON, schedule, compile, precision)
#   test    a named test shows it (files, processes, console): `evidence` holds "tests/<file>.py::<test>"
EFFECTS = ("params", "step", "data", "loop", "engine", "test")


@dataclass(frozen=True)
class Owner:
    jaxpar: bool  # jaxpar.train consumes it
    torchpar: tuple[str, ...]  # the torchpar backends that consume it
    effect: str  # one of EFFECTS
    when: Callable[[Run], bool] = _always
    mode: str = ""  # `when` in the user's words (for the refusal line)
    example: tuple[str, ...] = ()  # overrides (and "mesh:..." entries) under which `when` holds
    evidence: str = ""  # effect "test": the test that shows the effect
    why_not: str = ""  # appended to a refusal: where the setting does apply


CONTRACT: dict[str, Owner] = {
    # model: both trainers build the same model from these keys
    "model.family": Owner(True, BOTH, "params"),
    "model.vocab_size": Owner(True, BOTH, "params"),
    "model.n_layer": Owner(True, BOTH, "params"),
    "model.n_head": Owner(True, BOTH, "step"),
    "model.d_model": Owner(True, BOTH, "params"),
    "model.n_kv_head": Owner(True, BOTH, "params", **LLAMA),
    "model.d_ff": Owner(
        True,
        BOTH,
        "params",
        when=_dense_width,
        mode="a dense MLP, dense first layers "
        "(model.moe_first_dense), multi-token prediction (model.mtp_depth), or experts with "
        "model.moe_d_ff=0 (which then take the MLP's width)",
    ),
    "model.ffn_multiple_of": Owner(
        True,
        BOTH,
        "params",
        when=lambda r: r.cfg.model.family == "llama" and not r.cfg.model.d_ff and _dense_width(r),
        mode="model.family=llama with model.d_ff=0 (and experts without model.moe_d_ff)",
        example=("model.family=llama",),
    ),
    "model.tie_embeddings": Owner(True, BOTH, "params", **LLAMA),
    "model.max_seq_len": Owner(True, BOTH, "params"),
    "model.layernorm_eps": Owner(True, BOTH, "step"),
    "model.init_std": Owner(True, BOTH, "params"),
    "model.compute_dtype": Owner(True, BOTH, "step"),
    "model.remat": Owner(True, BOTH, "step"),
    "model.loss_chunks": Owner(True, BOTH, "step"),
    "model.float32_logits": Owner(
        True,
        (),
        "step",
        when=lambda r: r.cfg.model.compute_dtype != "float32",
        mode="model.compute_dtype=bfloat16 or float16 (float32 logits are the product itself then)",
        example=("model.compute_dtype=bfloat16",),
        why_not="torch's float32-output matmul (torch.mm's out_dtype) runs on CUDA only; jaxpar.train runs it",
    ),
    "model.float8": Owner(
        True,
        ("none", "ddp", "fsdp"),
        "step",
        why_not="torchpar runs it on --backend none, ddp "
        "and fsdp (torchao's float8 on the projections, each scale taken over the whole batch of "
        "the group); a pipeline stage would need a group of its own for that, and DeepSpeed's "
        "engine is not tested with it: not written (jaxpar.train runs it on every layout but "
        "the split-backward schedules)",
    ),
    "model.init_from": Owner(
        True,
        BOTH,
        "test",
        evidence=("tests/e2e/test_train_cli.py::test_write_init_then_init_from_starts_from_those_weights"),
    ),
    "model.attention": Owner(True, BOTH, "params"),
    "model.linear": Owner(True, BOTH, "params"),
    "model.q_latent_dim": Owner(True, BOTH, "params", **MLA),
    "model.kv_latent_dim": Owner(True, BOTH, "params", **MLA),
    "model.rope_head_dim": Owner(True, BOTH, "params", **MLA),
    "model.rope_theta": Owner(
        True,
        BOTH,
        "step",
        when=_llama_or_mla,
        mode="model.family=llama or model.attention=mla (rotary positions; GPT-2 learns its positions)",
        example=("model.family=llama",),
    ),
    "model.head_dim": Owner(True, BOTH, "params", **GQA),
    "model.rope_scaling": Owner(True, BOTH, "step", **ROTARY),
    **{
        f"model.rope_{k}": Owner(
            True,
            BOTH,
            "step",
            when=lambda r: ROTARY["when"](r) and r.cfg.model.rope_scaling == "yarn",
            mode="model.rope_scaling=yarn (model.family=llama, or model.attention=mla)",
            example=("model.family=llama", "model.rope_scaling=yarn", "model.rope_factor=4"),
        )
        for k in ("factor", "original_max_seq_len", "beta_fast", "beta_slow", "truncate", "attention_factor")
    },
    "model.rope_mscale_all_dim": Owner(
        True,
        BOTH,
        "step",
        when=lambda r: r.cfg.model.attention == "mla" and r.cfg.model.rope_scaling == "yarn",
        mode="model.rope_scaling=yarn with model.attention=mla (DeepSeek-V3's)",
        example=(
            "model.attention=mla",
            "model.q_latent_dim=16",
            "model.kv_latent_dim=8",
            "model.rope_head_dim=4",
            "model.rope_scaling=yarn",
            "model.rope_factor=4",
        ),
    ),
    "model.sliding_window": Owner(
        True,
        BOTH,
        "step",
        when=lambda r: r.cfg.model.attention != "dilated",
        mode="model.attention=mha or mla (dilated attention has its own pattern)",
    ),
    "model.full_attention_every": Owner(
        True,
        BOTH,
        "step",
        when=lambda r: r.cfg.model.sliding_window > 0 and r.cfg.model.attention != "dilated",
        mode="model.sliding_window > 0 (the layers that do not slide)",
        example=("model.sliding_window=4",),
    ),
    "model.qk_norm": Owner(True, BOTH, "params", **GQA),
    "model.attention_bias": Owner(True, BOTH, "params", **GQA),
    "model.attention_sinks": Owner(
        True,
        BOTH,
        "params",
        when=lambda r: r.cfg.model.family == "llama" and r.cfg.model.attention == "mha",
        mode="model.family=llama with model.attention=mha",
        example=("model.family=llama",),
    ),
    "model.segment_lengths": Owner(True, BOTH, "step", **DILATED),
    "model.dilation_rates": Owner(True, BOTH, "step", **DILATED),
    "model.sparsity_ratio": Owner(
        True,
        BOTH,
        "step",
        when=DILATED["when"],
        mode=DILATED["mode"],
        example=DILATED["example"] + ("model.sparsity_block=2",),
    ),
    "model.sparsity_block": Owner(True, BOTH, "step", **BLOCK_SPARSE),
    "model.sparsity_seed": Owner(True, BOTH, "step", **BLOCK_SPARSE),
    "model.sketch": Owner(True, BOTH, "step", **SKETCHED),
    "model.sketch_ratio": Owner(True, BOTH, "params", **SKETCHED),
    "model.sketch_seed": Owner(True, BOTH, "step", **SKETCHED),
    "model.moe_experts": Owner(True, BOTH, "params"),
    **{f"model.moe_{k}": Owner(True, BOTH, "params", **MOE) for k in ("shared_experts", "d_ff", "first_dense")},
    **{
        f"model.moe_{k}": Owner(True, BOTH, "step", **MOE)
        for k in ("top_k", "router", "norm_topk", "aux_loss", "capacity_factor", "n_group", "routed_scale")
    },
    "model.moe_topk_group": Owner(
        True,
        BOTH,
        "step",
        when=lambda r: r.cfg.model.moe_experts > 0 and r.cfg.model.moe_n_group > 1,
        mode="model.moe_experts>0 and model.moe_n_group>1",
        example=("model.moe_experts=8", "model.moe_n_group=4"),
    ),
    "model.moe_activation": Owner(True, BOTH, "step", **MOE),
    # the same numbers by other kernels (torchpar's grouped matmuls equal its loop bit for bit): the test shows the
    # kernels each framework runs
    "model.moe_ragged": Owner(
        True,
        BOTH,
        "test",
        evidence="tests/jaxpar/test_ragged_experts.py::test_the_setting_chooses_each_frameworks_kernels",
        **MOE,
    ),
    "model.moe_expert_bias": Owner(True, BOTH, "params", **MOE),
    **{
        f"model.moe_swiglu_{k}": Owner(
            True,
            BOTH,
            "step",
            when=lambda r: r.cfg.model.moe_experts > 0 and r.cfg.model.moe_activation == "gpt_oss",
            mode="model.moe_activation=gpt_oss (with model.moe_experts>0)",
            example=("model.moe_experts=4", "model.moe_activation=gpt_oss"),
        )
        for k in ("limit", "alpha")
    },
    "model.moe_bias_update": Owner(True, ("none", "ddp", "pipeline"), "params", **MOE, why_not=NO_BIAS_UPDATE),
    "model.moe_router_bias": Owner(True, ("none", "ddp", "pipeline"), "params", **MOE, why_not=NO_BIAS_UPDATE),
    # the pipeline: its last stage's loss function runs the modules (torchpar/backends/pipeline.py)
    "model.mtp_depth": Owner(True, BOTH, "params"),
    "model.mtp_loss_weight": Owner(
        True,
        BOTH,
        "step",
        when=lambda r: r.cfg.model.mtp_depth > 0,
        mode="model.mtp_depth>0",
        example=("model.mtp_depth=1",),
    ),
    # data: one order for both (jaxpar/core/data/order.py)
    "data.dataset": Owner(True, BOTH, "data"),
    "data.tokenizer": Owner(
        True,
        BOTH,
        "test",
        evidence=("tests/e2e/test_train_cli.py::test_trains_on_a_bpe_corpus_and_refuses_another_tokenizer_on_resume"),
    ),
    "data.seq_len": Owner(True, BOTH, "data"),
    "data.val_fraction": Owner(True, BOTH, "data"),
    "data.cache_dir": Owner(
        True,
        BOTH,
        "test",
        when=lambda r: r.cfg.data.dataset == "stdlib",
        mode="data.dataset=stdlib (where the prepared standard library is kept)",
        evidence=("tests/core/test_data.py::test_stdlib_prepared_once_and_reused"),
    ),
    "data.document_mask": Owner(
        True,
        ("none", "ddp", "fsdp", "deepspeed"),
        "step",
        when=_documents,
        mode="an attention other than dilated, and on a jaxpar pipeline a hand-scheduled "
        "parallel.pipeline_schedule (1f1b, interleaved, zb_h1, zb_v, dualpipev; "
        "not gpipe)",
        why_not="torch.distributed.pipelining passes activations alone between stages "
        "(use --backend none, ddp, fsdp or deepspeed)",
    ),
    "data.batching": Owner(True, NOT_PIPELINE, "data", why_not=ONE_SHAPE),
    "data.buckets": Owner(
        True,
        NOT_PIPELINE,
        "data",
        when=_buckets,
        mode="data.batching=buckets",
        example=("data.batching=buckets",),
        why_not=ONE_SHAPE,
    ),
    # train
    "train.steps": Owner(True, BOTH, "loop"),
    "train.global_batch_size": Owner(True, BOTH, "data"),
    "train.batch_rampup": Owner(True, NOT_PIPELINE, "data", why_not=ONE_SHAPE),
    "train.tokens_per_batch": Owner(
        True,
        NOT_PIPELINE,
        "data",
        when=_buckets,
        mode="data.batching=buckets",
        example=("data.batching=buckets",),
        why_not=ONE_SHAPE,
    ),
    "train.microbatches": Owner(True, BOTH, "step"),
    "train.seed": Owner(True, BOTH, "params"),
    "train.log_every": Owner(True, BOTH, "loop"),
    "train.eval_every": Owner(True, BOTH, "loop"),
    "train.eval_batches": Owner(True, BOTH, "loop"),
    "train.sample_every": Owner(
        True,
        ("none", "ddp"),
        "loop",
        why_not="it needs the whole model on rank 0: --backend none or ddp (sample from a "
        "checkpoint with python -m torchpar.generate)",
    ),
    **{
        key: Owner(
            True,
            ("none", "ddp"),
            "test",
            when=_whole_model,
            mode="a mesh without pp, sp or ep (the evaluator holds the model on dp / fsdp / tp)",
            evidence="tests/e2e/test_eval_tasks.py::test_train_eval_tasks_score_at_the_requested_steps",
            why_not="the evaluator needs the whole model on each rank: --backend none or ddp (evaluate a "
            "checkpoint with python -m torchpar.eval)",
        )
        for key in ("train.eval_tasks", "train.eval_tasks_every", "train.eval_tasks_limit", "train.eval_tasks_fewshot")
    },
    "train.matmul_precision": Owner(True, BOTH, "step"),
    "train.compile": Owner(
        False,
        ("none", "ddp", "fsdp", "pipeline"),
        "engine",
        why_not="it switches torchpar's torch.compile (jaxpar's step is always compiled by XLA; "
        "deepspeed's engine wraps the model and its ZeRO hooks: leave train.compile=auto)",
    ),
    "train.profile_steps": Owner(True, BOTH, "loop"),
    "train.straggler_threshold": Owner(
        True, BOTH, "test", evidence="tests/e2e/test_stragglers.py::test_the_threshold_decides_who_is_named"
    ),
    "train.scan_layers": Owner(
        True,
        (),
        "step",
        why_not="it is jaxpar's layer scan (torchpar's layers are separate modules, run one after another)",
    ),
    # optim: optax and torch.optim with one schedule (jaxpar/core/optimizer/lr_schedule.py)
    **{
        f"optim.{k}": Owner(True, BOTH, "step")
        for k in ("lr", "min_lr", "warmup_steps", "decay_steps", "beta1", "beta2", "eps", "weight_decay", "grad_clip")
    },
    "optim.name": Owner(True, NOT_DEEPSPEED, "step", why_not=DEEPSPEED_ADAMW),
    "optim.fused": Owner(
        False,
        NOT_DEEPSPEED,
        "step",
        when=lambda r: r.cfg.optim.name == "adamw",
        mode="optim.name=adamw",
        why_not="jaxpar's optimizer update is compiled into its step (XLA fuses it); torchpar runs it on --backend "
        "none, ddp, fsdp or pipeline (DeepSpeed builds its own AdamW)",
    ),
    **{
        f"optim.muon_{k}": Owner(True, NOT_DEEPSPEED, "step", **MUON, why_not=DEEPSPEED_ADAMW)
        for k in ("momentum", "ns_steps", "lr_rule")
    },
    **{
        f"optim.loss_scale_{k}": Owner(True, BOTH, "step", **FLOAT16)
        for k in ("init", "growth_interval", "growth_factor", "backoff_factor", "min")
    },
    # parallel
    "parallel.mesh": Owner(
        True,
        ("ddp", "fsdp", "deepspeed", "pipeline"),
        "step",
        why_not="--backend none runs one process (use ddp, fsdp, deepspeed or pipeline)",
    ),
    "parallel.zero_stage": Owner(
        True,
        ("fsdp", "deepspeed"),
        "step",
        when=_zero,
        mode="dp>1 in the mesh (jaxpar shards the stages over dp; fsdp shards everything already)",
        example=("mesh:dp=2",),
        why_not="it applies to --backend fsdp and deepspeed (ddp, none and pipeline are ZeRO-0)",
    ),
    "parallel.sequence_attention": Owner(
        True,
        (),
        "step",
        when=_zigzag,
        mode="sp>1 in the mesh and an attention other than dilated (which moves its own keys and values)",
        example=("mesh:sp=2",),
        why_not=NO_TORCH_SP,
    ),
    "parallel.sequence_zigzag": Owner(
        True,
        (),
        "step",
        when=_zigzag,
        mode="sp>1 in the mesh and an attention other than dilated (which keeps the natural order)",
        example=("mesh:sp=2",),
        why_not=NO_TORCH_SP,
    ),
    # auto (the default): both trainers choose with jaxpar/core/pipeline/choice.py before anything else reads it
    "parallel.pipeline_schedule": Owner(True, ("pipeline",), "step", **PIPELINE),
    "parallel.pipeline_microbatches": Owner(True, ("pipeline",), "step", **PIPELINE),
    "parallel.pipeline_virtual_stages": Owner(
        True,
        ("pipeline",),
        "step",
        when=_virtual,
        mode="parallel.pipeline_schedule=interleaved on a pipeline",
        example=("mesh:pp=2", "parallel.pipeline_schedule=interleaved", "model.n_layer=4"),
    ),
    "parallel.offload": Owner(
        True, ("fsdp", "deepspeed"), "step", why_not="--backend fsdp or deepspeed keep state in host memory"
    ),
    "parallel.grad_compression": Owner(
        True,
        ("ddp", "fsdp", "deepspeed"),
        "step",
        when=_data_parallel,
        mode="dp or fsdp > 1 in jaxpar's mesh (the axes whose gradients are reduced)",
        example=("mesh:dp=2",),
        why_not="it compresses the data-parallel gradient reduction: --backend ddp, "
        "fsdp or deepspeed (none has none; pipeline: not built yet)",
    ),
    **{
        f"parallel.powersgd_{k}": Owner(
            True,
            ("ddp",),
            "step",
            when=_powersgd,
            mode="parallel.grad_compression=powersgd",
            example=("parallel.grad_compression=powersgd", "mesh:dp=2"),
            why_not="PowerSGD runs on --backend ddp (torch's DDP communication hook)",
        )
        for k in ("rank", "warmup_steps")
    },
    **{
        k: Owner(True, ("ddp", "fsdp"), "test", **DILOCO)
        for k in ("parallel.diloco_inner_steps", "parallel.diloco_fragments", "parallel.diloco_delay", *OUTER)
    },
    **{k: Owner(False, ("ddp",), "test", **TORCHFT) for k in ("parallel.torchft_lighthouse", "parallel.torchft_group")},
    # checkpoint and run: the shared loop and run directory
    "checkpoint.every": Owner(True, BOTH, "loop"),
    "checkpoint.keep": Owner(
        True, BOTH, "test", evidence=("tests/core/test_contract.py::test_checkpoint_keep_is_the_number_of_steps_kept")
    ),
    "checkpoint.resume": Owner(
        True, BOTH, "test", evidence=("tests/e2e/test_train_cli.py::test_resume_false_keeps_the_old_run_apart")
    ),
    "run.dir": Owner(True, BOTH, "test", evidence=("tests/e2e/test_train_cli.py::test_resume_after_sigkill_is_exact")),
    "run.peer_timeout_s": Owner(
        True, BOTH, "test", evidence=("tests/e2e/test_multiprocess.py::test_killed_peer_is_named_within_the_timeout")
    ),
    "run.debug": Owner(
        True, BOTH, "test", evidence=("tests/e2e/test_multiprocess.py::test_killed_peer_is_named_within_the_timeout")
    ),
    "run.tensorboard": Owner(
        True, BOTH, "test", evidence=("tests/e2e/test_train_cli.py::test_tensorboard_holds_the_metrics")
    ),
    "run.wandb": Owner(True, BOTH, "test", evidence="tests/e2e/test_bad_input.py::test_bad_input_is_one_line"),
}


def set_keys(cfg: Config) -> dict[str, object]:
    """The keys set away from their defaults, with their values."""
    default = Config().to_dict()
    return {f"{s}.{k}": v for s, keys in cfg.to_dict().items() for k, v in keys.items() if default[s][k] != v}


def refusal(key: str, value, run: Run) -> str | None:
    """Why `run` will not consume `key` (set to `value`), or None if it will."""
    row = CONTRACT[key]
    setting = f"{key}={str(value).lower() if isinstance(value, bool) else value}"  # as a user writes it: true
    if run.trainer == "jaxpar" and not row.jaxpar:
        return f"{setting} is not used by jaxpar.train: {row.why_not}"
    if run.trainer == "torchpar" and run.backend not in row.torchpar:
        where = row.why_not or (
            f"it applies to --backend {', '.join(row.torchpar)}" if row.torchpar else "it is jaxpar's"
        )
        return f"{setting} is not used by torchpar --backend {run.backend}: {where}"
    if not row.when(run):
        return f"{setting} has no effect in this run: it applies with {row.mode}"
    return None


def check_contract(run: Run) -> None:
    """One line for the first key set away from its default that `run` will not consume."""
    for key, value in set_keys(run.cfg).items():
        why = refusal(key, value, run)
        if why:
            raise UserError(why)
