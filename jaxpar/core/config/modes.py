"""The run modes the config contract names: what decides whether a run consumes a key.

A `Run` is what decides (the trainer, torchpar's backend, the resolved mesh); each mode is a predicate on it with
its words for a refusal line and an example that makes it hold (jaxpar/core/config/contract.py's rows use them).
"""

from __future__ import annotations

from dataclasses import dataclass
import dataclasses
from typing import Callable

from jaxpar.core.config.schema import Config
from jaxpar.core.pipeline.schedules import concrete


@dataclass(frozen=True)
class Run:
    """What decides which keys a run consumes."""

    cfg: Config
    trainer: str  # "jaxpar" | "torchpar"
    backend: str = ""  # torchpar's --backend; "" for jaxpar
    mesh: dict = dataclasses.field(default_factory=dict)  # axis -> size (resolved); missing axes are 1

    def size(self, axis: str) -> int:
        return self.mesh.get(axis, 1)


def _always(run: Run) -> bool:
    return True


def _model(key: str, value) -> Callable[[Run], bool]:
    return lambda run: getattr(run.cfg.model, key) == value


def _dense_width(run: Run) -> bool:  # the MLP's width is used: no experts, dense first layers, or experts that take it
    m = run.cfg.model  # (or multi-token prediction's blocks, which are dense)
    return not (m.moe_experts and m.moe_d_ff and not m.moe_first_dense and not m.mtp_depth)


def _stages(run: Run) -> bool:
    return run.size("pp") > 1


def _whole_model(run: Run) -> bool:  # benchmark evaluation (train.eval_tasks) scores on dp / fsdp / tp only
    return all(run.size(axis) == 1 for axis in ("pp", "sp", "ep"))


def _llama_or_mla(run: Run) -> bool:
    return run.cfg.model.family == "llama" or run.cfg.model.attention == "mla"


def _zigzag(run: Run) -> bool:  # dilated attention keeps the natural token order (jaxpar/loss.py), its own exchange
    return run.size("sp") > 1 and run.cfg.model.attention != "dilated"


NOT_PIPELINE = ("none", "ddp", "fsdp", "deepspeed")  # the backends whose batches may change shape
ONE_SHAPE = (
    "torch.distributed.pipelining builds its schedule for one batch shape (use --backend none, ddp, fsdp or deepspeed)"
)


def _buckets(run: Run) -> bool:
    return run.cfg.data.batching == "buckets"


def _documents(run: Run) -> bool:  # dilated attention has its own pattern; GPipe's ticks see activations only
    gpipe = run.trainer == "jaxpar" and _stages(run) and concrete(run.cfg.parallel.pipeline_schedule) == "gpipe"
    return run.cfg.model.attention != "dilated" and not gpipe


def _zero(run: Run) -> bool:  # jaxpar shards over dp only (jaxpar/layout.py); with dp=1 a stage changes nothing
    return run.trainer == "torchpar" or run.size("dp") > 1


def _data_parallel(run: Run) -> bool:
    return run.trainer == "torchpar" or run.size("dp") * run.size("fsdp") > 1


def _powersgd(run: Run) -> bool:
    return run.cfg.parallel.grad_compression == "powersgd"


OUTER = ("optim.outer_lr", "optim.outer_momentum", "optim.outer_nesterov")
DILOCO = dict(  # parallel.diloco_inner_steps and optim.outer_*: jaxpar/parallel/diloco.py, torchpar/diloco.py
    when=lambda r: r.size("diloco") > 1,
    mode="a diloco axis in the mesh",
    example=("mesh:diloco=2",),
    evidence="tests/jaxpar/test_diloco.py::test_diloco_equals_its_reference",
    why_not="DiLoCo's groups are a mesh axis (diloco=N: jaxpar.train, torchpar's ddp and fsdp)",
)
TORCHFT = dict(  # parallel.torchft_*: torchpar/torchft_groups.py
    when=lambda r: r.size("diloco") > 1 and bool(r.cfg.parallel.torchft_lighthouse),
    mode="a diloco axis in the mesh and parallel.torchft_lighthouse",
    example=("mesh:diloco=2", "parallel.torchft_lighthouse=localhost:29510"),
    evidence="tests/torchpar/test_torchft.py::test_torchft_groups_equal_the_reference",
    why_not="torchft's groups are torchpar's, on --backend ddp, one launch per diloco group",
)


def _virtual(run: Run) -> bool:
    return run.cfg.parallel.pipeline_schedule == "interleaved" and (run.trainer == "torchpar" or _stages(run))


MUON = dict(when=lambda r: r.cfg.optim.name == "muon", mode="optim.name=muon", example=("optim.name=muon",))
NOT_DEEPSPEED = ("none", "ddp", "fsdp", "pipeline")
DEEPSPEED_ADAMW = (
    "DeepSpeed builds its own AdamW from its JSON config (use --backend none, ddp, fsdp or pipeline, or jaxpar.train)"
)
MLA = dict(when=_model("attention", "mla"), mode="model.attention=mla", example=("model.attention=mla",))
DILATED = dict(
    when=_model("attention", "dilated"),
    mode="model.attention=dilated",
    example=("model.attention=dilated", "model.segment_lengths=8,16", "model.dilation_rates=1,2"),
)
BLOCK_SPARSE = dict(
    when=lambda r: r.cfg.model.attention == "dilated" and 0 < r.cfg.model.sparsity_ratio < 1,
    mode="model.attention=dilated with 0 < model.sparsity_ratio < 1",
    example=DILATED["example"] + ("model.sparsity_ratio=0.5", "model.sparsity_block=2"),
)
SKETCHED = dict(when=_model("linear", "sketched"), mode="model.linear=sketched", example=("model.linear=sketched",))
LLAMA = dict(when=_model("family", "llama"), mode="model.family=llama", example=("model.family=llama",))
GQA = dict(  # llama's grouped-query attention (jaxpar/models/llama.py), the dilated core's too; not mla's
    when=lambda r: r.cfg.model.family == "llama" and r.cfg.model.attention != "mla",
    mode="model.family=llama with model.attention=mha or dilated",
    example=("model.family=llama",),
)
ROTARY = dict(  # rotary positions YaRN can scale: llama's attention, and mla's rotary part in either family
    when=lambda r: r.cfg.model.family == "llama" or r.cfg.model.attention == "mla",
    mode="model.family=llama, or model.attention=mla",
    example=("model.family=llama",),
)
FLOAT16 = dict(
    when=_model("compute_dtype", "float16"),
    mode="model.compute_dtype=float16",
    example=("model.compute_dtype=float16",),
)
PIPELINE = dict(
    when=_stages, mode="a pipeline (jaxpar: pp>1 in the mesh; torchpar: --backend pipeline)", example=("mesh:pp=2",)
)
MOE = dict(when=lambda r: r.cfg.model.moe_experts > 0, mode="model.moe_experts>0", example=("model.moe_experts=4",))
NO_BIAS_UPDATE = (
    "torchpar moves the experts' balance bias on whole parameters, which fsdp and deepspeed shard "
    "(use --backend none, ddp or pipeline, or jaxpar.train)"
)
NO_TORCH_SP = "torchpar has no sequence parallelism (jaxpar.train runs sp)"
