"""Pipeline parallelism with torch.distributed.pipelining.

GPipe, 1F1B, interleaved 1F1B (V virtual stages per rank: `ScheduleInterleaved1F1B`) and zero-bubble
(`ScheduleInterleavedZeroBubble` for zb_h1, `ScheduleZBVZeroBubble` for zb_v).

The stage split is jaxpar's (jaxpar/core/pipeline/schedules.py: virtual_stage): with S ranks and V chunks each,
virtual stage v = c*S + s (chunk c of rank s; zb_v: rank s holds s and 2S-1-s) holds layers
[v*L/(SV), (v+1)*L/(SV)); the embedding lives on the first virtual stage, the final norm and output head (and
the loss) on the last. Module names stay those of the whole Decoder ("blocks.3.attn..."), so
checkpoints (DCP) and weight files are interchangeable with every other backend.

- pp x dp: `parallel.mesh=pp=S,dp=D` on S*D ranks builds a 2-D DeviceMesh ("dp", "pp"); each of the D
  pipeline replicas reads its share of every global batch, each stage chunk is wrapped in DDP over the dp
  group (the pipeline stage lets DDP all-reduce on the last backward only). pp x fsdp:
  `parallel.mesh=pp=S,fsdp=F`, the same with FSDP2 inside each stage (`fully_shard` per block, then the
  stage, over the fsdp group; torchtitan's layout): each rank holds 1/F of its stage's parameters, gpipe and
  1f1b. Without parallel.mesh every rank is a stage.

- Microbatches: `parallel.pipeline_microbatches` (0 -> 2 x stages), split inside every accumulation
  microbatch. Rows are reordered so the schedule's contiguous chunks are jaxpar's microbatches
  (microbatch m = rows m, m+M, ...).
- The loss function divides by the number of microbatches itself (scale_grads=False: the schedule's
  own scaling would also rescale gradients accumulated over earlier accumulation microbatches).
- A tied embedding exists on the first and the last stage; after the backward its two gradients
  are summed over a two-rank group (Megatron's embedding group) so both copies take the same step.
  An untied head (llama's lm_head) lives on the last stage only.
- Gradient clipping uses the global norm: the squared norms of the stages are summed over the pp group.
- A mixture of experts: each stage passes its per-row statistics on beside its activations (a second stage
  output, float32 [rows, width]), adding its expert layers' (with model.moe_bias_update each layer's choices in
  that layer's columns, as moe.layer_stats lays them out); the last stage's loss function weighs in the balance
  loss, whose gradient flows back through that output to every stage's routers, and keeps the step's statistics.
  Each stage moves its own layers' balance bias by every layer's loads, summed over the ranks.
- Multi-token prediction (model.mtp_depth; gpipe, 1f1b, interleaved; pp x dp too): the last stage's output is the state
  before the final norm; its loss function (Stage.mtp_loss) takes the final norm, the head and the prediction
  modules, which read the microbatch's whole rows passed as the schedule's target (the depths' tokens and targets).
  The last stage holds the embedding table for their lookups, tied head or not, its gradient summed with the
  first stage's as a tied head's; each depth's loss is kept, scaled as the loss, for metrics (mtp_loss_1..D).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as tdist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleDualPipeV,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from jaxpar.core.errors import UserError
from jaxpar.core.model.layer_rules import loss_chunks
from jaxpar.core.config.mesh_spec import parse_mesh, resolve_sizes
from jaxpar.core.pipeline.schedules import (
    check_schedule,
    chunks as chunks_per_rank,
    concrete,
    placement,
    resolve_microbatches,
    virtual_stage,
)
from torchpar.backends.base import TorchEngine
from torchpar.models.decoder import Decoder, embed, inputs_and_targets, mtp_losses
from torchpar.models.head import chunked_cross_entropy
from torchpar.optim import local, whole

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved": ScheduleInterleaved1F1B,
    "zb_h1": ScheduleInterleavedZeroBubble,
    "zb_v": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}
MULTI = ("interleaved", "zb_h1", "zb_v", "dualpipev")  # schedules that take a list of stages


class Stage(nn.Module):
    """Some layers of a Decoder; the embedding when first, final norm, output head and loss (head_loss) when last.

    A virtual stage's chunk, or all of a rank's chunks together (the module the optimizer, clipping and checkpoints
    see).
    """

    def __init__(self, model: Decoder, layers: list[int], first: bool, last: bool):
        super().__init__()
        self.first, self.last, self.compute_dtype = first, last, model.compute_dtype
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})  # global names
        if first or (last and (model.lm_head is None or model.mtp)):  # the last's: a tied head, MTP's lookups
            self.wte = model.wte
        if first:
            self.wpe = model.wpe  # None for llama
        if last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head  # lm_head None when tied
            self.mtp = model.mtp  # multi-token prediction's modules (empty without): run in mtp_loss
        self.cfg = model.cfg

    def forward(self, x: torch.Tensor, stats: torch.Tensor | None = None):
        """Run this stage's layers and return its output.

        -> this stage's output (the last: the final norm's; its head and loss are the schedule's loss
        function), with experts (output, the statistics so far: `stats` plus this stage's layers').
        """
        if self.first:
            x = embed(self.wte, self.wpe, x, self.compute_dtype)
        per_layer = []
        for name, block in self.blocks.items():
            x, layer = block(x)
            if layer is not None:  # an expert layer (the dense first ones report none)
                per_layer.append((int(name) - self.cfg.moe_first_dense, layer))
        x = self.ln_f(x) if self.last and not self.cfg.mtp_depth else x  # MTP reads the state before it
        return (x, add_stats(stats, per_layer, self.cfg, x)) if self.cfg.moe_experts else x

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The last stage's output head and cross-entropy of its output, in model.loss_chunks chunks.

        What the schedule's loss function computes, so the whole logits are never a stage output held for the
        backward. Through head.py's autograd Function even in one chunk: it keeps no input for its backward, and
        after the input pass the zero-bubble schedules detach the stage's output in place (torch's stage.py)
        before their weight pass. Under FSDP2 a forward method of the stage's (register_fsdp_forward_method).
        """
        table = self.wte if self.lm_head is None else self.lm_head
        return chunked_cross_entropy(x, table, targets, loss_chunks(self.cfg, targets.shape[1]))

    def mtp_loss(self, h: torch.Tensor, rows: torch.Tensor, train: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """With multi-token prediction.

        (the main cross-entropy, each depth's [depth] or None out of training) of the last stage's output `h`
        (before the final norm) and the microbatch's rows [rows, seq + 1] (the schedule's target):
        Decoder.forward's steps, the lookups in this stage's copy of wte.
        """
        inputs, targets = inputs_and_targets(rows)
        loss = self.head_loss(self.ln_f(h), targets)
        if not train:  # evaluation: the main loss alone, as the other backends
            return loss, None
        depths = mtp_losses(
            self.mtp,
            self.wte,
            h,
            (inputs, targets, None),
            self.compute_dtype,
            lambda norm, x, t: self.head_loss(norm(x), t),
        )
        return loss, depths


def stats_width(cfg) -> int:
    """moe.layer_stats' width.

    The choices per expert (per expert layer with model.moe_bias_update), dropped choices, balance loss.
    """
    return (cfg.moe_layers if cfg.moe_bias_update else 1) * cfg.moe_experts + 2


def add_stats(stats: torch.Tensor | None, per_layer: list, cfg, x: torch.Tensor) -> torch.Tensor:
    """The statistics a stage passes on.

    `stats` (zeros on the first stage) plus each (expert layer j, its per-row statistics [rows, E + 2]) of
    `per_layer`, summed in layer order as moe.layer_stats sums them (x: the rows).
    """
    if stats is None:
        stats = torch.zeros(x.shape[0], stats_width(cfg), device=x.device)
    if not per_layer:
        return stats
    E, parts = cfg.moe_experts, []
    if cfg.moe_bias_update:  # each layer's choices in its own columns; the rest summed
        loads = dict((j, s[:, :E]) for j, s in per_layer)
        parts = [
            stats[:, j * E : (j + 1) * E] + loads[j] if j in loads else stats[:, j * E : (j + 1) * E]
            for j in range(cfg.moe_layers)
        ]
        tail = stats[:, -2:]
        for _, s in per_layer:
            tail = tail + s[:, E:]
        return torch.cat([*parts, tail], dim=-1)
    for _, s in per_layer:
        stats = stats + s
    return stats


def pipeline_sizes(cfg, world: int) -> tuple[int, int, str]:
    """(stages, data-parallel ways, their axis).

    parallel.mesh's pp and dp (DDP per stage) or fsdp (FSDP2 per stage), or every rank a stage.
    """
    if not cfg.parallel.mesh:
        return world, 1, "dp"
    sizes = resolve_sizes(parse_mesh(cfg.parallel.mesh), world)
    return (sizes["pp"], sizes["fsdp"], "fsdp") if sizes["fsdp"] > 1 else (sizes["pp"], sizes["dp"], "dp")


def check_torch_pipeline(cfg, world: int) -> int:
    """The number of pipeline microbatches; one-line errors for what the backend cannot run."""
    p, t = cfg.parallel, cfg.train
    schedule = concrete(p.pipeline_schedule)  # auto unresolved (a library call): what the engine runs
    S, D, axis = pipeline_sizes(cfg, world)
    if cfg.parallel.mesh and min(resolve_sizes(parse_mesh(cfg.parallel.mesh), world)[a] for a in ("dp", "fsdp")) > 1:
        raise UserError(
            f"parallel.mesh={cfg.parallel.mesh}: --backend pipeline runs pp with dp (DDP per stage) or "
            "with fsdp (FSDP2 per stage), not both"
        )
    M = resolve_microbatches(S, p.pipeline_microbatches)
    check_schedule(schedule, S, M, p.pipeline_virtual_stages, cfg.model.n_layer)
    if schedule == "interleaved" and p.pipeline_virtual_stages < 2:
        raise UserError(
            "--backend pipeline: the interleaved schedule needs parallel.pipeline_virtual_stages >= 2 "
            "(torch's ScheduleInterleaved1F1B runs two or more stages per rank)"
        )
    if D > 1 and axis == "fsdp" and schedule not in ("gpipe", "1f1b"):
        # interleaved, zb_v: two stages per rank around one sharded module (not built); zb_h1: its weight pass runs
        # outside FSDP2's post-backward hooks, so the gradients are not reduce-scattered (wrong from step 2)
        raise UserError(
            f"--backend pipeline: parallel.mesh with fsdp={D} runs parallel.pipeline_schedule=gpipe or "
            f"1f1b (FSDP2 inside the stages), not {schedule}"
        )
    if D > 1 and axis == "dp" and schedule != "1f1b":
        # zb_h1's weight pass bypasses DDP's gradient hooks (docs/fuzz.md, case 99); gpipe/interleaved failed in
        # DDP's bucket rebuild, whose cause hold_sync removes (not yet tested under pp x dp: still refused)
        raise UserError(
            f"--backend pipeline: parallel.mesh with dp={D} runs parallel.pipeline_schedule=1f1b only "
            f"(got {schedule}: DDP inside torch's pipeline stages is not correct with it)"
        )
    if D > 1 and axis == "fsdp" and cfg.model.moe_experts and cfg.model.moe_bias_update:
        raise UserError(
            f"--backend pipeline: model.moe_bias_update with fsdp={D}: each stage moves its layers' "
            "balance bias on whole parameters, which FSDP2 shards (pp x dp or pp alone runs it)"
        )
    if cfg.model.mtp_depth and (schedule in ("zb_h1", "zb_v", "dualpipev") or (D > 1 and axis == "fsdp")):
        raise UserError(
            f"--backend pipeline: model.mtp_depth runs on gpipe, 1f1b or interleaved, pp alone or pp x dp "
            f"(got {schedule}" + (f", fsdp={D}" if D > 1 else "") + "): the prediction modules run in the "
            "last stage's loss function, outside the stage; zero-bubble's split backward fails with them, "
            "FSDP2 inside the stages is not verified with them"
        )
    if schedule in ("zb_h1", "zb_v", "dualpipev") and cfg.model.remat == "save_matmuls":
        raise UserError(
            f"--backend pipeline: parallel.pipeline_schedule={schedule} splits each backward "
            "into an input and a weight pass, and torch's selective checkpoint (model.remat=save_matmuls) "
            "allows one backward per region; use model.remat=full or none"
        )
    micro = t.global_batch_size // t.microbatches
    if micro % (M * D):
        raise UserError(
            f"batch per microbatch {micro} is not divisible by parallel.pipeline_microbatches={M}"
            + (f" x {axis}={D}" if D > 1 else "")
        )
    return M


class PipelineEngine(TorchEngine):
    def __init__(self, stage: Stage, chunks: list[nn.Module], cfg, env, M: int, place: Replicas):
        super().__init__(stage, stage, cfg, env, full_state=self._gather_state)
        # every stage of a replica reads the replica's share of the batch; only the last has the loss
        self.data_rank, self.data_ways = place.replica, place.replicas
        self.M, self.stage_module, self.scale, self.pp_group = M, stage, 1.0, place.pp_group
        # with experts: the balance loss counts, the step's statistics; with MTP: each depth's losses of the step
        self.training, self.step_stats, self.step_depths = True, [], []
        # the chunk that holds the model's last virtual stage, when this rank has it (DDP's: the module inside)
        self.last_chunk = next((getattr(c, "module", c) for c in chunks if getattr(c, "module", c).last), None)
        S, schedule = place.stages, concrete(cfg.parallel.pipeline_schedule)
        stages = [
            PipelineStage(
                chunk, virtual_stage(schedule, S, place.stage, c), S * len(chunks), env.device, group=place.pp_group
            )
            for c, chunk in enumerate(chunks)
        ]
        self.schedule = SCHEDULES[schedule](
            stages if schedule in MULTI else stages[0], M, loss_fn=self._loss, scale_grads=False
        )
        self.tied = None  # the first and last stage of each replica (every rank must call new_group)
        ends_at = {placement(schedule, S, v)[0] for v in (0, S * len(chunks) - 1)}  # zb_v: both on stage 0
        for replica in range(place.replicas):
            ends = sorted(replica * S + e for e in ends_at)
            shared = cfg.model.tie_embeddings or cfg.model.mtp_depth  # the last stage's wte: its head's, MTP's lookups
            group = tdist.new_group(ends) if len(ends) == 2 and shared else None
            if replica == place.replica:
                self.tied = group
        # wte's gradient counts once in the global norm: on the first stage only
        self.norm_params = [p for n, p in stage.named_parameters() if not (n == "wte" and not stage.first)]

    def _loss(self, out, target: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of a pipeline microbatch, times the step's scale.

        With experts, in training, plus their balance loss (as microbatch_loss), their statistics kept for the
        step; with multi-token prediction, in training, plus mtp_loss_weight x the depths' mean, each depth's
        loss (scaled as the loss) kept.
        """
        m = self.cfg.model
        x, stats = out if m.moe_experts else (out, None)
        if m.mtp_depth:  # `target`: the microbatch's rows, for the depths' tokens and targets
            loss, depths = self.last_chunk.mtp_loss(x, target, self.training)
            if depths is not None:
                self.step_depths.append(depths.detach() * self.scale)
                loss = loss + m.mtp_loss_weight * depths.mean()
        else:
            loss = self.last_chunk.head_loss(x, target)
        if stats is not None and self.training:
            summed = stats.detach().sum(0)
            summed[-1] /= m.moe_layers
            self.step_stats.append(torch.cat([summed, summed.new_tensor([stats.shape[0]])]))
            loss = loss + m.moe_aux_loss * stats[:, -1].mean() / m.moe_layers
        return loss * self.scale

    def _order(self, batch: torch.Tensor) -> torch.Tensor:
        """Rows so that contiguous chunk m holds rows m, m+M, ... (jaxpar's microbatch m)."""
        return batch.reshape(-1, self.M, batch.shape[-1]).transpose(0, 1).reshape(batch.shape)

    def _run(self, batch: torch.Tensor, train: bool) -> float:
        rows, s = self._order(batch), self.stage_module
        inputs, targets = inputs_and_targets(rows)
        args = (inputs,) if s.first else ()
        # multi-token prediction's loss reads the rows' tokens too: the whole ordered rows as the target
        target = rows if self.cfg.model.mtp_depth else targets
        kwargs = {"target": target, "losses": []} if s.last else {}
        kept = (len(self.step_stats), len(self.step_depths))
        (self.schedule.step if train else self.schedule.eval)(*args, **kwargs)
        if s.last and self.training:  # the first step's metadata inference (a real forward and loss) ran the loss
            # function once more before the microbatches: their records are the last ones
            for records, k in zip((self.step_stats, self.step_depths), kept):
                if len(records) > k:  # a record kept this step (experts, MTP)
                    records[k:] = records[len(records) - len(kwargs["losses"]) :]
        return float(sum(kwargs["losses"])) if s.last else 0.0

    def forward_backward(self, micro: list[torch.Tensor], share: float = 1.0) -> torch.Tensor:
        self.scale = share / (self.M * len(micro))  # mean over all microbatches of the step
        self.training, self.step_stats, self.step_depths = True, [], []
        total = sum(self._run(batch, train=True) for batch in micro)
        if self.cfg.model.mtp_depth:  # the last stage's; zeros elsewhere (read_metrics sums them over the ranks)
            self.mtp_losses = (
                sum(self.step_depths)
                if self.step_depths
                else torch.zeros(self.cfg.model.mtp_depth, device=self.env.device)
            )
        if self.cfg.model.moe_experts:  # the last stage's; zeros elsewhere (read_metrics sums them over the ranks)
            self.expert_stats = (
                sum(self.step_stats)
                if self.step_stats
                else torch.zeros(stats_width(self.cfg.model) + 1, device=self.env.device)
            )
        if self.tied is not None and (self.stage_module.first or self.stage_module.last):
            tdist.all_reduce(local(self.stage_module.wte.grad), group=self.tied)  # FSDP2: the matching shards
        return torch.tensor(total)

    def clip_gradients(self, clip: float) -> torch.Tensor:
        grads = [p.grad for p in self.norm_params if p.grad is not None]
        zero = torch.zeros((), device=self.env.device)
        squared = local(torch.nn.utils.get_total_norm(grads)).square() if grads else zero
        tdist.all_reduce(squared, group=self.pp_group)  # the stages' squared norms: the global norm
        norm = squared.sqrt()
        torch.nn.utils.clip_grads_with_norm_(self.params, clip, norm)
        return norm

    def eval_loss(self, batch: torch.Tensor, share: float = 1.0) -> float:
        self.scale, self.training = share / self.M, False  # the cross-entropy alone, as the other backends
        if self.cfg.parallel.pipeline_schedule in ("zb_v", "dualpipev"):
            # torch 2.13's ScheduleZBVZeroBubble.eval (ScheduleDualPipeV's too) runs the backward actions' local
            # hand-off at the V's turn with no backward ("can't steal_bwd_input"): evaluate with a training pass, its
            # gradients dropped
            loss = self._run(batch, train=True)
            self.optimizer.zero_grad(set_to_none=True)
            return loss
        with torch.no_grad():
            return self._run(batch, train=False)

    def move_router_bias(self, loads: list[float]) -> None:
        """Move the balance bias of this stage's expert layers by the layers' loads.

        Each layer's bias moves by its row of every layer's loads (summed over the ranks): moe.update_router_bias's
        rule on the layers this rank holds.
        """
        m = self.cfg.model
        loads = torch.tensor(loads, dtype=torch.float32).reshape(m.moe_layers, m.moe_experts)
        step = m.moe_bias_update * torch.sign(loads.mean(-1, keepdim=True) - loads)
        with torch.no_grad():
            for name, block in self.stage_module.blocks.items():
                if hasattr(block, "moe"):
                    bias = block.moe.router.bias
                    bias.add_(step[int(name) - m.moe_first_dense].to(bias.device))

    def _gather_state(self) -> dict:
        """Every stage's parameters gathered to rank 0 (a collective), by whole-model name."""
        mine = {k: whole(v).detach().cpu() for k, v in self.stage_module.state_dict().items()}
        parts = [None] * self.env.world if self.env.is_main else None
        tdist.gather_object(mine, parts, dst=0)
        return {k: v for part in parts for k, v in part.items()} if self.env.is_main else {}


@dataclasses.dataclass
class Replicas:
    """Where this rank sits.

    Stage `stage` of `stages` in pipeline replica `replica` of `replicas` (rank = replica * stages + stage, a 2-D
    DeviceMesh ("dp", "pp")); the groups its pipeline and its gradient all-reduce run in (None: the default group /
    no data parallelism).
    """

    stages: int
    replicas: int
    stage: int
    replica: int
    pp_group: object = None
    dp_group: object = None
    axis: str = "dp"  # what the replicas are: DDP ("dp") or FSDP2 shards ("fsdp")
    data_mesh: object = None  # the 1-D DeviceMesh over them (FSDP2's)


def place_rank(cfg, env) -> Replicas:
    S, D, axis = pipeline_sizes(cfg, env.world)
    if D == 1:
        return Replicas(S, 1, env.rank, 0)
    mesh = init_device_mesh(env.device.type, (D, S), mesh_dim_names=(axis, "pp"))
    return Replicas(
        S,
        D,
        mesh.get_local_rank("pp"),
        mesh.get_local_rank(axis),
        mesh.get_group("pp"),
        mesh.get_group(axis),
        axis,
        mesh[axis],
    )


def build(model: Decoder, cfg, env, **_):
    M = check_torch_pipeline(cfg, env.world)
    place = place_rank(cfg, env)
    p = cfg.parallel
    L, S, s, V = (
        cfg.model.n_layer,
        place.stages,
        place.stage,
        chunks_per_rank(p.pipeline_schedule, p.pipeline_virtual_stages),
    )
    k, last = L // (S * V), S * V - 1
    virtual = [virtual_stage(p.pipeline_schedule, S, s, c) for c in range(V)]  # this rank's virtual stages
    chunks = [Stage(model, list(range(v * k, (v + 1) * k)), v == 0, v == last) for v in virtual]
    rank = Stage(model, [i for v in virtual for i in range(v * k, (v + 1) * k)], 0 in virtual, last in virtual)
    rank.to(env.device)
    if place.replicas > 1 and place.axis == "fsdp":  # FSDP2 per stage (each block, then the stage), torchtitan's way
        for block in chunks[0].blocks.values():
            fully_shard(block, mesh=place.data_mesh)
        fully_shard(chunks[0], mesh=place.data_mesh)
        if chunks[0].last:  # its head and loss run outside its forward, with the weights gathered as in it
            register_fsdp_forward_method(chunks[0], "head_loss")
        rank = chunks[0]  # one chunk per rank (check_torch_pipeline): the sharded module is the rank's
    elif place.replicas > 1:  # DDP per chunk over dp; the pipeline stage runs its all-reduce on the last backward
        ids = [env.device.index] if env.device.type == "cuda" else None
        chunks = [DDP(chunk, device_ids=ids, process_group=place.dp_group) for chunk in chunks]
        for chunk in chunks:
            hold_sync(chunk)
    return PipelineEngine(rank, chunks, cfg, env, M, place)


def hold_sync(ddp: DDP) -> None:
    """Leave DDP's all-reduce to the stage's last backward (PipelineStage arms the reducer there itself).

    The stage runs its microbatch forwards under no_sync, but torch 2.13's shape inference at the first step calls
    the DDP module outside it, which arms the reducer: the first step's earlier backwards then all-reduced too and
    each fed DDP's one-time bucket rebuild, which with every backward before the next forward (stage 0 when
    pipeline_microbatches == stages) saw each parameter twice and failed an internal assert.
    """
    ddp.require_backward_grad_sync = False  # what no_sync sets; the forward then never arms the reducer
