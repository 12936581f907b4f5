"""The GPU fast paths that can be checked on a CPU: XLA's GPU options, cuDNN attention's fallback message."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar import ops
from jaxpar.xla_flags import GPU_FLAGS, with_gpu_flags


def _start_jax(xla_flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "XLA_FLAGS": xla_flags, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-c", "import jax; print(jax.numpy.ones(2).sum())"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_gpu_flags_are_options_this_xla_knows_and_the_users_own_win():
    """XLA parses every option at start-up on any backend and aborts on an unknown one (checked too)."""
    flags = with_gpu_flags("--xla_gpu_enable_latency_hiding_scheduler=false")
    assert flags.count("xla_gpu_enable_latency_hiding_scheduler") == 1 and "scheduler=false" in flags
    assert all(f"--{k}=" in flags for k in GPU_FLAGS)
    ok = _start_jax(flags)
    assert ok.returncode == 0 and "2.0" in ok.stdout, ok.stderr[-2000:]
    bad = _start_jax(flags + " --xla_gpu_no_such_option=true")
    assert bad.returncode != 0 and "xla_gpu_no_such_option" in bad.stderr


def test_cudnn_attention_fallback_is_said_once_per_reason(monkeypatch, capsys):
    """On a 'GPU' without cuDNN (this CPU), the cuDNN attempt fails at trace time.

    XLA's attention runs and the reason is printed once; float32 inputs name their dtype.
    """
    monkeypatch.setattr(ops, "_on_gpu", lambda: True)
    monkeypatch.setattr(ops, "_said", set())
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 16, 4, 8)) for i in range(3))
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    for dtype in (jnp.bfloat16, jnp.bfloat16, jnp.float32):
        got = ops.causal_attention(q.astype(dtype), k.astype(dtype), v.astype(dtype))
        np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=3e-2 if dtype == jnp.bfloat16 else 1e-6)
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("attention:")]
    assert len(lines) == 2, lines
    assert "cuDNN is not detected" in lines[0] and "XLA's attention runs instead" in lines[0]
    assert "float32 inputs" in lines[1]


def test_cpu_projection_has_autodiffs_gradients_from_an_untransposed_weight_gradient_dot():
    """The CPU projection's backward gives autodiff's gradients.

    ops.project's CPU backward (x transposed in a copy behind a barrier) gives tensordot's gradients, for the model's
    shapes: [b,t,d] @ [d,3,h,k] (qkv) and [b,t,h,k] @ [h,k,d] (out, two contracted dims).
    """
    keys = jax.random.split(jax.random.key(0), 4)
    cases = [
        (jax.random.normal(keys[0], (2, 5, 8)), jax.random.normal(keys[1], (8, 3, 2, 4)), 1),
        (jax.random.normal(keys[2], (2, 5, 2, 4)), jax.random.normal(keys[3], (2, 4, 8)), 2),
    ]
    for x, w, n_in in cases:
        mine = jax.value_and_grad(lambda x, w: jnp.sin(ops.project(x, w, n_in)).sum(), (0, 1))
        autodiff = jax.value_and_grad(lambda x, w: jnp.sin(jnp.tensordot(x, w, n_in)).sum(), (0, 1))
        (v1, g1), (v2, g2) = mine(x, w), autodiff(x, w)
        np.testing.assert_allclose(v1, v2, rtol=1e-6)
        for a, b in zip(g1, g2):
            assert a.shape == b.shape
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        eqns = list(_eqns(jax.make_jaxpr(mine)(x, w).jaxpr))
        assert sum(e.primitive.name == "dot_general" for e in eqns) == 3  # forward, dx, dw: nothing recomputed
        barrier = next(e for e in eqns if e.primitive.name == "optimization_barrier")
        (dw,) = [e for e in eqns if e.primitive.name == "dot_general" and e.invars[0] in barrier.outvars]
        (lhs_contracting, _), _ = dw.params["dimension_numbers"]
        assert tuple(lhs_contracting) == tuple(range(n_in, x.ndim))  # x^T's trailing (token) dims: untransposed


def _eqns(jaxpr):
    """Every equation of a jaxpr, those of the jaxprs inside it too (pjit, custom_vjp calls)."""
    for e in jaxpr.eqns:
        yield e
        for value in e.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
                if hasattr(sub, "eqns"):
                    yield from _eqns(sub)


def test_cli_relaunches_itself_once_with_huge_pages_unless_the_user_set_glibc_tunables(tmp_path):
    from jaxpar.core.run.malloc import HUGE_PAGES, wants_relaunch

    (tmp_path / "probe.py").write_text(
        "import os; print('start', flush=True); from jaxpar.core.run.malloc import relaunch_with_huge_pages; "
        "relaunch_with_huge_pages('probe'); print(repr(os.environ.get('GLIBC_TUNABLES')))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), os.getcwd(), env.get("PYTHONPATH", "")])

    def probe(*how, **extra):
        ran = subprocess.run(
            [sys.executable, *how], env={**env, **extra}, capture_output=True, text=True, timeout=60, cwd=tmp_path
        )
        assert ran.returncode == 0, ran.stderr
        return ran.stdout.split()

    argv = [sys.executable, "-X", "utf8", "-m", "probe"]
    assert not wants_relaunch("probe", argv, {**env, "GLIBC_TUNABLES": ""})
    assert not wants_relaunch("probe", argv, env, platform="darwin")
    assert not wants_relaunch("probe", [sys.executable, "-m", "cProfile", "-m", "probe"], env)  # a host's argv
    if wants_relaunch("probe", argv, env):  # Linux, glibc >= 2.35: ran twice, the second time with the tunable
        assert probe("-X", "utf8", "-m", "probe") == ["start", "start", repr(HUGE_PAGES)]
    assert probe("-m", "probe", GLIBC_TUNABLES="glibc.malloc.check=0") == ["start", repr("glibc.malloc.check=0")]
    assert probe("-c", "import probe") == ["start", "None"]  # not `-m probe`: never re-executed


def test_the_clis_relaunch_before_anything_imports_jax():
    """glibc reads GLIBC_TUNABLES once, at start: the relaunch must come before any other import."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    for module in ("jaxpar.train", "jaxpar.tools.bench", "jaxpar.tools.bench_checkpoint"):
        body = ast.parse((root / (module.replace(".", "/") + ".py")).read_text()).body
        body = [
            n
            for n in body
            if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
            and not (isinstance(n, ast.ImportFrom) and n.module == "__future__")
        ]
        first = ast.unparse(body[0])
        assert first.startswith("if __name__ == '__main__':") and f"relaunch_with_huge_pages('{module}')" in first, (
            module,
            first,
        )
