"""The layout-equivalence fuzzer: random valid configurations, each held to its one-device run.

    python -m parity_tests.fuzz --seed S --cases N [--out results.jsonl] [--start K]
    python -m parity_tests.fuzz --case "jax pp=2,tp=2 parallel.pipeline_schedule=1f1b"   (one case)

A case (parity_tests/fuzz_cases.py: what is drawn, what the docs promise and refuse) is a jaxpar mesh
over dp/fsdp/tp/pp/sp or a torchpar backend and world size, plus settings drawn hierarchically. It trains
`STEPS` float32 steps (matmul precision highest) and its per-step loss and gradient norm and its final
parameters are compared (parity_tests/compare.py, 1e-5) with the one-device jaxpar run of the same
model, data and training settings. jaxpar cases run in this process; torchpar cases as subprocesses
(torchrun over gloo) from the reference's exported initial weights.

Outcomes: `equal`; `refused` (the trainer's one-line UserError) where the docs say so (DOCUMENTED_REFUSALS);
and three failures: `differs`, `error` (a crash, a timeout), `refused-promised` (refused, but no line of
the docs says it is, and PROMISES say it works). A failure is shrunk (settings back to their defaults,
mesh axes halved, torch backends to `none`) while it still fails the same way, and printed as a
command. Each failure found becomes an entry of REGRESSIONS, which tests/test_fuzz.py runs every time.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field

from jaxpar.core.errors import cli
from parity_tests.compare import Tolerance
from parity_tests.fuzz_cases import (BASE, STEPS, TORCH_SHARE, Case, documented_refusal, draw_case, normalize,
                                     promises)

# the float32 budget of tests/test_layouts.py and the parity suite, gradient norm included (3 steps, not 50)
TOLERANCE = Tolerance("float32 fuzz", loss=1e-5, grad_norm=1e-5, lr=1e-6, params=1e-5, param_abs=5e-5, key_bias_lr=0.01)
TIMEOUT_S = 600
# Failures found by the sweeps (docs/fuzz.md), run by tests/test_fuzz.py: (spec, what it found).
REGRESSIONS = (
    ("jax pp=2 data.seq_len=32 model.d_model=64 model.n_head=2 model.n_layer=4",
     "seed 26001 case 1 at lr 1e-2: blocks.attn.out.kernel 7.6e-5 off (bound 5e-5), Adam amplifying float32 "
     "reassociation (dp=2: 1.7e-5); BASE now trains at lr 3e-3 as configs/parity/ does"),
)


# ------------------------------------------------------------------------------------------------ running

@dataclass
class Outcome:
    kind: str  # equal | refused | differs | error | refused-promised
    detail: str = ""
    deviations: dict = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return self.kind in ("differs", "error", "refused-promised")


@dataclass
class Trajectory:
    """What compare() reads: per-step series and final parameters of one run."""
    side: str
    config: str
    loss: list
    grad_norm: list
    lr: list
    params: dict = field(repr=False)


def reference_settings(case: Case) -> list[str]:
    """The same model, data and training on one device: the case's settings without parallel.*."""
    return [o for o in case.overrides if not o.startswith("parallel.")]


class Fuzzer:
    def __init__(self, workdir: str, timeout: int = TIMEOUT_S, run_overrides=()):
        from tests.helpers import make_dataset

        self.workdir, self.timeout = workdir, timeout
        self.run_overrides = list(run_overrides)  # appended to every case's run, never its reference (tests)
        os.makedirs(workdir, exist_ok=True)
        self.dataset = make_dataset(os.path.join(workdir, "tokens.bin"))
        self.references: dict[tuple, Trajectory] = {}
        self.inits: dict[tuple, str] = {}
        self.count = 0

    def run_case(self, case: Case) -> Outcome:
        from jaxpar.core.errors import UserError
        from parity_tests.compare import compare

        t0 = time.perf_counter()
        try:  # the case first: a refusal costs no reference run
            got = self.run_jax(case) if case.side == "jax" else self.run_torch(case)
            ref = self.reference(case)
        except UserError as e:
            out = self.refused(case, str(e))
        except Exception:  # a crash anywhere is what the fuzzer is for; keep its traceback's tail
            out = Outcome("error", traceback.format_exc()[-3000:])
        else:
            c = compare(got, ref, TOLERANCE)
            out = Outcome("equal" if c.ok else "differs", "" if c.ok else c.message(), c.deviations)
        out.seconds = time.perf_counter() - t0
        return out

    def refused(self, case: Case, line: str) -> Outcome:
        doc = documented_refusal(case)
        if doc:
            return Outcome("refused", f"{line} [documented: {doc}]")
        return Outcome("refused-promised", f"{line} [but promised by: {' | '.join(promises(case))}]")

    def config(self, overrides):
        from jaxpar.core.config import load_config

        return load_config(None, [*BASE, *overrides])

    def reference(self, case: Case) -> Trajectory:
        """The one-device jaxpar run of the case's model, data and training settings (cached)."""
        key = tuple(reference_settings(case))
        if key not in self.references:
            self.references[key] = self.jax_trajectory(self.config(key), "dp=1", "jax:1")
        return self.references[key]

    def run_jax(self, case: Case) -> Trajectory:
        from jaxpar.core.contract import Run, check_contract

        cfg = self.config([*case.overrides, *self.run_overrides])
        check_contract(Run(cfg, "jaxpar", mesh=case.mesh()))  # as jaxpar.train does: a key no mode consumes
        return self.jax_trajectory(cfg, case.layout, case.spec)

    def jax_trajectory(self, cfg, mesh: str, name: str) -> Trajectory:
        import jax

        from jaxpar.core.mesh_spec import parse_mesh
        from tests.helpers import run_steps

        n = math.prod(parse_mesh(mesh).values())
        try:
            out = run_steps(cfg, mesh, self.dataset, devices=jax.devices()[:n])
        finally:
            jax.clear_caches()  # a sweep compiles hundreds of programs; keep the process's memory flat
        return Trajectory(name, "fuzz", out["loss"], out["grad_norm"], out["lr"], out["params"])

    def init_weights(self, case: Case) -> str:
        """The reference's initial parameters as a shared weights file (what torchpar starts from)."""
        import jax

        from jaxpar.core.mesh_spec import parse_mesh
        from jaxpar.core.weights import flatten, save_weights
        from jaxpar.layout import Layout
        from jaxpar.mesh import make_mesh
        from jaxpar.state import init_state

        key = tuple(reference_settings(case))
        if key not in self.inits:
            cfg = self.config(key)
            layout = Layout(cfg, make_mesh(parse_mesh("dp=1"), jax.devices()[:1]))
            params = flatten(jax.device_get(init_state(layout)["params"]))
            path = os.path.join(self.workdir, "init", f"{len(self.inits)}.safetensors")
            save_weights(path, params, cfg.to_dict()["model"])
            self.inits[key] = path
        return self.inits[key]

    def run_torch(self, case: Case) -> Trajectory:
        from jaxpar.core.errors import UserError
        from safetensors.numpy import load_file

        from tests.helpers import torch_command

        self.count += 1
        run_dir = os.path.join(self.workdir, "runs", str(self.count))
        final = os.path.join(run_dir, "final.safetensors")
        args = ["--backend", case.backend, *BASE, *case.overrides, *self.run_overrides,
                f"model.init_from={self.init_weights(case)}", f"data.dataset={self.dataset}", f"run.dir={run_dir}",
                "--write-final", final]
        rc, text = self.launch(torch_command(args, case.world))
        records = self.metrics(run_dir)
        errors = [line[len("error: "):] for line in text.splitlines() if line.startswith("error: ")]
        if rc != 0 and errors and not records:  # a one-line refusal before any step
            raise UserError(errors[0])
        if rc != 0:
            raise RuntimeError(f"torchpar exited {rc}:\n{text[-3000:]}")
        steps = range(1, STEPS + 1)
        if sorted(records) != list(steps):
            raise RuntimeError(f"torchpar logged steps {sorted(records)}, expected 1..{STEPS}")
        series = [[float("nan") if records[s][k] is None else records[s][k] for s in steps]
                  for k in ("loss", "grad_norm", "lr")]
        return Trajectory(case.spec, "fuzz", *series, params=load_file(final))

    def launch(self, cmd: list[str]) -> tuple[int, str]:
        """A trainer subprocess in its own session: (exit status, stdout + stderr); killed whole on a timeout."""
        import signal

        from tests.helpers import ABORTS, ROOT, torch_env

        env = {**torch_env(), "CUDA_VISIBLE_DEVICES": ""}
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            raise RuntimeError(f"timed out after {self.timeout}s: {' '.join(cmd)}\n{out[-3000:]}") from None
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of this session outlived torchrun
            raise RuntimeError(f"processes left behind by: {' '.join(cmd)}")
        except ProcessLookupError:
            pass
        if any(a in out for a in ABORTS):
            raise RuntimeError(f"aborted (exit {proc.returncode}):\n{out[-3000:]}")
        return proc.returncode, out

    @staticmethod
    def metrics(run_dir: str) -> dict:
        path = os.path.join(run_dir, "metrics.jsonl")
        if not os.path.exists(path):
            return {}
        with open(path) as f:
            return {r["step"]: r for r in map(json.loads, f) if "loss" in r}

# ---------------------------------------------------------------------------------------------- shrinking

def candidates(case: Case):
    """Simpler cases, the biggest simplifications first: the fewest settings that still fail."""
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
        yield case.with_settings(case.settings[:i] + case.settings[i + 1:])


def shrink(fuzzer: Fuzzer, case: Case, outcome: Outcome, max_runs: int = 40, log=print) -> tuple[Case, Outcome]:
    """Greedy: take the first simpler case that fails the same way, until none does (or max_runs runs)."""
    tried, runs = {case.spec}, 0
    progress = True
    while progress and runs < max_runs:
        progress = False
        for cand in map(normalize, candidates(case)):
            if cand.spec in tried or runs >= max_runs:
                continue
            tried.add(cand.spec)
            runs += 1
            out = fuzzer.run_case(cand)
            log(f"    shrink {runs}: {cand.spec}: {out.kind}")
            if out.kind == outcome.kind:
                case, outcome, progress = cand, out, True
                break
    return case, outcome


def commands(case: Case, dataset: str = "DATA.bin") -> list[str]:
    """The fuzzer's own repro (with the comparison), and the trainer command line it runs."""
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
    p.add_argument("--no-shrink", action="store_true", help="report failures as drawn")
    p.add_argument("--out", help="append one JSON line per case to this file")
    p.add_argument("--workdir", help="keep data, weights and torchpar runs here (default: a temporary directory)")
    p.add_argument("--timeout", type=int, default=TIMEOUT_S, help="seconds per torchpar run")
    return p.parse_args(argv)


def setup_jax() -> None:
    """8 simulated CPU devices and float32 matmuls at full precision, unless jax has already started (tests)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", 8)
    except RuntimeError:  # the backend is up (pytest's conftest set the same)
        pass
    jax.config.update("jax_default_matmul_precision", "highest")
    if len(jax.devices()) < 8:
        from jaxpar.core.errors import UserError

        raise UserError(f"the fuzzer needs 8 devices, jax has {len(jax.devices())}")


def select(args, seed: int) -> list[tuple[str, Case]]:
    """(label, case): the given specs, or the regressions and the draws of (seed, start..start+cases-1)."""
    if args.case:
        return [(f"case {i}", Case.parse(spec)) for i, spec in enumerate(args.case)]
    out = [(f"regression {i}", Case.parse(spec)) for i, (spec, _) in enumerate(REGRESSIONS)] if args.regressions else []
    return out + [(f"{i}", draw_case(random.Random(f"{seed}:{i}"), args.torch_share))
                  for i in range(args.start, args.start + args.cases)]


def run_all(args, seed: int, fuzzer: Fuzzer) -> tuple[Counter, list]:
    counts, failures = Counter(), []
    for label, case in select(args, seed):
        print(f"[{label}] {case.spec}: ", end="", flush=True)  # named before it runs: a crash of jax's process too
        out = fuzzer.run_case(case)
        counts[out.kind] += 1
        devs = " ".join(f"{k} {v:.1e}" for k, v in out.deviations.items() if k in ("loss", "grad_norm", "params"))
        print(f"{out.kind} ({out.seconds:.0f}s{', ' + devs if devs else ''})", flush=True)
        record = {"seed": seed, "case": label, "spec": case.spec, "kind": out.kind, "seconds": round(out.seconds, 1),
                  "deviations": out.deviations, "detail": out.detail[-2000:]}
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
        Case.parse(spec)  # bad specs: one line before anything starts
    print(f"fuzz: {len(args.case)} given cases" if args.case else
          f"fuzz seed {seed} (python -m parity_tests.fuzz --seed {seed} --cases {args.cases}"
          f"{f' --start {args.start}' if args.start else ''}{' --regressions' if args.regressions else ''}"
          f"{f' --torch-share {args.torch_share}' if args.torch_share != TORCH_SHARE else ''})", flush=True)
    setup_jax()
    with tempfile.TemporaryDirectory(prefix="jaxpar-fuzz-") as tmp:
        fuzzer = Fuzzer(args.workdir or tmp, args.timeout)
        counts, failures = run_all(args, seed, fuzzer)
    print(f"fuzz{'' if args.case else f' seed {seed}'}: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())),
          flush=True)
    dataset = fuzzer.dataset if args.workdir else "TOKENS.bin"  # (tests.helpers.make_dataset writes one)
    for label, case, out in failures:
        print(f"FAILED [{label}] {out.kind}, shrunk to: {case.spec}\n    " + "\n    ".join(commands(case, dataset)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
