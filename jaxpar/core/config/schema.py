"""The framework-neutral config schema, shared by jaxpar and torchpar.

Pure Python on purpose (no jax, no torch): both trainers import it, so defaults live here once.
A config is YAML with one mapping per section, then `section.key=value` overrides on top.
Unknown keys, wrong types and out-of-range values raise `UserError` naming the key. Who consumes each key
(trainer, torchpar backend, mode) is jaxpar/core/config/contract.py: a new key comes with its row there.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import yaml

from jaxpar.core.errors import UserError, cli
from jaxpar.core.config.consistency import check_consistency, did_you_mean, int_list


def _check(choices=None, lo=None, hi=None, lo_open=False):
    return {"choices": choices, "lo": lo, "hi": hi, "lo_open": lo_open}


@dataclass
class ModelConfig:
    # gpt2: learned positions, LayerNorm, GELU MLP, biases. llama: rotary positions, RMSNorm, SwiGLU MLP,
    # grouped-query attention, no biases (jaxpar/models/llama.py). docs/architecture.md "Model families".
    family: str = field(default="gpt2", metadata=_check(choices=("gpt2", "llama")))
    vocab_size: int = field(default=256, metadata=_check(lo=1))
    n_layer: int = field(default=4, metadata=_check(lo=1))
    n_head: int = field(default=4, metadata=_check(lo=1))
    d_model: int = field(default=128, metadata=_check(lo=1))
    n_kv_head: int = field(default=0, metadata=_check(lo=0))  # llama's key/value heads (GQA); 0 -> n_head
    d_ff: int = field(default=0, metadata=_check(lo=0))  # 0 -> gpt2: 4 * d_model; llama: 8/3 * d_model rounded up
    ffn_multiple_of: int = field(default=256, metadata=_check(lo=1))  # llama, d_ff=0: round the MLP width up to this
    tie_embeddings: bool = True  # output head = the token embedding (gpt2 always; llama checkpoints usually not)
    max_seq_len: int = field(default=128, metadata=_check(lo=1))
    layernorm_eps: float = field(default=1e-5, metadata=_check(lo=0.0, lo_open=True))  # the block norms' eps
    init_std: float = field(default=0.02, metadata=_check(lo=0.0, lo_open=True))
    # float16: with dynamic loss scaling (optim.loss_scale_*; jaxpar/loss_scale.py, torch's GradScaler)
    compute_dtype: str = field(default="float32", metadata=_check(choices=("float32", "bfloat16", "float16")))
    # offload: the activations kept for the backward pass held in host memory (docs/features.md "Model",
    # docs/architecture.md)
    remat: str = field(default="none", metadata=_check(choices=("none", "full", "save_matmuls", "offload")))
    # the projections' matmuls in float8 with tensorwise current scaling (jaxpar/ops.py; torchao's "tensorwise"
    # recipe, which torchpar/ops.py runs): inputs and weights e4m3, output gradients e5m2, float32 accumulation;
    # norms, attention, the head and the loss stay in compute_dtype. Emulated (upcast) where the device has no
    # float8 matmul
    float8: bool = False
    # bfloat16 or float16: the output head's matmul writes float32 logits straight from its float32 accumulation
    # (jaxpar/models/head.py) instead of rounding them to compute_dtype and converting; jaxpar's
    float32_logits: bool = False
    # the output head and its cross-entropy in this many chunks of positions (lowered to a divisor of the sequence;
    # jaxpar/core/model/layer_rules.py): the float32 logits of the whole batch never exist at once; 1 = all at once
    loss_chunks: int = field(default=8, metadata=_check(lo=1))
    init_from: str = ""  # a .safetensors file in the shared weight format; empty = random init
    # variants (docs/architecture.md "Model variants"): attention core and MLP linear layers
    attention: str = field(default="mha", metadata=_check(choices=("mha", "mla", "dilated")))
    linear: str = field(default="dense", metadata=_check(choices=("dense", "sketched")))
    # mla (models/mla.py): low-rank query / key-value latents and the decoupled rotary part
    q_latent_dim: int = field(default=64, metadata=_check(lo=1))
    kv_latent_dim: int = field(default=32, metadata=_check(lo=1))
    rope_head_dim: int = field(default=16, metadata=_check(lo=2))
    rope_theta: float = field(default=10000.0, metadata=_check(lo=0.0, lo_open=True))
    # rotary scaling for long contexts, llama family with GQA attention or any mla attention (its rotary part;
    # jaxpar/core/model/rotary.py): yarn is YaRN as Hugging Face's rope_type yarn computes it; none: plain rotary
    rope_scaling: str = field(default="none", metadata=_check(choices=("none", "yarn")))
    # yarn: the slow rotary pairs' frequencies divided by this (the context's extension)
    rope_factor: float = field(default=1.0, metadata=_check(lo=0.0, lo_open=True))
    # yarn: the context the model was trained at, over which the ramp's ends are counted; 0: model.max_seq_len
    rope_original_max_seq_len: int = field(default=0, metadata=_check(lo=0))
    # yarn: pairs turning more than this many times over the original context keep their frequency
    rope_beta_fast: float = field(default=32.0, metadata=_check(lo=0.0, lo_open=True))
    # yarn: pairs turning fewer than this many times are divided by the factor; a linear ramp between
    rope_beta_slow: float = field(default=1.0, metadata=_check(lo=0.0, lo_open=True))
    rope_truncate: bool = True  # yarn: the ramp's ends rounded outwards to whole pairs (Hugging Face's truncate)
    # yarn: cos and sin multiplied by this; 0: 0.1 ln(rope_factor) + 1 (1 for a factor up to 1)
    rope_attention_factor: float = field(default=0.0, metadata=_check(lo=0.0))
    # yarn with mla attention: DeepSeek-V3's mscale_all_dim, the attention scores multiplied by
    # (0.1 x this x ln(rope_factor) + 1)^2; 0: not scaled
    rope_mscale_all_dim: float = field(default=0.0, metadata=_check(lo=0.0))
    # llama family, GQA attention (mha or dilated): one attention head's width; 0: d_model / n_head. Qwen3 sets its own
    # (heads x head_dim need not be d_model)
    head_dim: int = field(default=0, metadata=_check(lo=0))
    # llama family, GQA attention: Qwen3's per-head RMSNorm of the queries and the keys (over head_dim, one scale per
    # layer each) before the rotary embedding (jaxpar/models/llama.py)
    qk_norm: bool = False
    # llama family, GQA attention: biases on the query, key/value and output projections (gpt-oss's)
    attention_bias: bool = False
    # llama family, mha attention: a learned logit per head beside each query's scores that takes its share of the
    # softmax and reads no value (gpt-oss's attention sinks; jaxpar/ops.py causal_attention)
    attention_sinks: bool = False
    # sliding-window attention, every family: each query attends to its `sliding_window` latest tokens, itself included
    # (Mistral's and Hugging Face's sliding_window); on the CPU only the key blocks the band reaches are computed
    # (jaxpar/ops.py banded_attention). mha or mla attention; 0: the whole causal context
    sliding_window: int = field(default=0, metadata=_check(lo=0))
    # with sliding_window: every N-th layer (layers N-1, 2N-1, ...) attends to the whole causal context, the others
    # slide (gpt-oss alternates at 2; jaxpar/core/model/windows.py); 0: every layer slides
    full_attention_every: int = field(default=0, metadata=_check(lo=0))
    # dilated (models/dilated.py): (segment length, rate) pairs, comma-separated; empty: plain causal attention
    segment_lengths: str = ""
    dilation_rates: str = ""
    # block-sparse dilated attention (core/model/layer_rules.py): each query block of a pair's selected row computes
    # ceil(sparsity_ratio x its causal blocks) key blocks of sparsity_block tokens (its own and past ones drawn from
    # sparsity_seed); 0 or 1: dense
    sparsity_ratio: float = field(default=0.0, metadata=_check(lo=0.0, hi=1.0))
    sparsity_block: int = field(default=64, metadata=_check(lo=1))
    sparsity_seed: int = 0
    # sketched (core/model/layer_rules.py): fixed random sketch [in, sketch_ratio*in] from sketch_seed, trained factor
    sketch: str = field(default="gaussian", metadata=_check(choices=("gaussian", "sign")))
    sketch_ratio: float = field(default=0.5, metadata=_check(lo=0.0, hi=1.0, lo_open=True))
    sketch_seed: int = 0
    # mixture of experts (models/moe.py, docs/architecture.md "Mixture of experts"): every layer's MLP but the first
    # moe_first_dense becomes moe_experts SwiGLU experts of width moe_d_ff (0: the MLP's), each token sent to its
    # moe_top_k best; 0: dense
    moe_experts: int = field(default=0, metadata=_check(lo=0))
    moe_first_dense: int = field(default=0, metadata=_check(lo=0))  # DeepSeek's first_k_dense_replace
    moe_top_k: int = field(default=2, metadata=_check(lo=1))
    moe_shared_experts: int = field(default=0, metadata=_check(lo=0))  # experts every token passes through as well
    moe_d_ff: int = field(default=0, metadata=_check(lo=0))
    moe_router: str = field(default="softmax", metadata=_check(choices=("softmax", "sigmoid")))  # expert scores
    moe_norm_topk: bool = True  # the chosen experts' weights divided by their sum
    moe_aux_loss: float = field(default=0.0, metadata=_check(lo=0.0))  # the sequence-wise balance loss's coefficient
    # the auxiliary-loss-free balance (DeepSeek-V3's bias update speed, e.g. 0.001; core/model/experts.py); 0: off
    moe_bias_update: float = field(default=0.0, metadata=_check(lo=0.0))
    # that bias kept with moe_bias_update=0 too, fixed (a converted DeepSeek-V3's e_score_correction_bias)
    moe_router_bias: bool = False
    # each expert takes at most capacity_factor x its even share (top_k x seq_len / experts) of a row's tokens,
    # first choices first, earlier tokens first; the rest of its tokens skip it. 0: dropless
    moe_capacity_factor: float = field(default=0.0, metadata=_check(lo=0.0))
    # the experts multiply only the rows routed to them, one grouped matmul per projection (jax.lax.ragged_dot,
    # torch._grouped_mm) instead of jaxpar's buffer padded to every slot or torchpar's loop over the experts; jaxpar
    # runs it at ep=1 (the ragged exchange over ep is not built)
    moe_ragged: bool = False
    # DeepSeek-V3's group-limited routing (models/moe.py route): the experts in moe_n_group groups of equal size, each
    # scored by its best two (scores plus the balance bias), the top_k chosen among the moe_topk_group best groups'
    # experts; 1 and 1: no grouping
    moe_n_group: int = field(default=1, metadata=_check(lo=1))
    moe_topk_group: int = field(default=1, metadata=_check(lo=1))
    # the experts' gated activation: swiglu is silu(gate) x up; gpt_oss is gpt-oss's, gate clamped at most
    # moe_swiglu_limit and up within +-moe_swiglu_limit, then (up + 1) x gate x sigmoid(moe_swiglu_alpha x gate)
    moe_activation: str = field(default="swiglu", metadata=_check(choices=("swiglu", "gpt_oss")))
    moe_swiglu_limit: float = field(default=7.0, metadata=_check(lo=0.0, lo_open=True))  # gpt_oss: the clamp
    moe_swiglu_alpha: float = field(
        default=1.702, metadata=_check(lo=0.0, lo_open=True)
    )  # gpt_oss: the sigmoid's slope
    # biases on each expert's gate, up and down projections and a learned bias on the router's logits (gpt-oss's),
    # which, unlike the balance bias, weighs as well as chooses
    moe_expert_bias: bool = False
    # the routed experts' weights times this, after moe_norm_topk's division (DeepSeek-V3's routed_scaling_factor)
    moe_routed_scale: float = field(default=1.0, metadata=_check(lo=0.0, lo_open=True))
    # DeepSeek-V3's multi-token prediction (models/decoder.py MTP): mtp_depth extra modules after the main model, depth
    # d predicting token t+1+d from depth d-1's hidden state and token t+d's embedding (the embedding and the output
    # head shared); the loss adds mtp_loss_weight x the mean of their losses. 0: off. The weight's default is
    # DeepSeek-V3's for the first 10T of its 14.8T tokens (0.1 after): runs here are short, in that early phase
    mtp_depth: int = field(default=0, metadata=_check(lo=0))
    mtp_loss_weight: float = field(default=0.3, metadata=_check(lo=0.0))

    @property
    def ff_dim(self) -> int:
        if self.d_ff or self.family == "gpt2":
            return self.d_ff or 4 * self.d_model
        k = self.ffn_multiple_of  # Llama's rule: 2/3 of 4*d_model (SwiGLU has three matrices), rounded up
        return -(-(8 * self.d_model // 3) // k) * k

    @property
    def expert_dim(self) -> int:
        return self.moe_d_ff or self.ff_dim

    @property
    def moe_layers(self) -> int:
        """The layers whose feed-forward is a mixture of experts: the last n_layer - moe_first_dense."""
        return self.n_layer - self.moe_first_dense if self.moe_experts else 0

    @property
    def router_bias(self) -> bool:
        """The router keeps the choice's balance bias: moved by model.moe_bias_update, else fixed."""
        return bool(self.moe_experts and (self.moe_bias_update or self.moe_router_bias))

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_width(self) -> int:
        """One attention head's width: model.head_dim, or d_model / n_head."""
        return self.head_dim or self.d_model // self.n_head

    @property
    def dilation_pairs(self) -> tuple[tuple[int, int], ...]:
        """((segment length, dilation rate), ...); empty lists mean ((max_seq_len, 1),)."""
        ws, rs = (int_list(f"model.{k}", getattr(self, k)) for k in ("segment_lengths", "dilation_rates"))
        if not ws and not rs:
            return ((self.max_seq_len, 1),)
        if len(ws) != len(rs):
            raise UserError(f"model.segment_lengths has {len(ws)} entries but model.dilation_rates has {len(rs)}")
        return tuple(zip(ws, rs))


@dataclass
class DataConfig:
    dataset: str = "stdlib"  # "stdlib" (this Python's own library sources) or a prepared .bin file
    tokenizer: str = "byte"  # "byte" or a Hugging Face tokenizers JSON file
    seq_len: int = field(default=128, metadata=_check(lo=1))
    val_fraction: float = field(default=0.01, metadata=_check(lo=0.0, hi=0.5, lo_open=True))
    cache_dir: str = ""  # empty -> $JAXPAR_CACHE or ~/.cache/jaxpar
    document_mask: bool = False  # attention within each document of a packed row, positions restart (loss.py)
    # windows: rows of seq_len + 1 cut from the token stream; buckets: whole documents grouped by length into
    # batches of about train.tokens_per_batch tokens (core/data/buckets.py)
    batching: str = field(default="windows", metadata=_check(choices=("windows", "buckets")))
    buckets: str = ""  # data.batching=buckets: targets per row of each bucket, "64,128,..."; "": seq_len/8,/4,/2,/1


@dataclass
class TrainConfig:
    steps: int = field(default=300, metadata=_check(lo=1))  # a run trains; --write-init writes weights untrained
    global_batch_size: int = field(default=32, metadata=_check(lo=1))
    microbatches: int = field(default=1, metadata=_check(lo=1))  # gradient accumulation
    seed: int = 0
    log_every: int = field(default=10, metadata=_check(lo=1))
    eval_every: int = field(default=100, metadata=_check(lo=0))  # 0 = only at the end
    eval_batches: int = field(default=4, metadata=_check(lo=1))
    sample_every: int = field(default=0, metadata=_check(lo=0))  # print a sampled continuation every N steps; 0 = off
    # benchmark tasks scored with lm-evaluation-harness during training: lm-eval task names, task YAML files or text
    # files (perplexity), comma-separated (jaxpar/core/evaluation/tasks.py); "": off. Scores in metrics.jsonl as
    # eval/<task>/<metric>, results in run.dir/evals/<step>.json
    eval_tasks: str = ""
    eval_tasks_every: int = field(default=0, metadata=_check(lo=0))  # train.eval_tasks every N steps; 0 = at the end
    eval_tasks_limit: int = field(default=0, metadata=_check(lo=0))  # train.eval_tasks: first N documents; 0 = all
    eval_tasks_fewshot: int = field(default=-1, metadata=_check(lo=-1))  # train.eval_tasks: -1 = each task's own
    matmul_precision: str = field(default="default", metadata=_check(choices=("default", "high", "highest")))
    # torchpar: torch.compile each block and the chunked loss's step (the pipeline's last stage keeps it eager; auto =
    # on a GPU, not on the CPU, where compiling takes longer than a short run saves; deepspeed: off). jaxpar's step is
    # always compiled by XLA: "off" is refused there.
    compile: str = field(default="auto", metadata=_check(choices=("auto", "on", "off")))
    # jaxpar's layers under one lax.scan (on: compile time flat in depth) or unrolled (off: GPT-2 124M 1.47x faster
    # on an H100, compiling 5x longer; docs/gpu.md); auto: off on a GPU. torchpar's layers are always separate.
    scan_layers: str = field(default="auto", metadata=_check(choices=("auto", "on", "off")))
    profile_steps: str = ""  # "a:b" -> profiler trace of steps [a, b) in run.dir
    # several processes: a process whose pace is this much slower than the median is named (core/run/stragglers.py)
    straggler_threshold: float = field(default=0.2, metadata=_check(lo=0.0))
    batch_rampup: str = ""  # "START,INCREMENT,SAMPLES": Megatron's rampup_batch_size (core/data/rampup.py); "": off
    tokens_per_batch: int = field(default=0, metadata=_check(lo=0))  # data.batching=buckets; 0: batch x seq_len


@dataclass
class OptimConfig:
    # adamw: AdamW on every parameter; muon: Muon on the hidden matrices (attention, MLP and each expert's, per
    # layer and per expert), AdamW on the rest (embeddings, head, router, norms, biases): jaxpar/core/optimizer/muon.py;
    # adamw8bit: AdamW with its moments in 8-bit codes, blocks of 64 values each with a float32 scale (about 0.27x
    # AdamW's state): jaxpar/core/optimizer/adamw8bit.py
    name: str = field(default="adamw", metadata=_check(choices=("adamw", "muon", "adamw8bit")))
    lr: float = field(default=3e-3, metadata=_check(lo=0.0))
    min_lr: float = field(default=3e-4, metadata=_check(lo=0.0))
    warmup_steps: int = field(default=30, metadata=_check(lo=0))
    decay_steps: int = field(default=0, metadata=_check(lo=0))  # 0 -> train.steps
    beta1: float = field(default=0.9, metadata=_check(lo=0.0, hi=1.0))
    beta2: float = field(default=0.95, metadata=_check(lo=0.0, hi=1.0))
    eps: float = field(default=1e-8, metadata=_check(lo=0.0, lo_open=True))
    # torchpar, optim.name=adamw: torch's fused AdamW kernel (torch.optim.AdamW(fused=True)), every parameter's update
    # in one kernel, or its foreach path; auto = fused on a GPU (GPT-2 124M 1.29x faster on an H200, docs/gpu.md),
    # foreach on the CPU. jaxpar's update is compiled into its step already
    fused: str = field(default="auto", metadata=_check(choices=("auto", "on", "off")))
    weight_decay: float = field(default=0.1, metadata=_check(lo=0.0))
    grad_clip: float = field(default=1.0, metadata=_check(lo=0.0))  # 0 = no clipping
    # DiLoCo (a `diloco` axis in the mesh): the outer optimizer's lr, constant; SGD on the groups' mean parameter
    # delta every parallel.diloco_inner_steps steps (docs/diloco.md)
    outer_lr: float = field(default=0.7, metadata=_check(lo=0.0, lo_open=True))
    outer_momentum: float = field(default=0.9, metadata=_check(lo=0.0, hi=1.0))  # DiLoCo's outer momentum; 0 = none
    outer_nesterov: bool = True  # DiLoCo's outer momentum is Nesterov's (false: plain heavy-ball momentum)
    # optim.name=muon: the momentum (Nesterov), the Newton-Schulz steps, and how each matrix's step is scaled from
    # optim.lr: match_rms_adamw = 0.2 * sqrt(max(fan_in, fan_out)) (Moonlight's: AdamW's lr and weight decay carry
    # over), original = sqrt(max(1, fan_out / fan_in)) (Keller Jordan's: wants a larger lr than AdamW)
    muon_momentum: float = field(default=0.95, metadata=_check(lo=0.0, hi=1.0))
    muon_ns_steps: int = field(default=5, metadata=_check(lo=1, hi=20))
    muon_lr_rule: str = field(default="match_rms_adamw", metadata=_check(choices=("match_rms_adamw", "original")))
    # dynamic loss scaling, model.compute_dtype=float16 only: the loss is multiplied by the scale before the
    # backward pass; a step whose gradients overflow is skipped and the scale multiplied by the backoff
    # factor (not below the minimum); after growth_interval clean steps in a row it grows by the growth factor
    loss_scale_init: float = field(default=65536.0, metadata=_check(lo=0.0, lo_open=True))
    loss_scale_growth_interval: int = field(default=2000, metadata=_check(lo=1))
    loss_scale_growth_factor: float = field(default=2.0, metadata=_check(lo=1.0, lo_open=True))
    loss_scale_backoff_factor: float = field(default=0.5, metadata=_check(lo=0.0, hi=1.0, lo_open=True))
    loss_scale_min: float = field(default=1.0, metadata=_check(lo=0.0, lo_open=True))


@dataclass
class ParallelConfig:
    mesh: str = ""  # "dp=2,tp=4"; empty = all devices on dp. --mesh overrides it.
    zero_stage: int = field(default=0, metadata=_check(choices=(0, 1, 2, 3)))
    # attention across `sp` shards (jaxpar/parallel/sequence.py) and causal load balancing by zig-zag order
    sequence_attention: str = field(default="ring", metadata=_check(choices=("ring", "all_gather", "ulysses")))
    sequence_zigzag: bool = True
    # pipeline over `pp` (jaxpar/pipeline/gpipe.py, jaxpar/pipeline/executor.py);
    # schedule tables: python -m jaxpar.tools.pipeline_table
    # auto: the least modeled step time for the config and mesh (jaxpar/core/pipeline/choice.py)
    pipeline_schedule: str = field(
        default="auto", metadata=_check(choices=("auto", "gpipe", "1f1b", "interleaved", "zb_h1", "zb_v", "dualpipev"))
    )
    pipeline_microbatches: int = field(default=0, metadata=_check(lo=0))  # 0 -> 2 x stages
    pipeline_virtual_stages: int = field(default=1, metadata=_check(lo=1))
    # state kept in host memory between steps, moved to the devices for the step (jaxpar: memory kinds;
    # torchpar: FSDP2's CPUOffloadPolicy, DeepSpeed's offload_optimizer / offload_param)
    offload: str = field(default="none", metadata=_check(choices=("none", "optimizer", "params+optimizer")))
    # the data-parallel gradient reduction: none | bf16 | powersgd (docs/torchpar.md "Gradient compression")
    grad_compression: str = field(default="none", metadata=_check(choices=("none", "bf16", "powersgd")))
    powersgd_rank: int = field(default=4, metadata=_check(lo=1))
    powersgd_warmup_steps: int = field(default=10, metadata=_check(lo=2))
    # DiLoCo (a `diloco` axis in the mesh, docs/diloco.md): each group of devices trains this many steps alone,
    # then the groups average their parameter deltas and the outer optimizer (optim.outer_*) applies them
    diloco_inner_steps: int = field(default=50, metadata=_check(lo=1))
    # streaming DiLoCo: the parameters as this many fragments (equal runs of layers), meeting at staggered steps
    diloco_fragments: int = field(default=1, metadata=_check(lo=1))
    # streaming DiLoCo's overlap: a meeting's exchange runs behind this many inner steps, then its outer step replaces
    # the fragment's parameters (0: the groups meet between two steps)
    diloco_delay: int = field(default=0, metadata=_check(lo=0))
    # torchft's DiLoCo (torchpar --backend ddp, docs/diloco.md "torchft"): each of the mesh's diloco groups its own
    # launch, joined by torchft's lighthouse at this address (host:port); groups may leave and come back
    torchft_lighthouse: str = ""
    # which of the mesh's diloco groups this launch is (0-based), under parallel.torchft_lighthouse
    torchft_group: int = field(default=0, metadata=_check(lo=0))


@dataclass
class CheckpointConfig:
    every: int = field(default=100, metadata=_check(lo=0))  # 0 = only at the end
    keep: int = field(default=3, metadata=_check(lo=1))
    resume: bool = True


@dataclass
class RunConfig:
    dir: str = ""  # empty: runs/<framework>/<config file name> (jaxpar/core/run/directory.py)
    # how long a process waits on the others (a step, a collective, start-up) before it exits with
    # one line naming the lost processes (jaxpar/core/run/peers.py); multi-process runs only
    peer_timeout_s: float = field(default=300.0, metadata=_check(lo=0.0, lo_open=True))
    debug: bool = False  # library logs (orbax, absl, XLA C++) on the console as well
    tensorboard: bool = False  # event files in <dir>/tensorboard (jaxpar/core/run/trackers.py)
    wandb: str = field(default="off", metadata=_check(choices=("off", "offline", "online")))


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


def _coerce(key: str, value: Any, typ: type) -> Any:
    """Convert a YAML or command-line value to the field's type, or fail naming the key."""
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
    elif typ in (int, float):  # an int field takes no float (2.5 would be cut short), a float field an int
        if isinstance(value, (int, typ)) and not isinstance(value, bool):
            return typ(value)
        if isinstance(value, str):
            try:
                return typ(value)
            except ValueError:
                pass
    elif typ is str:
        if isinstance(value, (str, bool)):  # YAML 1.1 reads a bare on/off as a boolean (train.compile: off)
            return value if isinstance(value, str) else "on" if value else "off"
        if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return ",".join(map(str, value))  # YAML lists of integers (model.segment_lengths)
        if value is None:
            return ""
    raise UserError(f"config key {key}: expected {typ.__name__}, got {value!r}")


def _validate(key: str, value: Any, meta: dict) -> None:
    choices, lo, hi = meta.get("choices"), meta.get("lo"), meta.get("hi")
    if isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"config key {key}: {value!r} is not a finite number")
    if choices is not None and value not in choices:
        raise UserError(f"config key {key}: {value!r} is not one of {', '.join(map(str, choices))}")
    if lo is not None and (value < lo or (meta.get("lo_open") and value == lo)):
        bound = f"> {lo}" if meta.get("lo_open") else f">= {lo}"
        raise UserError(f"config key {key}: {value!r} out of range (must be {bound})")
    if hi is not None and value > hi:
        raise UserError(f"config key {key}: {value!r} out of range (must be <= {hi})")


# Keys that earlier versions accepted, with the value that meant "off" (what old run configs hold).
REMOVED = {"model.dropout": (0.0, "model.dropout was removed: no trainer ever applied dropout")}
# Keys whose values changed type: what a run's config.json written before holds -> what it reads as now. optim.fused
# was a bool, false by default: a run that left it so gets today's default (auto: foreach on the CPU, where false put
# it, fused on a GPU); one that set it true, on.
RETYPED = {"optim.fused": {False: "auto", True: "on"}}


def saved_value(dotted: str, value: Any) -> Any:
    """A run's config.json value as today's schema reads it (RETYPED)."""
    return RETYPED.get(dotted, {}).get(value, value) if isinstance(value, bool) else value


def _set(cfg: Config, dotted: str, value: Any) -> None:
    if dotted in REMOVED:
        raise UserError(REMOVED[dotted][1])
    section_name, _, key = dotted.partition(".")
    sections = {f.name: f for f in dataclasses.fields(Config)}
    if section_name not in sections:
        raise UserError(
            f"unknown config section {section_name!r} (in {dotted!r}){did_you_mean(dotted, Config)} "
            f"(known: {', '.join(sections)})"
        )
    section = getattr(cfg, section_name)
    fields = {f.name: f for f in dataclasses.fields(section)}
    if key not in fields:
        hint = did_you_mean(dotted, Config) or f"; {section_name} has: {', '.join(fields)}"
        raise UserError(f"unknown config key {dotted!r}{hint}")
    f = fields[key]
    typ = {"int": int, "float": float, "str": str, "bool": bool}[f.type] if isinstance(f.type, str) else f.type
    coerced = _coerce(dotted, value, typ)
    _validate(dotted, coerced, dict(f.metadata))
    setattr(section, key, coerced)


def load_config(path: str | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- YAML file (or a run's config.json) <- `section.key=value` overrides, validated."""
    cfg = Config()
    if path:
        if not os.path.exists(path):
            raise UserError(f"config file not found: {path}")
        if os.path.isdir(path):
            raise UserError(f"config file {path} is a directory (name a YAML file, e.g. configs/gpt2-tiny.yaml)")
        try:
            with open(path, encoding="utf-8") as f:
                raw = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise UserError(f"config file {path} is not valid YAML: {str(e).splitlines()[0]}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"cannot read config file {path}: {getattr(e, 'strerror', None) or e}") from None
        if not isinstance(raw, dict):
            raise UserError(f"config file {path}: top level must be a mapping of sections")
        for section, values in raw.items():
            if path.endswith(".json") and not isinstance(values, dict):
                continue  # a run's config.json (YAML reads JSON): the trainer's records beside the sections
            if not isinstance(values, dict):
                raise UserError(f"config section {section!r} in {path} must be a mapping")
            for key, value in values.items():
                _set(
                    cfg, f"{section}.{key}", saved_value(f"{section}.{key}", value) if path.endswith(".json") else value
                )
    for item in overrides or []:
        dotted, eq, value = item.partition("=")
        if not eq or "." not in dotted:
            raise UserError(f"override {item!r} is not of the form section.key=value")
        _set(cfg, dotted.strip(), value.strip())  # strings are parsed by the field's type
    check_consistency(cfg)
    return cfg


def config_for_weights(dims: dict, *overrides: str) -> Config:
    """The default config around model dimensions read off a weights file (sequence length: the model's)."""
    dims_set = [f"model.{k}={v}" for k, v in dims.items()]
    return load_config(None, [*dims_set, f"data.seq_len={dims['max_seq_len']}", *overrides])


def config_from_dict(d: dict) -> Config:
    """Rebuild a Config saved with `to_dict` (e.g. a run's resolved config.json)."""
    cfg = Config()
    for section, values in d.items():
        for key, value in values.items():
            if REMOVED.get(f"{section}.{key}", (None,))[0] != value:  # a removed key at its "off" value: nothing lost
                _set(cfg, f"{section}.{key}", saved_value(f"{section}.{key}", value))
    check_consistency(cfg)
    return cfg


@cli
def main(argv=None) -> int:
    """Print the resolved config.

    python -m jaxpar.core.config.schema [configs/gpt2-tiny.yaml] [section.key=value ...]
    """
    args = sys.argv[1:] if argv is None else argv
    has_path = bool(args) and "=" not in args[0]
    print(load_config(args[0] if has_path else None, args[1:] if has_path else args).to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
