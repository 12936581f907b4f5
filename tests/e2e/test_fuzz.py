"""The layout-equivalence fuzzer (parity_tests/fuzz.py).

Two random cases per commit (the seed from the commit hash, printed), the failures it found; valid draws; and that it
can fail: a differing run is found, the shrinker keeps only what fails, a refusal the docs do not explain is a failure.
"""

import copy
import random
import subprocess
import time

import pytest

from jaxpar.checks import check_layout
from jaxpar.core.data.batch_shapes import for_each_shape
from jaxpar.core.config.schema import load_config
from jaxpar.core.config.contract import Run, check_contract
from jaxpar.core.errors import UserError
from jaxpar.core.pipeline.choice import candidates
from parity_tests import fuzz, fuzz_docs
from parity_tests.fuzz import shrink
from parity_tests.fuzz_cases import BASE, Case, draw_case, normalize
from parity_tests.fuzz_docs import documented_refusal, indivisible
from parity_tests.fuzz_run import Fuzzer, Outcome, Worker
from parity_tests.fuzz_transitions import CHANGES, Transition, draw_transition, parse_any, refusal_of
from tests.helpers import ROOT


def commit_seed() -> int:
    """A seed that changes with every commit (the time where there is no git checkout)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        return int(head.stdout.strip()[:8], 16)
    except (OSError, ValueError, subprocess.SubprocessError):
        return int(time.time()) % 2**31


@pytest.mark.every_commit  # CI runs the commit's cases however long they take (conftest.py: test tiers)
def test_two_cases_of_this_commit(capsys):
    seed = commit_seed()
    print(f"fuzz seed {seed}: python -m parity_tests.fuzz --seed {seed} --cases 2")
    rc = fuzz.main(["--seed", str(seed), "--cases", "2"])
    out = capsys.readouterr().out
    print(out)
    assert rc == 0, f"fuzz seed {seed} found a failure:\n{out[-6000:]}"
    assert out.count(": equal (") + out.count(": refused (") == 2, out


@pytest.mark.every_commit
def test_two_transitions_of_this_commit(capsys):
    """Two runs that change half-way (docs/fuzz.md 'Transitions'), drawn from the commit's seed."""
    seed = commit_seed()
    print(f"fuzz seed {seed}: python -m parity_tests.fuzz --seed {seed} --cases 2 --transition-share 1")
    rc = fuzz.main(["--seed", str(seed), "--cases", "2", "--transition-share", "1", "--no-shrink"])
    out = capsys.readouterr().out
    print(out)
    assert rc == 0, f"fuzz seed {seed} found a failure:\n{out[-6000:]}"
    assert out.count(" | ") >= 2 and out.count(": equal (") + out.count(": refused (") == 2, out


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    w = Worker(str(tmp_path_factory.mktemp("fuzz-worker")))
    yield w
    w.close()


@pytest.mark.parametrize("spec", [spec for spec, _ in fuzz.REGRESSIONS])
def test_regression(spec, worker):
    out = worker.run_case(parse_any(spec))
    assert not out.failed, f"{spec}: {out.kind}\n{out.detail[:3000]}"


def check_leg(case: Case) -> None:
    """The checks a trainer makes before it runs: the layout's at every batch shape (a ramp-up's), the contract.

    Under parallel.pipeline_schedule=auto, those of the schedules auto chooses among: one must pass (the figures
    that pick one are not taken here).
    """
    cfg = load_config(None, [*BASE, *case.overrides])

    def check(c):
        if case.side == "jax":
            for_each_shape(c, lambda at: check_layout(at, case.mesh()))
            check_contract(Run(c, "jaxpar", mesh=case.mesh()))
        else:
            check_contract(Run(c, "torchpar", case.backend, {a: case.mesh()[a] for a in ("pp", "diloco")}))

    if cfg.parallel.pipeline_schedule != "auto" or case.mesh()["pp"] == 1:
        return check(cfg)
    bubbles, refused = candidates(cfg, case.mesh()["pp"], check)
    if not bubbles:
        raise UserError("; ".join(refused.values()))


def test_draws_are_valid_and_set_only_keys_their_modes_run():
    """Drawn cases are valid configs that set only keys their modes run.

    300 draws: each a config the schema takes, every key one its mode consumes (the shrinker's normal form; the contract
    agrees), and sizes the mesh divides -- or a refusal the docs name.
    """
    sides = set()
    for i in range(300):
        case = draw_case(random.Random(f"test:{i}"))
        sides.add(case.backend if case.side == "torch" else case.side)
        assert Case.parse(case.spec) == case and normalize(case) == case, case.spec
        assert not indivisible(case), case.spec
        if not documented_refusal(case):
            check_leg(case)
    assert sides == {"jax", "none", "ddp", "fsdp", "deepspeed", "pipeline"}


@pytest.fixture(scope="module")
def fuzzer(tmp_path_factory):
    return Fuzzer(str(tmp_path_factory.mktemp("fuzz")))


def test_a_differing_run_is_found(fuzzer):
    """Every run (not the references) with another LayerNorm epsilon: the case differs, with the loss table."""
    broken = copy.copy(fuzzer)
    broken.run_overrides = ["model.layernorm_eps=1e-3"]
    out = broken.run_case(Case.parse("jax dp=2"))
    assert out.kind == "differs" and out.failed and "loss: " in out.detail, out.detail


class Stub:
    """A fuzzer whose cases fail exactly when tp > 1 and model.remat=full (no training).

    It checks each case against the config contract as the trainer would.
    """

    def __init__(self):
        self.runs, self.unconsumed = [], []

    def run_case(self, case):
        self.runs.append(case.spec)
        try:
            check_contract(Run(load_config(None, [*BASE, *case.overrides]), "jaxpar", mesh=case.mesh()))
        except UserError:
            self.unconsumed.append(case.spec)
        fails = case.mesh()["tp"] > 1 and case.get("model.remat") == "full"
        return Outcome("differs" if fails else "equal")


def test_the_shrinker_keeps_only_what_fails():
    """From a big case down to the smallest that still fails.

    tp halved to 2, dp and the unrelated keys gone (the pipeline's and ZeRO's keys with their axes: no case it tries
    sets a key its run would not consume), and nothing tried twice.
    """
    case = Case.parse(
        "jax dp=2,tp=2,pp=2 model.n_layer=4 model.remat=full parallel.pipeline_schedule=1f1b "
        "parallel.zero_stage=1 train.microbatches=2"
    )
    stub = Stub()
    small, out = shrink(stub, case, stub.run_case(case), log=lambda line: None)
    assert small.spec == "jax tp=2 model.remat=full" and out.kind == "differs"
    assert len(stub.runs) == len(set(stub.runs)) and not stub.unconsumed, stub.unconsumed
    assert normalize(Case.parse("jax dp=1 parallel.zero_stage=2 parallel.sequence_zigzag=false")).spec == "jax dp=1"


def test_a_refusal_the_docs_do_not_name_is_a_failure(fuzzer, monkeypatch):
    case = Case.parse("jax fsdp=2,pp=2,tp=2 model.linear=sketched parallel.pipeline_schedule=1f1b")
    out = fuzzer.run_case(case)
    assert out.kind == "refused" and "docs/architecture.md" in out.detail, out.detail
    monkeypatch.setattr(fuzz_docs, "DOCUMENTED_REFUSALS", ())
    out = fuzzer.run_case(case)
    assert out.kind == "refused-promised" and out.failed and "promised by" in out.detail, out.detail


def test_transition_draws_are_valid_and_cover_every_change():
    """Drawn transitions are valid and together cover every change.

    200 transitions: each leg a valid case (or a refusal the docs name), the step between the legs' ends, the spec read
    back as drawn; the draws move across meshes, backends, world sizes and frameworks, change each key of CHANGES, and
    hold batches larger than the smallest the splits divide.
    """
    kinds, keys, batches = set(), set(), set()
    for i in range(200):
        t = draw_transition(random.Random(f"test:{i}"))
        assert Transition.parse(t.spec) == t, t.spec
        assert 1 <= t.at < min(t.steps(t.first), t.steps(t.then)), t.spec
        for leg in (t.first, t.then):
            assert normalize(leg) == leg and not indivisible(leg), t.spec
            assert leg.get("parallel.grad_compression") != "bf16", t.spec  # rounded by a trainer's leg
            check_leg(leg)
        shaping = {k for leg in (t.first, t.then) for k, _ in leg.settings if k.startswith(("model.", "data."))}
        assert all(t.first.get(k) == t.then.get(k) for k in shaping), t.spec  # one model, one data order
        kinds.add(t.kind.split("+")[0])
        keys.update(k for k in CHANGES if t.first.get(k) != t.then.get(k))
        batches.add(int(t.first.get("train.global_batch_size", "8")))
    assert {"framework", "backend", "world", "mesh"} <= kinds and keys == set(CHANGES), (kinds, keys)
    assert max(batches) > 8
    deepspeed_to_dcp = Transition.parse("torch deepspeed:2 | 1 | torch ddp:2")
    assert refusal_of(deepspeed_to_dcp) and not refusal_of(Transition.parse("torch ddp:2 | 1 | torch fsdp:2"))
    stages = "torch deepspeed:2 parallel.zero_stage={} | 1 | torch deepspeed:{} parallel.zero_stage={}"
    assert refusal_of(Transition.parse(stages.format(1, 2, 3))) and refusal_of(Transition.parse(stages.format(0, 4, 1)))
    assert not refusal_of(Transition.parse(stages.format(1, 4, 2))) and not refusal_of(
        Transition.parse(stages.format(0, 4, 0))
    )
    groups = "torch fsdp:2 parallel.mesh=diloco=2 | 1 | {}"  # docs/diloco.md: across frameworks, or other groups
    assert refusal_of(Transition.parse(groups.format("jax tp=2"))) and refusal_of(
        Transition.parse(groups.format("torch fsdp:2"))
    )
    assert not refusal_of(Transition.parse(groups.format("torch fsdp:4 parallel.mesh=diloco=2")))


def test_a_transition_that_ignores_its_change_differs(fuzzer):
    """A transition whose second leg ignores its change differs from the switched run.

    Both legs run with optim.lr=3e-3 appended, so the second leg's lr=1e-3 is lost as a resume that kept the old setting
    would lose it: the joined run differs from one device's switched run, in the lr column first.
    """
    broken = copy.copy(fuzzer)
    broken.run_overrides = ["optim.lr=3e-3"]
    out = broken.run_case(Transition.parse("jax dp=1 | 1 | jax dp=1 optim.lr=1e-3 train.steps=2"))
    assert out.kind == "differs" and "lr: " in out.detail, out.detail


def test_a_diloco_transition_is_held_to_its_groups_switched_run(fuzzer):
    """DiLoCo's groups resumed with another warm-up equal the groups' switched run, a device per group.

    As a fresh DiLoCo case's reference; one device's run without the groups differs from step 1.
    """
    leg = "jax diloco=2 parallel.diloco_inner_steps=1"
    spec = f"{leg} | 1 | {leg} optim.warmup_steps=4"
    out = fuzzer.run_case(Transition.parse(spec))
    assert out.kind == "equal", out.detail


def test_the_shrinker_reduces_a_transition_to_its_failing_change():
    """A transition that fails whenever its second leg changes optim.lr.

    The mesh change, the other changed key and the shared setting go; the lr change stays.
    """

    class LrStub:
        runs = []

        def run_case(self, t):
            self.runs.append(t.spec)
            return Outcome("differs" if t.first.get("optim.lr") != t.then.get("optim.lr") else "equal")

    t = Transition.parse("jax dp=2 model.remat=full | 2 | jax tp=2 model.remat=full optim.lr=1e-3 train.steps=4")
    stub = LrStub()
    small, out = shrink(stub, t, stub.run_case(t), log=lambda line: None)
    assert small.spec == "jax dp=2 | 2 | jax dp=2 optim.lr=1e-3" and out.kind == "differs", small.spec
    assert len(stub.runs) == len(set(stub.runs))
