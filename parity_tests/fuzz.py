"""The layout-equivalence fuzzer: random valid configurations, each held to its one-device run.

    python -m parity_tests.fuzz --seed S --cases N [--out results.jsonl] [--start K]
    python -m parity_tests.fuzz --case "jax pp=2,tp=2 parallel.pipeline_schedule=1f1b"   (one case)

A case (parity_tests/fuzz_cases.py: what is drawn; fuzz_docs.py: what the docs promise and refuse) is a jaxpar
mesh over dp/fsdp/tp/pp/sp or a torchpar backend and world size, plus settings drawn hierarchically. It trains
`STEPS` float32 steps (matmul precision highest) and its per-step loss and gradient norm and its final
parameters are compared (parity_tests/compare.py, 1e-5) with the one-device jaxpar run of the same
model, data and training settings. jaxpar cases run in this process; torchpar cases as subprocesses
(torchrun over gloo) from the reference's exported initial weights (parity_tests/fuzz_run.py).

Outcomes: `equal`; `refused` (the trainer's one-line UserError) where the docs say so (DOCUMENTED_REFUSALS);
and three failures: `differs`, `error` (a crash, a timeout), `refused-promised` (refused, but no line of
the docs says it is, and PROMISES say it works). A failure is shrunk (settings back to their defaults,
mesh axes halved, torch backends to `none`) while it still fails the same way, and printed as a
command. Each failure found becomes an entry of REGRESSIONS, which tests/e2e/test_fuzz.py runs.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections import Counter

from jaxpar.core.errors import cli
from parity_tests.fuzz_cases import BASE, TORCH_SHARE, Case, draw_case, normalize
from parity_tests.fuzz_run import TIMEOUT_S, Outcome, Worker
from parity_tests import fuzz_transitions
from parity_tests.fuzz_transitions import Transition, draw_transition, parse_any

TRANSITION_SHARE = 0.3  # of the draws: a run that changes half-way (fuzz_transitions.py)

# Each failure a sweep found (docs/fuzz.md): (case, what it found). tests/e2e/test_fuzz.py runs them all: each must
# be equal now, or refused as documented.
REGRESSIONS = (
    (
        "jax pp=2 data.seq_len=32 model.d_model=64 model.n_head=2 model.n_layer=4",
        "seed 26001 case 1 (lr 1e-2, eps 1e-8): blocks.attn.out.kernel 7.6e-5 off (bound 5e-5), Adam amplifying "
        "float32 rounding; the base config's lr and eps since (fuzz_cases.BASE)",
    ),
    (
        "jax pp=2 model.d_ff=48 model.family=llama model.n_head=8 model.n_kv_head=1 model.tie_embeddings=false "
        "train.global_batch_size=16 train.microbatches=2",
        "seed 26001 case 78 (eps 1e-8): wte[165, 29] 1.5e-4 off, its gradient 9.5e-9 vs 9.8e-9 (|g| ~ eps); the "
        "base config's eps since",
    ),
    (
        "jax dp=2,pp=2 parallel.pipeline_schedule=1f1b parallel.zero_stage=2",
        "seed 26001 case 91 (shrunk): ZeRO-2 on the hand-scheduled pipeline deadlocked a collective-permute that "
        "XLA placed inside one tick's branch; fixed by pinning the executor's gradients (jaxpar/step.py)",
    ),
    (
        "jax dp=2,fsdp=2,pp=2 model.attention=dilated model.dilation_rates=1,2,4 model.segment_lengths=4,8,16 "
        "parallel.pipeline_schedule=1f1b parallel.zero_stage=2 train.global_batch_size=32 train.microbatches=2",
        "seed 26001 case 91 as drawn",
    ),
    (
        "jax dp=2,tp=2,pp=2 model.linear=sketched parallel.pipeline_schedule=zb_h1 parallel.zero_stage=3",
        "seed 26003 case 26 (shrunk): sketched layers on the hand-scheduled pipeline with tp and ZeRO-3 (or fsdp) "
        "deadlocked a collective-permute inside a tick's branch; refused now (jaxpar/checks.py)",
    ),
    (
        "torch pipeline:4 parallel.mesh=pp=2,dp=2 parallel.pipeline_schedule=gpipe",
        "seed 26001 case 99 (shrunk): pp x dp with gpipe stopped at step 2 in DDP's _rebuild_buckets; refused now",
    ),
    (
        "torch pipeline:4 parallel.mesh=pp=2,dp=2 parallel.pipeline_schedule=zb_h1",
        "seed 26001 case 99's schedule: pp x dp with zb_h1 trained with un-averaged gradients; refused now",
    ),
    (
        "jax fsdp=2,tp=2,pp=2 model.attention=mla model.kv_latent_dim=8 model.n_layer=4 model.q_latent_dim=16 "
        "model.rope_head_dim=4 parallel.pipeline_schedule=zb_v",
        "2026-11-24, zb_v's cases (shrunk): MLA on the hand-scheduled pipeline (1f1b, zb_h1 too) with tp and fsdp (or "
        "ZeRO-3) deadlocked a collective-permute inside a tick's branch, as sketched layers did; refused now",
    ),
    (
        "torch pipeline:2 model.n_layer=4 model.remat=save_matmuls parallel.pipeline_schedule=zb_v",
        "2026-11-24, zb_v's cases (shrunk): torch's B/W split backs through a selective-checkpoint region twice "
        "(zb_h1 too); refused now",
    ),
    (
        "torch ddp:4 data.batching=buckets train.microbatches=2 train.tokens_per_batch=128",
        "first draws of length buckets (2026-11-25): differed, the one-device reference (tests/helpers.run_steps) read "
        "windows whatever data.batching said; it reads the trainer's batches since",
    ),
    (
        "torch fsdp:2 model.linear=sketched model.n_layer=4 model.sketch=sign parallel.zero_stage=2 "
        "train.batch_rampup=2,2,8",
        "first draws of train.batch_rampup (2026-11-25): differed, the reference read fixed batches (as above)",
    ),
    (
        "torch none:0 model.moe_experts=4 model.moe_d_ff=16 model.moe_first_dense=1 model.moe_aux_loss=0.01",
        "2026-11-26, model.moe_first_dense's first cases (fsdp:2, deepspeed:2, ddp:4 with ep, shrunk to one process): "
        "torchpar divided the balance loss by every layer, jaxpar by the expert layers; loss 9.5e-4 off",
    ),
    (
        "torch deepspeed:2 parallel.zero_stage=2 | 2 | torch deepspeed:2 parallel.zero_stage=2 train.steps=5",
        "2026-11-26, the first transition (issue 44's report): DeepSpeed's restored scheduler kept the old horizon, "
        "lr at step 5 3.0e-4 where one device has 1.65e-3, parameters 1.1e-2 off; held by "
        "tests/torchpar/test_deepspeed.py (resumed with train.steps and optim.lr changed)",
    ),
    (
        "torch pipeline:4 parallel.mesh=pp=2,dp=2 parallel.pipeline_schedule=1f1b parallel.pipeline_microbatches=2",
        "seed 44001 case 11 (a transition onto pp x dp; shrunk by hand): as many pipeline microbatches as stages let "
        "DDP rebuild its buckets from two backwards (an internal assert in stage 0's forward); DDP's sync now held to "
        "the last backward (torchpar/backends/pipeline.py); held by "
        "tests/torchpar/test_pipeline_backend.py::test_pp_by_dp_with_as_many_microbatches_as_stages",
    ),
    (
        "jax fsdp=2,pp=2,sp=2 data.document_mask=true parallel.pipeline_schedule=1f1b",
        "2026-11-27, checking ring attention in the pipeline executor (issue 48): gpt2's positional rows gathered by "
        "per-row positions from a table sharded over fsdp (or ZeRO-3) crashed XLA's SPMD partitioner in the executor "
        "(spmd_partitioner_util.cc's replica-group check; all_gather and ulysses too); the table's shards are gathered "
        "first now (jaxpar/models/decoder.py embed)",
    ),
    (
        "jax pp=2 parallel.offload=params+optimizer",
        "seed 51129 case 1 (issue 58; shrunk by hand): parallel.pipeline_schedule=auto's FLOPs probe traced the model "
        "on host-resident parameters and died in a gather (`memory_space of all inputs passed to gather must be the "
        "same`); the probe counts with the state on the devices now (jaxpar/pipeline/auto.py)",
    ),
    (
        "jax diloco=2,pp=2 model.moe_experts=4 parallel.diloco_inner_steps=3",
        "seed 61 case 198 (shrunk): DiLoCo's groups around the pipeline executor with experts; the balance loss's "
        "cotangent, traced inside the groups' shard_map, was closed over by the executor's (a numpy constant since)",
    ),
    (
        "jax diloco=2,dp=2,pp=2 parallel.diloco_inner_steps=3 parallel.zero_stage=1",
        "seed 61 case 179 (shrunk): a pipeline microbatch of one row over dp=2 inside a group deadlocked XLA:CPU's "
        "collectives; refused in one line since (the groups count among the data axes)",
    ),
)


# ---------------------------------------------------------------------------------------------- shrinking


def candidates(case: Case):
    """Simpler cases, the biggest simplifications first: the fewest settings that still fail."""
    if isinstance(case, Transition):
        yield from fuzz_transitions.candidates(case)
        return
    if case.side == "torch":
        if case.backend != "none":
            yield Case("torch", "none:0", case.settings)
        if case.world == 4:
            yield Case("torch", f"{case.backend}:2", case.settings)
    else:
        sizes = {a: n for a, n in case.mesh().items() if n > 1}
        for axis in sizes:
            smaller = {**sizes, axis: sizes[axis] // 2}
            yield Case("jax", ",".join(f"{a}={n}" for a, n in smaller.items() if n > 1) or "dp=1", case.settings)
    for i in range(len(case.settings)):
        yield case.with_settings(case.settings[:i] + case.settings[i + 1 :])


def shrink(fuzzer, case: Case, outcome: Outcome, max_runs: int = 40, log=print) -> tuple[Case, Outcome]:
    """Greedy: take the first simpler case that fails the same way, until none does (or max_runs runs)."""
    tried, runs = {case.spec}, 0
    progress = True
    while progress and runs < max_runs:
        progress = False
        for cand in (c if isinstance(c, Transition) else normalize(c) for c in candidates(case)):
            if cand.spec in tried or runs >= max_runs:
                continue
            tried.add(cand.spec)
            runs += 1
            out = fuzzer.run_case(cand)
            log(f"    shrink {runs}: {cand.spec}: {out.kind}")
            if out.same_failure(outcome):
                case, outcome, progress = cand, out, True
                break
    return case, outcome


def commands(case: Case, dataset: str = "DATA.bin") -> list[str]:
    """The fuzzer's own repro (with the comparison), and the trainer command line it runs."""
    if isinstance(case, Transition):  # two legs (and a conversion): the fuzzer's command runs them
        return [f"python -m parity_tests.fuzz --case '{case.spec}'"]
    settings = " ".join([*BASE, *case.overrides, f"data.dataset={dataset}"])
    if case.side == "jax":
        trainer = f"python -m jaxpar.train --mesh {case.layout} {settings}"
    elif case.world:
        trainer = f"torchrun --nproc_per_node={case.world} -m torchpar.train --backend {case.backend} {settings}"
    else:
        trainer = f"python -m torchpar.train --backend none {settings}"
    return [f"python -m parity_tests.fuzz --case '{case.spec}'", trainer]


# ----------------------------------------------------------------------------------------------- the CLI


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m parity_tests.fuzz", description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=None, help="draws case i from (seed, i); default: the time")
    p.add_argument("--cases", type=int, default=10, help="how many cases to draw (default 10)")
    p.add_argument("--start", type=int, default=0, help="first case index (continue a sweep)")
    p.add_argument("--case", action="append", default=[], help="run this case spec instead of drawing (repeatable)")
    p.add_argument("--regressions", action="store_true", help="also run the REGRESSIONS list")
    p.add_argument("--torch-share", type=float, default=TORCH_SHARE, help="share of torchpar cases (default 0.25)")
    p.add_argument(
        "--transition-share",
        type=float,
        default=TRANSITION_SHARE,
        help=f"share of transitions among the draws (default {TRANSITION_SHARE}; 1: transitions only)",
    )
    p.add_argument("--no-shrink", action="store_true", help="report failures as drawn")
    p.add_argument("--out", help="append one JSON line per case to this file")
    p.add_argument("--workdir", help="keep data, weights and torchpar runs here (default: a temporary directory)")
    p.add_argument("--timeout", type=int, default=TIMEOUT_S, help="seconds per torchpar run")
    return p.parse_args(argv)


def select(args, seed: int) -> list[tuple[str, Case]]:
    """(label, case): the given specs, or the regressions and the draws of (seed, start..start+cases-1)."""
    if args.case:
        return [(f"case {i}", parse_any(spec)) for i, spec in enumerate(args.case)]
    out = [(f"regression {i}", parse_any(r[0])) for i, r in enumerate(REGRESSIONS)] if args.regressions else []
    return out + [
        (f"{i}", draw(seed, i, args.torch_share, args.transition_share))
        for i in range(args.start, args.start + args.cases)
    ]


def draw(seed: int, i: int, torch_share: float = TORCH_SHARE, transition_share: float = TRANSITION_SHARE):
    """Case i of a seed: a transition or a fresh case.

    A transition with probability transition_share (decided apart, so the fresh cases a seed draws do not depend on
    the share), else a fresh case.
    """
    if random.Random(f"{seed}:{i}:transition").random() < transition_share:
        return draw_transition(random.Random(f"{seed}:{i}"))
    return draw_case(random.Random(f"{seed}:{i}"), torch_share)


def run_all(args, seed: int, fuzzer: Worker) -> tuple[Counter, list]:
    counts, failures = Counter(), []
    for label, case in select(args, seed):
        print(f"[{label}] {case.spec}: ", end="", flush=True)  # named before it runs: a crash of jax's process too
        out = fuzzer.run_case(case)
        counts[out.kind] += 1
        devs = " ".join(f"{k} {v:.1e}" for k, v in out.deviations.items() if k in ("loss", "grad_norm", "params"))
        print(f"{out.kind} ({out.seconds:.0f}s{', ' + devs if devs else ''})", flush=True)
        record = {
            "seed": seed,
            "case": label,
            "spec": case.spec,
            "kind": out.kind,
            "seconds": round(out.seconds, 1),
            "deviations": out.deviations,
            "detail": out.detail[-2000:],
        }
        if out.kind == "refused":
            print(f"    {out.detail.splitlines()[0]}", flush=True)
        if out.failed:
            print("    " + out.detail.replace("\n", "\n    "), flush=True)
            small, small_out = (case, out) if args.no_shrink else shrink(fuzzer, case, out)
            record.update(shrunk=small.spec, shrunk_detail=small_out.detail[-2000:])
            failures.append((label, small, small_out))
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(record) + "\n")
    return counts, failures


@cli
def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    seed = args.seed if args.seed is not None else int(time.time()) % 2**31
    for spec in args.case:
        parse_any(spec)  # bad specs: one line before anything starts
    print(
        f"fuzz: {len(args.case)} given cases"
        if args.case
        else f"fuzz seed {seed} (python -m parity_tests.fuzz --seed {seed} --cases {args.cases}"
        f"{f' --start {args.start}' if args.start else ''}{' --regressions' if args.regressions else ''}"
        f"{f' --torch-share {args.torch_share}' if args.torch_share != TORCH_SHARE else ''}"
        f"{f' --transition-share {args.transition_share}' if args.transition_share != TRANSITION_SHARE else ''})",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="jaxpar-fuzz-") as tmp:
        fuzzer = Worker(args.workdir or tmp, args.timeout)
        try:
            counts, failures = run_all(args, seed, fuzzer)
        finally:
            fuzzer.close()
    print(
        f"fuzz{'' if args.case else f' seed {seed}'}: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())),
        flush=True,
    )
    dataset = fuzzer.dataset if args.workdir else "TOKENS.bin"  # (tests.helpers.make_dataset writes one)
    for label, case, out in failures:
        print(f"FAILED [{label}] {out.kind}, shrunk to: {case.spec}\n    " + "\n    ".join(commands(case, dataset)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
