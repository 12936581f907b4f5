"""Which comparisons run: the default selection (CI) and the full matrix (`--parity-full`).

Default: float32 on jaxpar dp=2,tp=4 and every torchpar backend; accum and remat on torchpar's one
process; the llama family on torchpar's one process and pipeline (its untied head on the last stage);
bfloat16 on both one-device sides; bfloat16 gradient reduction (compressed) on torchpar ddp against jaxpar
dp=2,tp=4; packed documents (data.document_mask) on torchpar's one process; fine-tuning data with a loss mask
(sft), batch-size ramp-up and length buckets on torchpar ddp; a mixture of experts (moe) on torchpar ddp and
DeepSeek-V2's block (mla_moe) split over torchpar's ep ranks, DeepSeek-V3's (deepseek_v3) on its one process.
Full: every config (the GPT-2 variants mla, dilated, sketched and the llama family included) on every side
(packed, rampup, buckets, moe, mla_moe and deepseek_v3: every
side but torchpar's pipeline, which refuses the first three and is left out for the experts; jaxpar ep=4,dp=2 runs the
mixtures of experts alone).

float32, accum and remat: a side against the jaxpar one-device run of the same config.
bfloat16: a side against its own float32 run (same side, `model.compute_dtype=float32`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from parity_tests.compare import BFLOAT16, FLOAT16, FLOAT32, Tolerance
from parity_tests.runner import REFERENCE, SIDES, TORCH_BACKENDS

AS_FLOAT32 = ("model.compute_dtype=float32",)
# float16 (loss scaling): jaxpar layouts and the torchpar backends with a GradScaler; DeepSpeed's fp16 needs an
# accelerator with float16 (refused on CPU, tests/torchpar/test_torchpar.py), pipeline refuses float16
FLOAT16_SIDES = ("jax:dp=8", "jax:fsdp=8", "jax:dp=2,tp=4", "torch:none", "torch:ddp", "torch:fsdp")
VARIANTS = ("mla", "dilated", "sketched", "llama")  # model variants and families (configs/parity/<name>.yaml)
# mixtures of experts: every side but torchpar's pipeline (not in the matrix)
EXPERTS = ("moe", "mla_moe", "deepseek_v3")
DENSE_SIDES = tuple(s for s in SIDES if "ep=" not in s)  # ep shards experts: a dense model refuses it


@dataclass(frozen=True)
class Case:
    config: str
    side: str
    ref_side: str
    ref_overrides: tuple[str, ...] = ()

    @property
    def tol(self) -> Tolerance:
        if self.config == "float16":
            return FLOAT16
        if self.config == "compressed":  # two frameworks' bfloat16 rounding of the reduced gradients
            return dataclasses.replace(BFLOAT16, name="bfloat16 gradient reduction")
        return BFLOAT16 if self.ref_overrides == AS_FLOAT32 else FLOAT32

    @property
    def id(self) -> str:
        return f"{self.config}-{self.side}" + ("-vs-own-float32" if self.ref_overrides else "")


def cases(full: bool = False) -> list[Case]:
    if full:
        out = [
            Case(c, s, REFERENCE)
            for c in ("float32", "accum", "remat", *VARIANTS)
            for s in DENSE_SIDES
            if s != REFERENCE
        ]
        out += [Case(c, s, REFERENCE) for c in EXPERTS for s in SIDES if s not in (REFERENCE, "torch:pp=2")]
        out += [Case("float16", s, REFERENCE) for s in FLOAT16_SIDES]
        out += [Case("packed", s, REFERENCE) for s in DENSE_SIDES if s not in (REFERENCE, "torch:pp=2")]
        out += [Case("sft", s, REFERENCE) for s in DENSE_SIDES if s != REFERENCE]
        out += [
            Case(c, s, REFERENCE)
            for c in ("rampup", "buckets")
            for s in DENSE_SIDES
            if s not in (REFERENCE, "torch:pp=2")
        ]
        out += [
            Case("compressed", s, "jax:dp=2,tp=4")
            for s in ("jax:dp=8", "jax:fsdp=8", "torch:ddp", "torch:fsdp", "torch:zero2", "torch:zero3")
        ]
        return out + [Case("bfloat16", s, s, AS_FLOAT32) for s in DENSE_SIDES]
    # jaxpar dp=8 and fsdp=8 are left to --parity-full: tests/jaxpar/test_layouts.py holds every mesh to one device;
    # so are the variants: tests/jaxpar/test_variants.py holds their loss and gradients to torchpar's.
    out = [Case("float32", s, REFERENCE) for s in ("jax:dp=2,tp=4", *TORCH_BACKENDS) if s in DENSE_SIDES]
    out += [Case(c, "torch:none", REFERENCE) for c in ("accum", "remat")]
    out += [Case("llama", s, REFERENCE) for s in ("torch:none", "torch:pp=2")]
    out += [Case("float16", "torch:none", REFERENCE)]
    out += [Case("packed", "torch:none", REFERENCE)]  # the mesh side of packed rows: tests/jaxpar/test_documents.py
    out += [Case("sft", "torch:ddp", REFERENCE)]  # each rank's and microbatch's share of the counted targets
    out += [Case(c, "torch:ddp", REFERENCE) for c in ("rampup", "buckets")]  # each rank's share of a changing batch
    out += [Case("compressed", "torch:ddp", "jax:dp=2,tp=4")]  # gradients reduced in bfloat16 on both sides
    # experts on torchpar's data ranks (their statistics and balance loss summed over ranks and microbatches) and
    # split over them (ep, with capacity); jaxpar's ep layouts against one device: tests/jaxpar/test_moe.py
    out += [Case("moe", "torch:ddp", REFERENCE), Case("mla_moe", "torch:ep=2", REFERENCE)]
    out += [Case("deepseek_v3", "torch:none", REFERENCE)]  # llama's mla, dense first layer, grouped routing
    return out + [Case("bfloat16", s, s, AS_FLOAT32) for s in (REFERENCE, "torch:none")]
