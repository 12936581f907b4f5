"""Transitions: a run that changes half-way, held to what it says it does (docs/fuzz.md 'Transitions').

A transition trains its first leg (a fuzz case, parity_tests/fuzz_cases.py) with the real trainer until a SIGTERM
after step `at` (the trainer saves and exits 0), then continues under its second leg: another jaxpar mesh, another
torchpar backend or world size, the other framework (the whole training state converted by jaxpar.tools.convert),
and/or changed settings (train.steps, optim.lr, optim.warmup_steps, checkpoint.every, train.microbatches). The
joined run -- losses, gradient norms and learning rates of every step and the final parameters -- is compared with
one device doing the same without a checkpoint: the first leg's settings for `at` steps, then the second's
(tests/helpers.run_steps `then=`). A second leg the docs say is refused must be refused in one line.

    python -m parity_tests.fuzz --case "jax dp=2 | 2 | jax tp=2 optim.lr=1e-3 train.steps=4"
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import traceback
from dataclasses import dataclass

from parity_tests.fuzz_cases import BASE, STEPS, Case, draw_jax, draw_torch, normalize
from parity_tests.fuzz_docs import documented_refusal, indivisible, invalid_config

SEP = " | "
# what a second leg may change beside its layout (the first leg keeps BASE's)
CHANGES = {
    "train.steps": ("2", "4", "5"),
    "optim.lr": ("1e-3", "5e-3"),
    "optim.warmup_steps": ("1", "2", "4"),
    "checkpoint.every": ("1", "2"),
    "train.microbatches": ("1", "2", "4"),
}
KEPT = (
    "model.",
    "data.",
    "train.global_batch_size",
    "train.batch_rampup",
    "train.tokens_per_batch",
    "train.microbatches",
    "train.scan_layers",
    "train.seed",
    "optim.eps",
    "optim.min_lr",
)


@dataclass(frozen=True)
class Transition:
    first: Case
    at: int  # the first leg stops after this step (its checkpoint)
    then: Case

    @staticmethod
    def parse(spec: str) -> "Transition":
        from jaxpar.core.errors import UserError

        parts = spec.split(SEP)
        if len(parts) != 3 or not parts[1].strip().isdigit():
            raise UserError(f"transition {spec!r}: expected 'CASE | STEP | CASE'")
        return Transition(Case.parse(parts[0].strip()), int(parts[1]), Case.parse(parts[2].strip()))

    @property
    def spec(self) -> str:
        return SEP.join([self.first.spec, str(self.at), self.then.spec])

    def run(self, fuzzer):
        return run_transition(fuzzer, self)

    def steps(self, leg: Case) -> int:
        return int(leg.get("train.steps", STEPS))

    @property
    def kind(self) -> str:
        """What changes: framework, backend, world, mesh, and the settings' keys."""
        a, b = self.first, self.then
        what = [
            "framework"
            if a.side != b.side
            else "backend"
            if a.backend != b.backend and a.side == "torch"
            else "world"
            if a.layout != b.layout and a.side == "torch"
            else "mesh"
            if a.layout != b.layout
            else ""
        ]
        keys = sorted(
            k
            for k in set(dict(a.settings)) | set(dict(b.settings))
            if not k.startswith("parallel.") and a.get(k) != b.get(k)
        )
        return "+".join([w for w in what if w] + keys) or "resume"


def parse_any(spec: str):
    return Transition.parse(spec) if SEP in spec else Case.parse(spec)


# ----------------------------------------------------------------------------------------------- drawing


def _shared(case: Case) -> dict:
    """What both legs keep: the settings that shape the model, the data and the optimizer's state."""
    return {k: v for k, v in case.settings if k.startswith(KEPT)}


def _valid(case: Case) -> bool:
    """A leg the config, its layout's checks (at every batch shape) and the key contract accept."""
    from jaxpar.checks import check_layout
    from jaxpar.core.data.batch_shapes import for_each_shape
    from jaxpar.core.config.schema import load_config
    from jaxpar.core.config.contract import Run, check_contract
    from jaxpar.core.errors import UserError

    if invalid_config(case) or indivisible(case):
        return False
    cfg = load_config(None, [*BASE, *case.overrides])
    try:  # every batch shape of a ramp-up or of buckets, as the trainers check them
        if case.side == "jax":
            for_each_shape(cfg, lambda at: check_layout(at, case.mesh()))
            check_contract(Run(cfg, "jaxpar", mesh=case.mesh()))
        else:
            _check_torch(cfg, case)
            check_contract(Run(cfg, "torchpar", case.backend, {"pp": case.mesh()["pp"]}))
    except UserError:
        return False
    return True


def _check_torch(cfg, case: Case) -> None:
    """torchpar's batch checks (torchpar/checks.py) for the case's world size."""
    from torchpar.backends.pipeline import check_torch_pipeline
    from torchpar.checks import check_batch

    from jaxpar.core.data.batch_shapes import for_each_shape

    world = max(case.world, 1)
    if case.backend == "pipeline":
        check_torch_pipeline(cfg, world)
    else:
        for_each_shape(cfg, lambda at: check_batch(at, world))


def _layout_for(rng: random.Random, first: Case, side: str, keep, tries: int = 60) -> Case | None:
    """A layout of `side` for the first leg's model and data, drawn until one fits.

    The layout comes with its parallel settings; `keep(candidate)` says which layouts count: another mesh, another
    backend, another world size.
    """
    shared = _shared(first)
    for _ in range(tries):
        drawn = draw_jax(rng) if side == "jax" else draw_torch(rng)
        parallel = {k: v for k, v in drawn.settings if k.startswith("parallel.")}
        cand = normalize(Case(side, drawn.layout, tuple(sorted({**shared, **parallel}.items()))))
        # a layout whose run would not consume one of the model's keys (fsdp and deepspeed refuse the balance bias)
        # is another model: not a transition of this one
        if (
            keep(cand)
            and _shared(cand) == shared
            and _valid(cand)
            and not documented_refusal(cand)
            and _resumable(cand)
        ):
            return cand
    return None


def _resumable(case: Case) -> bool:
    """A leg the trainer runs as the fresh case's numbers.

    No bf16 wire (the fuzzer widens it to float32 in-process only; a trainer's leg rounds the gradients, seed 44001
    case 22).
    """
    return case.get("parallel.grad_compression") != "bf16"


def _first_leg(rng: random.Random) -> Case:
    while True:
        case = draw_torch(rng) if rng.random() < 0.4 else draw_jax(rng)
        if _resumable(case) and not documented_refusal(case):
            return case


def draw_transition(rng: random.Random) -> Transition:
    first = _first_leg(rng)
    kind = rng.choice(
        [
            "mesh" if first.side == "jax" else "backend",
            "world" if first.side == "torch" else "mesh",
            "framework",
            "settings",
        ]
    )
    then = first
    if kind == "framework":
        then = _layout_for(rng, first, "torch" if first.side == "jax" else "jax", lambda c: True) or first
    elif kind == "backend":
        then = (
            _layout_for(
                rng,
                first,
                "torch",
                lambda c: (
                    c.backend != first.backend and ("deepspeed" not in (c.backend, first.backend) or rng.random() < 0.2)
                ),
            )
            or first
        )  # DCP/DeepSpeed: refused
    elif kind in ("mesh", "world"):
        then = (
            _layout_for(
                rng,
                first,
                first.side,
                lambda c: c.layout != first.layout and (c.side == "jax" or c.backend == first.backend),
            )
            or first
        )
    changes = _draw_changes(rng, then, force=kind == "settings" or then == first)
    changed = normalize(then.with_settings(tuple(sorted({**dict(then.settings), **changes}.items()))))
    if not _valid(changed):  # accumulation the second layout cannot split: keep the first leg's
        changes.pop("train.microbatches", None)
        changed = normalize(then.with_settings(tuple(sorted({**dict(then.settings), **changes}.items()))))
    then = changed
    at = rng.randrange(1, min(STEPS, Transition(first, 0, then).steps(then)))
    return Transition(first, at, then)


def _draw_changes(rng: random.Random, then: Case, force: bool) -> dict:
    keys = [k for k in CHANGES if rng.random() < 0.3] or ([rng.choice(list(CHANGES))] if force else [])
    if then.get("data.batching") == "buckets" or then.get("train.batch_rampup"):
        keys = [k for k in keys if k != "train.microbatches"]  # their batch shapes decide the accumulation
    return {k: rng.choice([v for v in CHANGES[k] if v != then.get(k)]) for k in keys}


# ----------------------------------------------------------------------------------------------- running

# (where the docs say it, predicate on the transition): second legs the docs say are refused with one line
DOCUMENTED_TRANSITION_REFUSALS = (
    (
        "docs/torchpar.md 'Checkpoints and resume': DeepSpeed's checkpoints and DCP's refuse each other",
        lambda t: (
            t.first.side == t.then.side == "torch"
            and (t.first.backend == "deepspeed") != (t.then.backend == "deepspeed")
        ),
    ),
    (
        "docs/torchpar.md 'Checkpoints and resume': a DeepSpeed checkpoint resumes only at a stage of its layout (0; 1 "
        "or 2; 3)",
        lambda t: t.first.backend == t.then.backend == "deepspeed" and _layout(t.first) != _layout(t.then),
    ),
    (
        "docs/diloco.md 'Not yet': a DiLoCo training state does not convert between frameworks",
        lambda t: t.first.side != t.then.side and _groups(t.first) > 1,
    ),
    (
        "docs/diloco.md 'Checkpoints and resuming': a resume on another number of groups is refused",
        lambda t: _groups(t.first) != _groups(t.then),
    ),
)


def _groups(case: Case) -> int:
    """The case's number of DiLoCo groups (1: none)."""
    return case.mesh()["diloco"]


def _layout(case: Case) -> str:
    return {"0": "0", "1": "1-2", "2": "1-2", "3": "3"}[case.get("parallel.zero_stage", "0")]


def refusal_of(t: Transition) -> str | None:
    return next((doc for doc, applies in DOCUMENTED_TRANSITION_REFUSALS if applies(t)), None)


def run_transition(fuzzer, t: Transition):
    """(Outcome): the joined run against one device's switched run, or the second leg's documented refusal."""
    from jaxpar.core.errors import UserError
    from parity_tests.compare import compare
    from parity_tests.fuzz_run import TOLERANCE, Outcome

    for leg in (t.first, t.then):
        doc = documented_refusal(leg)
        if doc:  # a leg refused on its own is a fresh case's business: say so without running
            return Outcome("refused", f"a leg the docs refuse: {leg.spec} [documented: {doc}]")
    try:
        got = _joined_run(fuzzer, t)
        ref = _reference(fuzzer, t)
    except UserError as e:
        doc = refusal_of(t)
        return (
            Outcome("refused", f"{e} [documented: {doc}]")
            if doc
            else Outcome("refused-promised", f"{e} [but promised by: docs/fuzz.md 'Transitions', design principle 9]")
        )
    except Exception as e:  # a leg that crashed, hung or stopped at the wrong step
        return Outcome("error", f"{type(e).__name__}: {str(e)[:300]}\n{traceback.format_exc()[-3000:]}")
    c = compare(got, ref, TOLERANCE)
    return Outcome("equal" if c.ok else "differs", "" if c.ok else c.message(), c.deviations)


def _reference(fuzzer, t: Transition):
    """One device's switched run; with DiLoCo's groups, a device per group, as a fresh case's reference.

    Both legs have the same groups here: a resume on another number of groups is refused (docs/diloco.md).
    """
    from parity_tests.fuzz_run import reference_mesh, reference_name, reference_settings

    mesh = reference_mesh(t.first)
    key = (tuple(reference_settings(t.first)), t.at, tuple(reference_settings(t.then)), mesh)
    if key not in fuzzer.references:
        cfg_a, cfg_b = fuzzer.config(key[0]), fuzzer.config(key[2])
        fuzzer.references[key] = fuzzer.jax_trajectory(cfg_a, mesh, reference_name(mesh), then=(t.at, cfg_b))
    return fuzzer.references[key]


def _joined_run(fuzzer, t: Transition):
    """Run both legs with the real trainers and return the trajectory of all steps and the final parameters.

    The trainers run as subprocesses, the second resuming the first's run directory (or its conversion to the other
    framework).
    """
    from safetensors.numpy import load_file

    from parity_tests.fuzz_run import Trajectory

    os.makedirs(os.path.join(fuzzer.workdir, "runs"), exist_ok=True)
    root = tempfile.mkdtemp(dir=os.path.join(fuzzer.workdir, "runs"))
    first_dir, final = os.path.join(root, "first"), os.path.join(root, "final.safetensors")
    init = [f"model.init_from={fuzzer.init_weights(t.first)}"]  # the reference's initial weights, on either side
    _leg(fuzzer, t.first, first_dir, init, {"FAULT_SIGTERM_AFTER_STEP": str(t.at)}, saved=t.at)
    then_dir = first_dir
    if t.then.side != t.first.side:
        then_dir = os.path.join(root, "then")
        _convert(fuzzer, t.first, t.then, first_dir, then_dir)
    _leg(fuzzer, t.then, then_dir, ["--write-final", final], {}, saved=t.steps(t.then))
    records = {**fuzzer.metrics(first_dir), **fuzzer.metrics(then_dir)}
    steps = range(1, t.steps(t.then) + 1)
    if sorted(records) != list(steps):
        raise RuntimeError(f"the joined run logged steps {sorted(records)}, expected 1..{t.steps(t.then)}")
    series = [
        [float("nan") if records[s][k] is None else records[s][k] for s in steps] for k in ("loss", "grad_norm", "lr")
    ]
    return Trajectory(t.then.layout, t.then.side, *series, params=load_file(final))


def _leg(fuzzer, case: Case, run_dir: str, extra: list[str], fault: dict, saved: int) -> None:
    """One leg: the trainer on `run_dir` (a refusal: UserError with its line; anything else that fails: an error)."""
    from jaxpar.core.errors import UserError
    from parity_tests.fuzz_run import error_lines
    from tests.helpers import torch_command

    args = [
        *BASE,
        *case.overrides,
        *fuzzer.run_overrides,
        f"data.dataset={fuzzer.dataset}",
        f"run.dir={run_dir}",
        *extra,
    ]
    if case.side == "jax":
        cmd = [sys.executable, "-m", "jaxpar.train", "--mesh", case.layout, *args]
        env = {f"JAXPAR_{k}": v for k, v in fault.items()}
    else:
        cmd = torch_command(["--backend", case.backend, *args], case.world)
        env = {f"TORCHPAR_{k}": v for k, v in fault.items()}
    rc, text = fuzzer.launch(cmd, env)
    errors = error_lines(text)
    if rc != 0 and errors:
        raise UserError(errors[0])
    if rc != 0:
        raise RuntimeError(f"{case.spec} exited {rc}\n{text[-3000:]}")
    if max(fuzzer.metrics(run_dir), default=0) != saved:
        raise RuntimeError(
            f"{case.spec} stopped at step {max(fuzzer.metrics(run_dir), default=0)}, not {saved}\n{text[-2000:]}"
        )


def _convert(fuzzer, first: Case, then: Case, src: str, dst: str) -> None:
    """Convert the whole training state into the other framework's run directory.

    One jaxpar.tools.convert command; the result is a DeepSpeed run of the second leg's ZeRO stage where that leg runs
    DeepSpeed.
    """
    from jaxpar.core.errors import UserError
    from parity_tests.fuzz_run import error_lines

    target = ["--to", "jaxpar"] if then.side == "jax" else ["--to", "torchpar"]
    if then.backend == "deepspeed":
        target = ["--to", "deepspeed", "--zero-stage", then.get("parallel.zero_stage", "0")]
    source = "jaxpar" if first.side == "jax" else "torchpar"
    rc, text = fuzzer.launch([sys.executable, "-m", "jaxpar.tools.convert", "--from", source, src, *target, dst], {})
    errors = error_lines(text)
    if rc != 0:
        raise (UserError(errors[0]) if errors else RuntimeError(f"convert exited {rc}\n{text[-3000:]}"))


def candidates(t: Transition):
    """Simpler transitions, the biggest simplifications first.

    No layout change, then each changed key kept as the first leg had it, then each shared setting dropped from both
    legs (the fuzz case's own shrinker does the rest on a fresh case).
    """
    if t.then.layout != t.first.layout or t.then.side != t.first.side:
        parallel = tuple((k, v) for k, v in t.first.settings if k.startswith("parallel."))
        rest = tuple((k, v) for k, v in t.then.settings if not k.startswith("parallel."))
        yield Transition(t.first, t.at, normalize(Case(t.first.side, t.first.layout, tuple(sorted(parallel + rest)))))
    for k, v in t.then.settings:
        if not k.startswith("parallel.") and t.first.get(k) != v:
            kept = [(key, val) for key, val in t.then.settings if key != k]
            kept += [(k, t.first.get(k))] if t.first.get(k) is not None else []
            yield Transition(t.first, t.at, t.then.with_settings(tuple(sorted(kept))))
    for k, v in t.first.settings:
        if t.then.get(k) == v:
            drop = lambda c: normalize(c.with_settings(tuple(kv for kv in c.settings if kv[0] != k)))
            yield Transition(drop(t.first), t.at, drop(t.then))
