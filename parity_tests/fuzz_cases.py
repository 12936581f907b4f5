"""The space the layout fuzzer (parity_tests/fuzz.py) draws from (what the docs say of it: fuzz_docs.py).

A case is a jaxpar mesh over dp/fsdp/tp/pp/sp/ep (up to 8 simulated devices) or a torchpar backend and world
size, plus config settings over a tiny base config (BASE), drawn hierarchically: a mode's keys only when
the mode is on (pipeline keys with pp > 1 or the pipeline backend, sequence keys with sp > 1, ZeRO with
dp > 1 or fsdp/deepspeed, a variant's keys with that variant), with sizes the mesh divides, so that every
draw is a run the docs promise -- or, now and then on purpose, one they say is refused. `normalize` is the
same hierarchy for the shrinker (parity_tests/fuzz_modes.py): it drops the keys of a mode a simpler case no
longer runs.
"""

from __future__ import annotations

import math
import random
import zlib
from dataclasses import dataclass

from parity_tests.fuzz_modes import MODE_KEYS, normalize  # noqa: F401  the hierarchy, imported from here too
from parity_tests.fuzz_mtp import with_mtp

STEPS = 3
# the tiny model of tests/helpers.py, STEPS steps, nothing but the training steps. lr 3e-3 as configs/parity/,
# and Adam's eps 1e-6: a gradient element near zero (|g| ~ eps) turns a float32 rounding difference dg into an
# update difference of ~lr*dg/eps, with eps 1e-8 past the per-tensor bound (docs/fuzz.md: seed 26001 cases 1, 78)
BASE = (
    "model.n_layer=2",
    "model.n_head=4",
    "model.d_model=32",
    "model.max_seq_len=32",
    "data.seq_len=16",
    "train.global_batch_size=8",
    f"train.steps={STEPS}",
    "optim.warmup_steps=3",
    "optim.lr=3e-3",
    "optim.min_lr=3e-4",
    "optim.eps=1e-6",
    "data.val_fraction=0.1",
    "train.eval_batches=1",
    "train.log_every=1",
    "train.eval_every=0",
    "checkpoint.every=0",
    "train.matmul_precision=highest",
)
TORCH_SHARE = 0.25  # torchpar cases are subprocesses (seconds to start): drawn less often
EXPERT_SHARE = 0.2  # cases with a mixture of experts (jaxpar: with ep in the mesh now and then)
MUON_SHARE = 0.2  # cases with optim.name=muon
DILOCO_SHARE = 0.15  # cases with DiLoCo's groups: around a jaxpar mesh, or over a torchpar launch's ranks
EIGHT_BIT_SHARE = 0.15  # cases with optim.name=adamw8bit
ROUTING_SHARE = 0.5  # of the expert cases: DeepSeek-V3's expert groups and routed scale
SPARSITY_SHARE = 0.5  # of the dilated cases: block-sparse dilated attention
AUTO_SHARE, PIPELINE_SCHEDULE_KEYS = 0.3, ("parallel.pipeline_schedule", "parallel.pipeline_virtual_stages")  # auto


@dataclass(frozen=True)
class Case:
    """`jax dp=2,tp=2 k=v ...` or `torch fsdp:2 k=v ...` (backend:world size; world 0 = one plain process)."""

    side: str
    layout: str  # jax: the mesh ("dp=1" for one device); torch: "backend:nproc"
    settings: tuple[tuple[str, str], ...] = ()

    @staticmethod
    def parse(spec: str) -> "Case":
        from jaxpar.core.errors import UserError

        side, layout, *rest = spec.split() + [""] * (2 - len(spec.split()))
        if side not in ("jax", "torch") or not layout:
            raise UserError(f"case {spec!r}: expected 'jax MESH k=v ...' or 'torch BACKEND:NPROC k=v ...'")
        pairs = [item.partition("=") for item in rest]
        unknown = [k for k, eq, _ in pairs if not eq or k not in _schema_keys()]
        if unknown:
            raise UserError(f"case {spec!r}: {unknown[0]!r} is not a section.key=value setting of the config schema")
        return Case(side, layout, tuple((k, v) for k, _, v in pairs))

    @property
    def spec(self) -> str:
        return " ".join([self.side, self.layout, *self.overrides])

    @property
    def overrides(self) -> list[str]:
        return [f"{k}={v}" for k, v in self.settings]

    def get(self, key: str, default=None):
        return dict(self.settings).get(key, default)

    def mesh(self) -> dict[str, int]:
        """Axis sizes (every axis); torch: parallel.mesh, else all ranks on the backend's data axis."""
        sizes = dict.fromkeys(("diloco", "dp", "fsdp", "tp", "pp", "sp", "ep"), 1)
        if self.side == "jax":
            spec = self.layout
        else:
            world = max(self.world, 1)
            spec = self.get("parallel.mesh") or f"{'pp' if self.backend == 'pipeline' else 'dp'}={world}"
        for part in spec.split(","):
            axis, _, n = part.partition("=")
            sizes[axis] = int(n)
        return sizes

    @property
    def backend(self) -> str:
        return self.layout.partition(":")[0]

    @property
    def world(self) -> int:
        return int(self.layout.partition(":")[2] or 0)

    def with_settings(self, settings) -> "Case":
        return Case(self.side, self.layout, tuple(settings))


def _schema_keys() -> set[str]:
    import dataclasses

    from jaxpar.core.config.schema import Config

    return {f"{name}.{f.name}" for name, section in vars(Config()).items() for f in dataclasses.fields(section)}


# ----------------------------------------------------------------------------------------------- drawing


def _pick(rng: random.Random, weighted: dict):
    return rng.choices(list(weighted), weights=list(weighted.values()))[0]


def draw_case(rng: random.Random, torch_share: float = TORCH_SHARE) -> Case:
    case = with_auto(with_mtp(with_routing(with_optimizer((draw_jax, draw_torch)[rng.random() < torch_share](rng)))))
    return with_sparsity(case)


def with_auto(case: Case) -> Case:
    on = case.mesh()["pp"] > 1 if case.side == "jax" else case.backend == "pipeline"
    on = on and random.Random(zlib.crc32(b"auto " + case.spec.encode())).random() < AUTO_SHARE
    return case.with_settings(tuple(kv for kv in case.settings if kv[0] not in PIPELINE_SCHEDULE_KEYS)) if on else case


def with_routing(case: Case) -> Case:
    """DeepSeek-V3's routing in a share of the expert cases.

    The experts in 2 or 4 groups of two or more, fewer groups kept than there are, and/or the weights scaled. Drawn
    from the case's own spec (as with_optimizer, after it), so the cases a seed drew before stay what they were, but
    for these keys.
    """
    E = int(case.get("model.moe_experts", "0"))
    rng = random.Random(zlib.crc32(b"routing " + case.spec.encode()))
    if not E or rng.random() >= ROUTING_SHARE:
        return case
    s = {}
    if rng.random() < 0.8:
        groups = rng.choice([g for g in (2, 4) if E % g == 0 and E // g >= 2])
        s["model.moe_n_group"] = str(groups)
        s["model.moe_topk_group"] = str(rng.randrange(1, groups))  # top_k <= 2 <= any group's experts
    if rng.random() < 0.5:
        s["model.moe_routed_scale"] = "2.5"
    return case.with_settings(sorted(_drop_defaults({**dict(case.settings), **s}).items()))


def with_sparsity(case: Case) -> Case:
    """Block-sparse dilated attention in a share of the dilated cases.

    Blocks are a quarter of every pair's row (4 tokens at data.seq_len=16, else 8). Drawn from the case's own spec,
    last: the cases a seed drew stay what they were, but for these keys.
    """
    rng = random.Random(zlib.crc32(b"sparsity " + case.spec.encode()))
    if case.get("model.attention") != "dilated" or rng.random() >= SPARSITY_SHARE:
        return case
    s = {
        "model.sparsity_ratio": rng.choice(["0.25", "0.5"]),
        "model.sparsity_seed": str(rng.randrange(1000)),
        "model.sparsity_block": str(int(case.get("data.seq_len", "16")) // 16),
    }
    return case.with_settings(sorted({**dict(case.settings), **s}.items()))


def with_optimizer(case: Case, share: float = MUON_SHARE) -> Case:
    """The Muon or 8-bit AdamW optimizer in a share of the cases.

    optim.name=muon in a share of the cases and adamw8bit in another (not on deepspeed, which builds its own
    AdamW), Muon's keys now and then. Drawn from the case's own spec, not the sweep's stream: the cases a seed drew
    before stay what they were, but for the 8-bit share of those that stayed on AdamW.
    """
    rng = random.Random(zlib.crc32(case.spec.encode()))
    draw = rng.random()
    if case.backend == "deepspeed" or share <= draw < 1 - EIGHT_BIT_SHARE:
        return case
    if draw >= share:
        return case.with_settings(sorted({**dict(case.settings), "optim.name": "adamw8bit"}.items()))
    s = {"optim.name": "muon"}
    if rng.random() < 0.3:
        s["optim.muon_lr_rule"] = "original"
    if rng.random() < 0.3:
        s["optim.muon_ns_steps"] = str(rng.choice((3, 7)))
    if rng.random() < 0.3:
        s["optim.muon_momentum"] = "0.9"
    return case.with_settings(sorted({**dict(case.settings), **s}.items()))


def draw_jax(rng: random.Random) -> Case:
    sizes = dict.fromkeys(("dp", "fsdp", "tp", "pp", "sp", "ep"), 1)
    experts = rng.random() < EXPERT_SHARE
    for _ in range(_pick(rng, {1: 3, 2: 4, 3: 2})):  # 2, 4 or 8 devices, a factor of 2 at a time
        sizes[_pick(rng, {"dp": 3, "fsdp": 3, "tp": 3, "pp": 2, "sp": 2, "ep": 3 if experts else 0})] *= 2
    s: dict[str, str] = {}
    attention = _draw_model_kind(rng, s, experts)
    if experts:
        _draw_experts(rng, s, sizes["ep"])
    if sizes["dp"] > 1:
        s["parallel.zero_stage"] = str(rng.randrange(4))
    stages_v, M = _draw_pipeline(rng, s, sizes["pp"]) if sizes["pp"] > 1 else (1, 1)
    heads_div = sizes["tp"]
    if sizes["sp"] > 1 and attention != "dilated":  # dilated attention runs its own segments under sp
        s["parallel.sequence_attention"] = _pick(rng, {"ring": 2, "all_gather": 1, "ulysses": 1})
        if s["parallel.sequence_attention"] == "ulysses":
            heads_div *= sizes["sp"]
        if rng.random() < 0.3:
            s["parallel.sequence_zigzag"] = "false"
    _draw_dims(rng, s, heads_div, stages_v)
    data_ways = sizes["dp"] * sizes["fsdp"] * sizes["ep"] * M
    need = _draw_training(rng, s, data_ways)
    gpipe = sizes["pp"] > 1 and s.get("parallel.pipeline_schedule") == "gpipe"
    capacity_zigzag = "model.moe_capacity_factor" in s and sizes["sp"] > 1  # refused with documents (checks.py)
    _draw_data(
        rng,
        s,
        need,
        documents=attention != "dilated" and not gpipe and not capacity_zigzag,
        buckets=sizes["sp"] == 1 and attention != "dilated",
    )
    if rng.random() < 0.2:  # the CPU scans the layers by default; a GPU unrolls them
        s["train.scan_layers"] = "off"
    if rng.random() < 0.2:
        s["parallel.offload"] = _pick(rng, {"optimizer": 1, "params+optimizer": 1})
    if sizes["dp"] * sizes["fsdp"] > 1 and rng.random() < 0.15 and not experts:
        _draw_compression(rng, s)
    if experts and rng.random() < 0.3:  # on every schedule (the executor runs the dense stack on its first stage)
        _draw_first_dense(rng, s, stages_v)
    if experts and rng.random() < 0.25:
        s["model.moe_bias_update"] = _pick(rng, {"0.001": 1, "0.01": 1})
    if rng.random() < DILOCO_SHARE:
        sizes = _draw_diloco(rng, s, sizes, data_ways)
    mesh = ",".join(f"{a}={n}" for a, n in sizes.items() if n > 1) or "dp=1"
    return Case("jax", mesh, tuple(sorted(_drop_defaults(s).items())))


def draw_torch(rng: random.Random) -> Case:
    backend = _pick(rng, {"none": 2, "ddp": 3, "fsdp": 3, "deepspeed": 3, "pipeline": 3})
    s: dict[str, str] = {}
    experts = rng.random() < EXPERT_SHARE
    _draw_model_kind(rng, s, experts)
    if experts:
        _draw_experts(rng, s, 1)
    world, ways, stages_v = {"none": 0}.get(backend, _pick(rng, {2: 4, 4: 1})), 1, 1
    if backend in ("ddp", "fsdp", "deepspeed"):
        ways = world
        if backend == "ddp" and rng.random() < 0.1:  # docs: ddp refuses ZeRO
            s["parallel.zero_stage"] = str(rng.randrange(1, 4))
        if backend != "ddp":
            s["parallel.zero_stage"] = str(rng.randrange(4))
        if backend == "fsdp" and world == 4 and rng.random() < 0.5:
            s["parallel.mesh"] = "dp=2,fsdp=2"  # HSDP
        if backend == "ddp" and experts and rng.random() < 0.5:  # the experts split over the ranks (4 or 8 of them)
            s["parallel.mesh"] = f"ep={world}" if world == 2 or rng.random() < 0.5 else "dp=2,ep=2"
        if rng.random() < {"ddp": 0.05, "fsdp": 0.1, "deepspeed": 0.3}[backend]:  # ddp, fsdp on CPU: refused
            s["parallel.offload"] = _pick(rng, {"optimizer": 1, "params+optimizer": 1})
    if backend in ("ddp", "fsdp", "deepspeed") and rng.random() < 0.1 and not experts:  # fsdp, deepspeed: PowerSGD
        _draw_compression(rng, s, {"powersgd": 1})
    if backend == "pipeline":
        D = 2 if world == 4 and rng.random() < 0.5 else 1
        axis = _pick(rng, {"dp": 1, "fsdp": 1})
        if D > 1:
            s["parallel.mesh"] = f"pp={world // D},{axis}={D}"
        # torchpar's pp x dp runs 1f1b only, pp x fsdp gpipe and 1f1b (docs/torchpar.md); the others are drawn now
        # and then, refused
        stages_v, M = _draw_pipeline(
            rng,
            s,
            world // D,
            None
            if D == 1
            else {"gpipe": 1, "1f1b": 8, "interleaved": 1}
            if axis == "dp"
            else {"gpipe": 3, "1f1b": 6, "zb_h1": 1},
        )
        ways = D * M
    _draw_dims(rng, s, 1, stages_v)
    need = _draw_training(rng, s, ways)
    if backend != "pipeline":  # one batch shape and no document mask there (docs/torchpar.md)
        dilated = s.get("model.attention") == "dilated"
        _draw_data(rng, s, need, documents=not dilated, buckets=not dilated)
    if experts and rng.random() < 0.3:
        _draw_first_dense(rng, s, 1)
    sharded = backend in ("fsdp", "deepspeed") or "fsdp=" in s.get("parallel.mesh", "")
    if experts and not sharded and rng.random() < 0.25:  # fsdp (pp x fsdp too) and deepspeed refuse the bias
        s["model.moe_bias_update"] = _pick(rng, {"0.001": 1, "0.01": 1})
    if backend in ("ddp", "fsdp") and "parallel.mesh" not in s and rng.random() < DILOCO_SHARE:
        _draw_torch_diloco(rng, s, backend, world)
    return Case("torch", f"{backend}:{world}", tuple(sorted(_drop_defaults(s).items())))


def _draw_diloco(rng: random.Random, s: dict, sizes: dict, data_ways: int) -> dict:
    """DiLoCo's groups (diloco=2) around the drawn mesh, where they fit: at most 8 devices, every batch split in two.

    The reference is then the same groups alone (fuzz_run.py); the meetings as _draw_meetings draws them.
    """
    plain = "train.batch_rampup" not in s and s.get("data.batching") != "buckets"
    refused = s.get("parallel.offload") or s.get("parallel.grad_compression") == "powersgd"  # docs/diloco.md
    rows = int(s["train.global_batch_size"]) // int(s.get("train.microbatches", "1"))
    if math.prod(sizes.values()) > 4 or not plain or refused or rows % (2 * data_ways):
        return sizes
    _draw_meetings(rng, s)
    return {"diloco": 2, **sizes}


def _draw_torch_diloco(rng: random.Random, s: dict, backend: str, world: int) -> None:
    """torchpar's DiLoCo: 2 groups of the launch's ranks (ddp or fsdp inside), where they run (docs/diloco.md).

    The reference is jaxpar's same groups alone (fuzz_run.py), so the case holds torchpar's groups to jaxpar's.
    """
    plain = "train.batch_rampup" not in s and s.get("data.batching") != "buckets"
    refused = s.get("parallel.offload") or s.get("parallel.grad_compression") == "powersgd"
    if not plain or refused or s.get("model.compute_dtype") == "float16":
        return
    inside = {"ddp": "dp", "fsdp": "fsdp"}[backend]
    s["parallel.mesh"] = "diloco=2" if world == 2 else f"diloco=2,{inside}={world // 2}"
    _draw_meetings(rng, s)


def _draw_meetings(rng: random.Random, s: dict) -> None:
    """When DiLoCo's groups meet: after every step, once at the end, or streaming's 2 fragments every 2 steps.

    Streaming over STEPS = 3: fragment 1 meets after step 1, fragment 0 after step 2, both after step 3 (the last).
    Half of the streaming cases overlap the exchange (parallel.diloco_delay=1): fragment 1's starts after step 1 and
    lands after step 2, carried by step 2's program.
    """
    s["parallel.diloco_inner_steps"] = _pick(rng, {"1": 2, str(STEPS): 2, "2": 1})
    if s["parallel.diloco_inner_steps"] == "2":
        s["parallel.diloco_fragments"] = "2"
        if rng.random() < 0.5:
            s["parallel.diloco_delay"] = "1"


def _draw_compression(rng: random.Random, s: dict, methods=None) -> None:
    """parallel.grad_compression.

    The fuzz runs compare with one device in float32, so the cases run the compressed program with nothing lost:
    PowerSGD never past its warm-up (STEPS plain steps; its compressed branch is compiled all the same), bf16
    (jaxpar only) with a float32 wire (fuzz_run.py; tests/jaxpar/test_grad_compression.py).
    """
    s["parallel.grad_compression"] = _pick(rng, methods or {"bf16": 1, "powersgd": 1})
    if s["parallel.grad_compression"] == "powersgd":
        s["parallel.powersgd_warmup_steps"] = str(STEPS + rng.randrange(2))
        s["parallel.powersgd_rank"] = str(rng.choice((1, 2, 4)))


def _draw_experts(rng: random.Random, s: dict, ep: int) -> None:
    """A mixture of experts whose count ep divides, and its routing keys."""
    experts = _pick(rng, {4: 2, 8: 1}) * ep // min(ep, 4)
    s.update(
        {
            "model.moe_experts": str(experts),
            "model.moe_top_k": str(_pick(rng, {1: 1, 2: 2})),
            "model.moe_d_ff": str(_pick(rng, {16: 1, 32: 1})),
        }
    )
    if rng.random() < 0.4:
        s["model.moe_shared_experts"] = "1"
    if rng.random() < 0.3:
        s["model.moe_router"] = "sigmoid"
    if rng.random() < 0.3:
        s["model.moe_norm_topk"] = "false"
    if rng.random() < 0.5:
        s["model.moe_aux_loss"] = "0.01"
    if rng.random() < 0.4:
        s["model.moe_capacity_factor"] = _pick(rng, {"0.5": 1, "1.0": 1, "1.5": 1})
    if rng.random() < 0.2:  # gpt-oss's experts: biases, a router logit bias, the clamped activation (a limit that acts)
        s["model.moe_expert_bias"] = "true"
        s["model.moe_activation"], s["model.moe_swiglu_limit"] = "gpt_oss", "0.05"
    if ep == 1 and rng.random() < 0.25:  # grouped matmuls over the routed rows alone (jaxpar runs them at ep=1)
        s["model.moe_ragged"] = "true"


def _draw_first_dense(rng: random.Random, s: dict, stages: int) -> None:
    """DeepSeek's dense first layers (model.moe_first_dense) before the experts' (at least one).

    Under a pipeline both stacks split over the stages (gpipe; the executor splits the expert stack over its virtual
    stages), so half of 2 x stages layers.
    """
    s.pop("model.full_attention_every", None)  # the stacks need not be whole cycles: not drawn with dense layers
    if stages > 1:
        s["model.n_layer"], s["model.moe_first_dense"] = str(2 * stages), str(stages)
    else:
        s["model.moe_first_dense"] = str(rng.randrange(1, int(s["model.n_layer"])))


def _draw_model_kind(rng: random.Random, s: dict, experts: bool = False) -> str:
    """Family and variant (and the variant's own keys); returns model.attention. With experts no sketched MLP."""
    llama = rng.random() < 0.3
    if llama:
        s["model.family"] = "llama"
    attention = _pick(rng, {"mha": 5, "dilated": 2} if llama else {"mha": 5, "mla": 2, "dilated": 2})
    s["model.attention"] = attention
    if attention == "mla":
        s.update({"model.q_latent_dim": "16", "model.kv_latent_dim": "8", "model.rope_head_dim": "4"})
    if not llama and not experts and rng.random() < 0.25:
        s["model.linear"] = "sketched"
        s["model.sketch_ratio"] = _pick(rng, {"0.5": 1, "0.25": 1})
        if rng.random() < 0.5:
            s["model.sketch"] = "sign"
    return attention


def _draw_pipeline(rng: random.Random, s: dict, S: int, weights=None) -> tuple[int, int]:
    """Schedule, virtual stages and microbatches for S stages: (stages x virtual stages, microbatches)."""
    schedule = _pick(rng, weights or {"gpipe": 2, "1f1b": 2, "interleaved": 2, "zb_h1": 1, "zb_v": 1, "dualpipev": 1})
    s["parallel.pipeline_schedule"] = schedule
    V = 2 if schedule == "interleaved" else 1
    s["parallel.pipeline_virtual_stages"] = str(V)
    M = _pick(rng, {0: 2, S: 1, 4 * S: 1} if schedule != "dualpipev" else {0: 2, 4 * S: 1})  # dualpipev: M >= 2S
    if M:
        s["parallel.pipeline_microbatches"] = str(M)
    return S * (2 if schedule in ("zb_v", "dualpipev") else V), M or 2 * S


def _draw_dims(rng: random.Random, s: dict, heads_div: int, layers_div: int) -> None:
    """Model and sequence sizes that the mesh divides (heads by tp (x sp for Ulysses), layers by stages)."""
    d_model = _pick(rng, {32: 3, 64: 1})
    heads = [h for h in (2, 4, 8) if h % heads_div == 0 and d_model // h % 2 == 0]
    n_head = rng.choice(heads or [max(heads_div, 2)])
    n_layer = layers_div * _pick(rng, {1: 2, 2: 1}) if layers_div > 1 else _pick(rng, {2: 3, 4: 1})
    s.update({"model.d_model": str(d_model), "model.n_head": str(n_head), "model.n_layer": str(n_layer)})
    seq = _pick(rng, {16: 3, 32: 1})
    s["data.seq_len"] = str(seq)
    if s.get("model.attention") == "dilated":
        s["model.segment_lengths"], s["model.dilation_rates"] = ("4,8,16", "1,2,4") if seq == 16 else ("8,32", "1,4")
    elif rng.random() < 0.25:  # a band narrower than the row: blocks skipped on one device, a mask elsewhere
        s["model.sliding_window"] = str(_pick(rng, {4: 1, 6: 1, seq // 2 + 1: 1}))
        # gpt-oss's alternation of sliding and full layers, where each pipeline chunk holds whole pairs
        if (n_layer // layers_div) % 2 == 0 and rng.random() < 0.4:
            s["model.full_attention_every"] = "2"
    if s.get("model.family") == "llama":
        kv = [k for k in (1, 2) if n_head % k == 0 and k < n_head]
        if kv and rng.random() < 0.6:
            s["model.n_kv_head"] = str(rng.choice(kv))
        if rng.random() < 0.5:
            s["model.tie_embeddings"] = "false"
        if rng.random() < 0.4:  # Qwen3's attention: query and key norms, heads of their own width
            s["model.qk_norm"] = "true"
        if rng.random() < 0.3:
            s["model.head_dim"] = str(_pick(rng, {12: 1, 2 * d_model // n_head: 1}))
        if rng.random() < 0.2:  # gpt-oss's attention: biases on the projections, a sink logit per head
            s["model.attention_bias"] = "true"
            if s.get("model.attention") == "mha" and rng.random() < 0.7:
                s["model.attention_sinks"] = "true"
        if rng.random() < 0.2:  # YaRN over an original context shorter than the row
            s["model.rope_scaling"], s["model.rope_original_max_seq_len"] = "yarn", "8"
            s["model.rope_factor"] = _pick(rng, {"2.0": 1, "4.0": 1})
            if s.get("model.attention") == "mla":  # DeepSeek-V3's: the scores scaled too
                s["model.rope_mscale_all_dim"] = "1.0"
        if "model.moe_d_ff" not in s:  # experts of their own width leave the MLP's unused (refused if set)
            s["model.d_ff"] = str(_pick(rng, {2 * d_model: 1, 3 * d_model // 2: 1}))


def _draw_training(rng: random.Random, s: dict, ways: int) -> int:
    """Accumulation, remat, and a global batch every data split divides.

    Mostly the smallest (>= 8), one case in four twice or three times that, so that a microbatch holds more than one
    row per way (a batch-shaped input split the wrong way hid there: docs/fuzz.md); returns the divisor.
    """
    micro = _pick(rng, {1: 6, 2: 4, 4: 1})
    if micro > 1:
        s["train.microbatches"] = str(micro)
    if rng.random() < 0.4:
        s["model.remat"] = _pick(rng, {"full": 1, "save_matmuls": 1})
    need = micro * ways
    smallest = need * -(-8 // need)
    s["train.global_batch_size"] = str(smallest * _pick(rng, {1: 6, 2: 1, 3: 1 if smallest <= 16 else 0}))
    return need


def _draw_data(rng: random.Random, s: dict, need: int, documents: bool, buckets: bool) -> None:
    """How the batches are made (the fuzzer's data has short documents, fuzz_run.py).

    Documents kept apart, length buckets, or a batch-size ramp-up, each with sizes every split divides (`need`: rows
    per data way and microbatch).
    """
    if documents and rng.random() < 0.15:
        s["data.document_mask"] = "true"
    kind = _pick(rng, {"windows": 8, "buckets": 1 if buckets else 0, "ramp": 1})
    seq, batch = int(s["data.seq_len"]), int(s["train.global_batch_size"])
    if kind == "buckets":  # default lengths seq/8 .. seq: every bucket's rows a multiple of the longest's
        s["data.batching"] = "buckets"
        s["train.tokens_per_batch"] = str(seq * batch * _pick(rng, {1: 2, 2: 1}))
    elif kind == "ramp" and batch > need:
        s["train.batch_rampup"] = f"{need},{need},{_pick(rng, {batch: 1, 2 * batch: 1})}"


def _drop_defaults(s: dict) -> dict:
    """Keys at their base or schema value are left out: a case lists what it changes."""
    from jaxpar.core.config.schema import load_config

    ref = load_config(None, list(BASE))
    out = {}
    for key, value in s.items():
        section, _, name = key.partition(".")
        current = getattr(getattr(ref, section), name)
        if str(current).lower() != value.lower():
            out[key] = value
    return out
