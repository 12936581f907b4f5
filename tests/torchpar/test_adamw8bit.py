"""optim.name=adamw8bit in torchpar (torchao's AdamW8bit, torchpar/optim.py) and jaxpar (jaxpar/optim.py).

The same map and block quantization bit for bit; ddp and fsdp equal one process over 10 steps; jaxpar from the same
weights file within the band quantization allows; a ddp run killed and resumed equals the uninterrupted one (the codes
and scales in DCP).
"""

import jax.numpy as jnp
import numpy as np
import torch

from jaxpar.core.optimizer import adamw8bit
from jaxpar.optim import dequantize, quantize
from parity_tests.compare import EIGHT_BIT as BAND
from tests.helpers import metrics
from tests.torchpar.runs import assert_resumes_exactly_after_sigkill, assert_same_run, jaxpar_run, run
from jaxpar.core.errors import quiet_logs

EIGHT_BIT = ["optim.name=adamw8bit"]


def test_the_map_and_the_codes_are_torchaos():
    with quiet_logs("torchao", "torch.utils._pytree"):
        from torchao.optim.quant_utils import create_dynamic_map, quantize_8bit_with_qmap, scale_tensor
    rng = np.random.default_rng(0)
    for signed in (True, False):
        qmap = np.array(create_dynamic_map(signed), np.float32)
        np.testing.assert_array_equal(adamw8bit.dynamic_map(signed), qmap)
        x = (rng.standard_normal((16, 512)) * np.exp(3 * rng.standard_normal((16, 512)))).astype(np.float32)
        x = x if signed else np.abs(x)
        codes, scale = quantize(jnp.asarray(x), signed)
        scaled, their_scale = scale_tensor(torch.from_numpy(x), adamw8bit.BLOCK)
        np.testing.assert_array_equal(np.asarray(codes), quantize_8bit_with_qmap(scaled, torch.from_numpy(qmap)))
        np.testing.assert_array_equal(np.asarray(scale), their_scale.numpy())
        back = np.asarray(dequantize(codes, scale, signed))
        # the round trip keeps each value to within half a step of the map at its block's scale
        assert np.abs(back - x).max() <= np.abs(x).max() * 0.05 and np.abs(back - x).mean() < 1e-3 * np.abs(x).max()


def test_backends_equal_one_process_and_jaxpar_within_the_band(base, reference):
    one = base["tmp"] / "adamw8bit-none"
    out = run(["--backend", "none", *base["args"], *EIGHT_BIT, f"run.dir={one}"])
    assert "torchao" not in out.stderr and "Failed to load" not in out.stderr, out.stderr[-2000:]
    # the start-up line counts the state: 8-bit codes of the MLP matrices and the embedding, float32 of the rest
    assert "adamw8bit state 0.1 MiB per rank" in out.stdout + out.stderr, out.stdout
    ref = metrics(one)
    # the setting is used: AdamW's float32 moments go elsewhere (the tiny model's MLP matrices hold 8-bit ones)
    assert max(abs(ref[s]["loss"] - reference[s]["loss"]) for s in range(3, 11)) > 1e-5
    for backend in ("ddp", "fsdp"):
        run_dir = base["tmp"] / f"adamw8bit-{backend}"
        run(["--backend", backend, *base["args"], *EIGHT_BIT, f"run.dir={run_dir}"], nproc=2)
        # a moment value one code away steps its weight differently: the gradient norm within EIGHT_BIT's band
        assert_same_run(metrics(run_dir), ref, grad_norm=BAND.grad_norm)
    jax_run = jaxpar_run(base, EIGHT_BIT, "adamw8bit")
    # blocks are 64 consecutive values of each framework's own layout (torch's [out, in] against jaxpar's
    # [in, out]): other blocks, other scales, so the two need not agree to rounding; measured 2.8e-7 here, against
    # 6.5e-4 between the 8-bit and the float32 moments
    worst = max(abs(jax_run[s]["loss"] - ref[s]["loss"]) / ref[s]["loss"] for s in range(1, 11))
    assert worst < 2e-5, worst


def test_ddp_resumes_exactly_after_sigkill(base):
    assert_resumes_exactly_after_sigkill(base, "ddp", EIGHT_BIT, "adamw8bit")
