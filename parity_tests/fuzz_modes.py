"""The hierarchy of the layout fuzzer's cases (parity_tests/fuzz_cases.py draws them).

Which keys each mode owns, and `normalize`, which drops the keys of the modes a case (a fuzz_cases.Case) no longer runs
-- what the hierarchical draw would not have set: the shrinker's normal form.
"""

from __future__ import annotations

from parity_tests.fuzz_mtp import MODE_KEYS as MTP_MODE_KEYS

MODE_KEYS = {  # key prefix -> whether the case's run consumes it (a mode's keys go when the mode goes)
    "parallel.pipeline_": lambda c: c.mesh()["pp"] > 1 if c.side == "jax" else c.backend == "pipeline",
    "parallel.sequence_": lambda c: c.side == "jax" and c.mesh()["sp"] > 1 and c.get("model.attention") != "dilated",
    "parallel.zero_stage": lambda c: (
        c.mesh()["dp"] > 1 if c.side == "jax" else c.backend in ("ddp", "fsdp", "deepspeed")
    ),
    "parallel.offload": lambda c: c.side == "jax" or c.backend not in ("none", "pipeline"),
    "parallel.grad_compression": lambda c: (
        c.mesh()["dp"] * c.mesh()["fsdp"] > 1 if c.side == "jax" else c.backend in ("ddp", "fsdp", "deepspeed")
    ),
    "parallel.powersgd_": lambda c: c.get("parallel.grad_compression") == "powersgd",
    "parallel.mesh": lambda c: (
        c.side == "torch"
        and (
            c.backend in ("fsdp", "pipeline")
            and c.world == 4
            or c.backend == "ddp"
            and c.get("model.moe_experts", "0") != "0"
            or c.backend in ("ddp", "fsdp")
            and c.mesh()["diloco"] > 1  # DiLoCo's groups of ranks
        )
    ),
    "parallel.diloco_": lambda c: c.mesh()["diloco"] > 1,
    "model.q_latent_dim": lambda c: c.get("model.attention") == "mla",
    "model.kv_latent_dim": lambda c: c.get("model.attention") == "mla",
    "model.rope_head_dim": lambda c: c.get("model.attention") == "mla",
    "model.segment_lengths": lambda c: c.get("model.attention") == "dilated",
    "model.dilation_rates": lambda c: c.get("model.attention") == "dilated",
    "model.sparsity_": lambda c: c.get("model.attention") == "dilated",
    "model.sparsity_block": lambda c: 0 < float(c.get("model.sparsity_ratio", "0")) < 1,
    "model.sparsity_seed": lambda c: 0 < float(c.get("model.sparsity_ratio", "0")) < 1,
    "model.sketch": lambda c: c.get("model.linear") == "sketched",
    "model.n_kv_head": lambda c: c.get("model.family") == "llama",
    "model.tie_embeddings": lambda c: c.get("model.family") == "llama",
    "model.sliding_window": lambda c: c.get("model.attention") != "dilated",
    "model.full_attention_every": lambda c: (
        c.get("model.attention") != "dilated" and "model.sliding_window" in dict(c.settings)
    ),
    "model.rope_scaling": lambda c: c.get("model.family") == "llama" or c.get("model.attention") == "mla",
    "model.rope_mscale_all_dim": lambda c: c.get("model.attention") == "mla" and c.get("model.rope_scaling") == "yarn",
    "model.rope_factor": lambda c: c.get("model.rope_scaling") == "yarn",
    "model.rope_original_max_seq_len": lambda c: c.get("model.rope_scaling") == "yarn",
    "model.attention_bias": lambda c: c.get("model.family") == "llama" and c.get("model.attention") != "mla",
    "model.attention_sinks": lambda c: c.get("model.family") == "llama" and c.get("model.attention", "mha") == "mha",
    "model.qk_norm": lambda c: c.get("model.family") == "llama" and c.get("model.attention") != "mla",
    "model.head_dim": lambda c: c.get("model.family") == "llama" and c.get("model.attention") != "mla",
    "data.buckets": lambda c: c.get("data.batching") == "buckets",
    "model.moe_": lambda c: c.get("model.moe_experts", "0") != "0",
    "model.moe_bias_update": lambda c: (
        c.side == "jax" or c.backend in ("none", "ddp", "pipeline")
    ),  # the contract's row
    "model.moe_topk_group": lambda c: c.get("model.moe_n_group", "1") != "1",
    "train.tokens_per_batch": lambda c: c.get("data.batching") == "buckets",
    "optim.name": lambda c: c.side == "jax" or c.backend != "deepspeed",
    "optim.muon_": lambda c: c.get("optim.name") == "muon",
    **MTP_MODE_KEYS,
}


def normalize(case):
    """Drop the keys of modes the case no longer runs (what the hierarchical draw would not have set)."""
    keep = [
        (k, v)
        for k, v in case.settings
        if all(consumed(case) for prefix, consumed in MODE_KEYS.items() if k.startswith(prefix))
    ]
    return case.with_settings(keep)
