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
    return subprocess.run([sys.executable, "-c", "import jax; print(jax.numpy.ones(2).sum())"], env=env,
                          capture_output=True, text=True, timeout=120)


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
    """On a 'GPU' without cuDNN (this CPU), the cuDNN attempt fails at trace time: XLA's attention runs and
    the reason is printed once; float32 inputs name their dtype."""
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
