"""Running one fuzz case.

Its trainer run (jaxpar in this process, torchpar as torchrun subprocesses), the one-device jaxpar reference, and the
comparison (parity_tests/compare.py) -- in a worker process that keeps jax started and survives a case that kills it.
The cases themselves: parity_tests/fuzz_cases.py; the CLI, the shrinker and the regressions: parity_tests/fuzz.py.
"""

from __future__ import annotations

import hashlib
import json
import math
import multiprocessing
import os
import subprocess
import tempfile
import time
import traceback
from dataclasses import dataclass, field

from parity_tests.compare import Tolerance
from parity_tests.fuzz_cases import BASE, STEPS, Case
from parity_tests.fuzz_docs import documented_refusal, promises

# the float32 budget of tests/jaxpar/test_layouts.py and the parity suite, gradient norm included (3 steps, not 50)
TOLERANCE = Tolerance("float32 fuzz", loss=1e-5, grad_norm=1e-5, lr=1e-6, params=1e-5, param_abs=5e-5, key_bias_lr=0.01)
TIMEOUT_S = 600


@dataclass
class Outcome:
    kind: str  # equal | refused | differs | error | refused-promised
    detail: str = ""
    deviations: dict = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return self.kind in ("differs", "error", "refused-promised")

    def same_failure(self, other: "Outcome") -> bool:
        """What the shrinker keeps.

        The same kind, and for errors the same first word (exception type, or the dead process).
        """
        first = lambda o: o.detail.split(":", 1)[0] if o.kind == "error" else ""
        return self.kind == other.kind and first(self) == first(other)


@dataclass
class Trajectory:
    """What compare() reads: per-step series and final parameters of one run."""

    side: str
    config: str
    loss: list
    grad_norm: list
    lr: list
    params: dict = field(repr=False)


def error_lines(text: str) -> list[str]:
    """The one-line refusals (`error: ...`) a trainer or tool printed."""
    return [line[len("error: ") :] for line in text.splitlines() if line.startswith("error: ")]


def reference_settings(case: Case) -> list[str]:
    """The same model, data and training on one device: the case's settings without parallel.*.

    With DiLoCo's groups, on the groups alone (reference_mesh): their parallel.diloco_inner_steps kept.
    """
    return [o for o in case.overrides if not o.startswith("parallel.") or o.startswith("parallel.diloco_")]


def reference_name(mesh: str) -> str:
    """A reference's name in the comparison tables."""
    return "one device" if mesh == "dp=1" else f"{mesh} alone"


def reference_mesh(case: Case) -> str:
    """One device; with DiLoCo's groups, one device per group (tests/jaxpar/test_diloco.py holds those to R runs)."""
    groups = case.mesh().get("diloco", 1)
    return f"diloco={groups}" if groups > 1 else "dp=1"


class Fuzzer:
    def __init__(self, workdir: str, timeout: int = TIMEOUT_S, run_overrides=()):
        from tests.helpers import make_dataset

        self.workdir, self.timeout = workdir, timeout
        self.run_overrides = list(run_overrides)  # appended to every case's run, never its reference (tests)
        os.makedirs(workdir, exist_ok=True)
        # short documents (each after an end-of-document token): windows, document masks and buckets read them
        self.dataset = make_dataset(os.path.join(workdir, "tokens.bin"), document_length=8)
        self.references: dict[tuple, Trajectory] = {}
        self.inits: dict[tuple, str] = {}

    def run_case(self, case: Case) -> Outcome:
        from jaxpar.core.errors import UserError
        from parity_tests.compare import EIGHT_BIT, compare

        t0 = time.perf_counter()
        if not isinstance(case, Case):  # a transition (parity_tests/fuzz_transitions.py) runs its own legs
            out = case.run(self)
            out.seconds = time.perf_counter() - t0
            return out
        try:  # the case first: a refusal costs no reference run
            got = self.run_jax(case) if case.side == "jax" else self.run_torch(case)
            ref = self.reference(case)
        except UserError as e:
            out = self.refused(case, str(e))
        except Exception as e:  # a crash anywhere is what the fuzzer is for; keep its traceback's tail
            out = Outcome("error", f"{type(e).__name__}: {str(e)[:300]}\n{traceback.format_exc()[-3000:]}")
        else:
            c = compare(got, ref, EIGHT_BIT if "optim.name=adamw8bit" in case.overrides else TOLERANCE)
            out = Outcome("equal" if c.ok else "differs", "" if c.ok else c.message(), c.deviations)
        out.seconds = time.perf_counter() - t0
        return out

    def refused(self, case: Case, line: str) -> Outcome:
        doc = documented_refusal(case)
        if doc:
            return Outcome("refused", f"{line} [documented: {doc}]")
        return Outcome("refused-promised", f"{line} [but promised by: {' | '.join(promises(case))}]")

    def config(self, overrides):
        from jaxpar.core.config.schema import load_config

        return load_config(None, [*BASE, *overrides])

    def reference(self, case: Case) -> Trajectory:
        """The one-device jaxpar run of the case's model, data and training settings (cached)."""
        settings, mesh = reference_settings(case), reference_mesh(case)
        key = (*settings, mesh)
        if key not in self.references:
            self.references[key] = self.jax_trajectory(self.config(settings), mesh, reference_name(mesh))
        return self.references[key]

    def run_jax(self, case: Case) -> Trajectory:
        from jaxpar.core.config.contract import Run, check_contract

        import jax
        import jax.numpy as jnp

        from jaxpar.pipeline.auto import resolve_schedule
        from jaxpar.cost.peak_bytes import peak_bytes

        from jaxpar.parallel import compression

        cfg = self.config([*case.overrides, *self.run_overrides])
        # as jaxpar.train does: parallel.pipeline_schedule=auto resolved first, then a key no mode consumes refused
        cfg, _ = resolve_schedule(cfg, case.mesh(), jax.devices(), peak_bytes)
        check_contract(Run(cfg, "jaxpar", mesh=case.mesh()))
        wire, compression.WIRE = compression.WIRE, jnp.float32  # bf16's program, nothing rounded (fuzz_cases.py)
        try:
            return self.jax_trajectory(cfg, case.layout, case.layout)
        finally:
            compression.WIRE = wire

    def jax_trajectory(self, cfg, mesh: str, name: str, then=None) -> Trajectory:
        """jaxpar in this process on the mesh's devices; `then=(k, cfg2)`: a switched run (tests/helpers.run_steps)."""
        import jax

        from jaxpar.core.config.mesh_spec import parse_mesh
        from tests.helpers import run_steps

        n = math.prod(parse_mesh(mesh).values())
        try:
            out = run_steps(cfg, mesh, self.dataset, devices=jax.devices()[:n], then=then)
        finally:
            jax.clear_caches()  # a sweep compiles hundreds of programs; keep the process's memory flat
        return Trajectory(name, "jaxpar", out["loss"], out["grad_norm"], out["lr"], out["params"])

    def init_weights(self, case: Case) -> str:
        """The reference's initial parameters as a shared weights file (what torchpar starts from)."""
        import jax

        from jaxpar.core.config.mesh_spec import parse_mesh
        from jaxpar.core.weights.names import flatten, save_weights
        from jaxpar.layout import Layout
        from jaxpar.mesh import make_mesh
        from jaxpar.state import init_state

        key = tuple(reference_settings(case))
        if key not in self.inits:
            cfg = self.config(key)
            layout = Layout(cfg, make_mesh(parse_mesh("dp=1"), jax.devices()[:1]))
            params = flatten(jax.device_get(init_state(layout)["params"]))
            name = hashlib.sha1(" ".join(key).encode()).hexdigest()[:12]  # one file per model, whichever worker
            path = os.path.join(self.workdir, "init", f"{name}.safetensors")
            save_weights(path, params, cfg.to_dict()["model"])
            self.inits[key] = path
        return self.inits[key]

    def run_torch(self, case: Case) -> Trajectory:
        from jaxpar.core.errors import UserError
        from safetensors.numpy import load_file

        from tests.helpers import torch_command

        os.makedirs(os.path.join(self.workdir, "runs"), exist_ok=True)
        # a fresh run (never a resumed one) in a directory the trainer creates: one it refused never existed
        run_dir = os.path.join(tempfile.mkdtemp(dir=os.path.join(self.workdir, "runs")), "run")
        final = os.path.join(run_dir, "final.safetensors")
        args = [
            "--backend",
            case.backend,
            *BASE,
            *case.overrides,
            *self.run_overrides,
            f"model.init_from={self.init_weights(case)}",
            f"data.dataset={self.dataset}",
            f"run.dir={run_dir}",
            "--write-final",
            final,
        ]
        rc, text = self.launch(torch_command(args, case.world))
        records = self.metrics(run_dir)
        errors = error_lines(text)
        if rc != 0 and errors and not os.path.exists(run_dir):  # refused before any process group or file
            raise UserError(errors[0])
        if rc != 0:
            raise RuntimeError(f"torchpar exited {rc}{': ' + errors[0] if errors else ''}\n{text[-3000:]}")
        steps = range(1, STEPS + 1)
        if sorted(records) != list(steps):
            raise RuntimeError(f"torchpar logged steps {sorted(records)}, expected 1..{STEPS}")
        series = [
            [float("nan") if records[s][k] is None else records[s][k] for s in steps]
            for k in ("loss", "grad_norm", "lr")
        ]
        return Trajectory(case.layout, "torchpar", *series, params=load_file(final))

    def launch(self, cmd: list[str], env: dict | None = None) -> tuple[int, str]:
        """A trainer subprocess in its own session: (exit status, stdout + stderr); killed whole on a timeout."""
        import signal

        from tests.helpers import ABORTS, ROOT, torch_env

        env = {**torch_env(), "CUDA_VISIBLE_DEVICES": "", **(env or {})}
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
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


class Worker:
    """Runs each case in a child process that keeps jax started (and the reference runs cached) from case to case.

    A case that kills it -- an XLA abort, a deadlocked collective -- or outlasts the timeout is an `error` holding
    the child's last output, and a fresh child takes the next case: a sweep survives.
    """

    def __init__(self, workdir: str, timeout: int = TIMEOUT_S):
        self.workdir, self.timeout, self.proc = workdir, timeout, None
        os.makedirs(workdir, exist_ok=True)
        self.log = os.path.join(workdir, "worker.log")  # the child's stdout and stderr (XLA's logs)
        self.dataset = os.path.join(workdir, "tokens.bin")

    def run_case(self, case: Case) -> Outcome:
        if self.proc is None:
            ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: jax starts in the child only
            self.conn, child = ctx.Pipe()
            self.proc = ctx.Process(target=_serve, args=(child, self.workdir, self.timeout, self.log), daemon=True)
            self.proc.start()
            child.close()  # the child's end lives in the child only: its death reads as EOF here
        t0 = time.perf_counter()
        self.conn.send(case)
        try:
            if self.conn.poll(2 * self.timeout):
                return self.conn.recv()
            why = f"no answer in {2 * self.timeout}s"
        except EOFError:
            why = "died"
        self.proc.kill()
        self.proc.join()
        self.proc, code = None, self.proc.exitcode
        with open(self.log, errors="replace") as f:
            tail = "".join(line for line in f.readlines()[-40:] if not line.lstrip().startswith("@"))
        return Outcome(
            "error",
            f"worker: the process running the case {why} (exit {code}); its last output:\n{tail[-3000:]}",
            seconds=time.perf_counter() - t0,
        )

    def close(self) -> None:
        if self.proc is not None:
            self.conn.send(None)
            self.proc.join(60)


def _serve(conn, workdir: str, timeout: int, log: str) -> None:
    """The child: its output into `log`, jax set up, then one Outcome per case it receives until None."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    setup_jax()
    fuzzer = Fuzzer(workdir, timeout)
    for case in iter(conn.recv, None):
        print(f"--- {case.spec}", flush=True)
        conn.send(fuzzer.run_case(case))


def setup_jax() -> None:
    """8 simulated CPU devices and float32 matmuls at full precision, unless jax has already started (tests)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from jaxpar.mesh import size_cpu_pool

    try:
        jax.config.update("jax_num_cpu_devices", 8)
        size_cpu_pool(8)  # as the trainer does for its simulated devices
    except RuntimeError:  # the backend is up (pytest's conftest set the same)
        pass
    jax.config.update("jax_default_matmul_precision", "highest")
    if len(jax.devices()) < 8:
        from jaxpar.core.errors import UserError

        raise UserError(f"the fuzzer needs 8 devices, jax has {len(jax.devices())}")
