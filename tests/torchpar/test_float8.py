"""model.float8 in torchpar (torchpar/ops.py).

torchao's float8 training, its "tensorwise" recipe, on the projections jaxpar runs in float8 (jaxpar/ops.py
`_float8_project`): e4m3 input and weight, e5m2 output gradient, each scaled by its whole tensor's largest magnitude,
float32 accumulation. Both frameworks quantize the same float32 values to the same float8 codes, so they agree to
float32's rounding; the setting acts; ddp and fsdp equal one process.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxpar.context import ParallelContext, use
from jaxpar.core.weights.names import flatten
from jaxpar.loss import loss_fn
from jaxpar.models.decoder import Decoder
from jaxpar.ops import FLOAT8, project
from tests.helpers import metrics, tiny_config
from tests.torchpar.runs import run
from torchpar.models.decoder import Decoder as TorchDecoder
from torchpar.ops import float8_einsum
from torchpar.weights import from_shared, to_shared

# the projections' einsums (torchpar/models/) and jaxpar's `project` of the same product: (equation, x shape,
# w shape, n_in, the axes of jaxpar's output in torchpar's order)
FORMS = [
    ("btd,dchk->btchk", (4, 8, 32), (32, 3, 4, 8), 1, None),  # GPT-2's qkv
    ("bhtk,hkd->btd", (4, 4, 8, 8), (4, 8, 32), 2, None),  # the attention's output, heads first
    ("btd,dcgk->cbtgk", (4, 8, 32), (32, 2, 2, 8), 1, (2, 0, 1, 3, 4)),  # llama's kv
    ("btcd,cde->bte", (4, 8, 2, 32), (2, 32, 32), 2, None),
]  # multi-token prediction's


@pytest.mark.parametrize("form", FORMS, ids=[f[0] for f in FORMS])
def test_a_projection_is_jaxpars_float8_product(form):
    """From the same float32 values.

    Output, input and weight gradients within float32's rounding of jaxpar's (the same float8 codes and scales; only
    the sums' order differs), and float8's distance from the exact ones.
    """
    equation, x_shape, w_shape, n_in, order = form
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal(x_shape).astype(np.float32), (rng.standard_normal(w_shape) * 0.1).astype(np.float32)
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    y = float8_einsum(equation, tx, tw)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    y.backward(torch.from_numpy(dy))
    jx = np.swapaxes(x, 1, 2) if equation.startswith("bhtk") else x  # jaxpar's attention output: [b, t, h, k]
    token = FLOAT8.set(True)
    try:
        jy, pull = jax.vjp(lambda a, b: project(a, b, n_in), jnp.asarray(jx), jnp.asarray(w))
        jdy = np.moveaxis(dy, list(range(dy.ndim)), list(order)) if order else dy  # [c, b, t, g, k] -> [b, t, c, g, k]
        jdx, jdw = pull(jnp.asarray(jdy))
    finally:
        FLOAT8.reset(token)
    jy = np.transpose(np.asarray(jy), order) if order else np.asarray(jy)
    jdx = np.swapaxes(np.asarray(jdx), 1, 2) if equation.startswith("bhtk") else np.asarray(jdx)
    exact = torch.einsum(equation, torch.from_numpy(x), torch.from_numpy(w)).numpy()
    for got, want in ((y.detach().numpy(), jy), (tx.grad.numpy(), jdx), (tw.grad.numpy(), np.asarray(jdw))):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    assert 1e-3 < np.linalg.norm(y.detach().numpy() - exact) / np.linalg.norm(exact) < 0.1  # float8's rounding


FAMILIES = {"gpt2": (), "llama": ("model.family=llama", "model.n_kv_head=2")}
_STEPS: dict = {}


def _rows(cfg) -> np.ndarray:
    return np.random.default_rng(0).integers(1, cfg.model.vocab_size, (8, cfg.data.seq_len + 1)).astype(np.int32)


def _jaxpar_step(family: str) -> tuple:
    """jaxpar's float8 step: (its loss, its gradients, the weights it started from), in the shared format's names."""
    if family not in _STEPS:
        cfg = tiny_config(*FAMILIES[family])
        graphdef, params = nnx.split(Decoder(cfg.model, nnx.Rngs(0)), nnx.Param)
        with use(ParallelContext(float8=True)):
            loss, grads = jax.jit(
                jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p), jnp.asarray(_rows(cfg))))
            )(params)
        _STEPS[family] = (
            float(loss),
            {k: np.asarray(v) for k, v in flatten(grads.to_pure_dict()).items()},
            {k: np.asarray(v) for k, v in flatten(params.to_pure_dict()).items()},
        )
    return _STEPS[family]


def _torchpar_step(family: str, float8: bool) -> tuple:
    """torchpar's step from jaxpar's weights: (its loss, its gradients in the shared format's names)."""
    if (family, float8) not in _STEPS:
        cfg = tiny_config(*FAMILIES[family], f"model.float8={str(float8).lower()}")
        twin = TorchDecoder(cfg.model)
        twin.load_state_dict(from_shared(_jaxpar_step(family)[2], cfg.model.n_layer))
        t = torch.from_numpy(_rows(cfg).astype(np.int64))
        loss = twin(t[:, :-1], t[:, 1:])
        loss.backward()
        _STEPS[family, float8] = (
            float(loss.detach()),
            to_shared({n: p.grad for n, p in twin.named_parameters()}, cfg.model.n_layer),
        )
    return _STEPS[family, float8]


def _distance(a: dict, b: dict) -> float:
    """The largest relative difference (in norm) of one tensor's gradients."""
    assert set(a) == set(b)
    return max(float(np.linalg.norm(a[k] - b[k]) / np.linalg.norm(b[k])) for k in b)


@pytest.mark.parametrize("family", FAMILIES)
def test_one_step_equals_jaxpars_float8_from_one_set_of_weights(family):
    """Loss within 1e-6 and every gradient within 1e-5 (relative, in norm) of jaxpar's float8 step.

    Measured 8.6e-8 and 3.8e-7 (gpt2), 6.2e-7 (llama), float32's rounding. The band assumes the codes are the same:
    an activation whose float32 value differs in its last bit between the frameworks and sits on a float8 rounding
    boundary would move one code, and through its amax every e5m2 gradient code after it (a few percent on some
    tensors: seen with model.mtp_depth or experts on, which is why these two configurations are the ones held here).
    """
    (jloss, jgrads, _), (tloss, tgrads) = _jaxpar_step(family), _torchpar_step(family, True)
    np.testing.assert_allclose(tloss, jloss, rtol=1e-6)
    assert _distance(tgrads, jgrads) < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_the_setting_acts(family):
    """torchpar's float8 step against its float32 one from the same weights.

    The loss 5x and a gradient 100x beyond the band above (measured 1.2e-5 and 0.11 on both): ignoring model.float8
    fails here and above.
    """
    (loss8, grads8), (loss32, grads32) = _torchpar_step(family, True), _torchpar_step(family, False)
    assert abs(loss8 / loss32 - 1) > 5e-6
    assert _distance(grads8, grads32) > 1e-3


@pytest.mark.slow
def test_ddp_and_fsdp_equal_one_process(base, reference):
    """Two processes against one, 10 steps from one weights file.

    Each activation's and output gradient's scale is taken over the whole batch of the group (an all_reduce of its
    amax), so the first steps are float32's rounding apart (measured 4.3e-8 in loss, 1.1e-7 in grad norm; each
    rank's own amax, torchao's default: 7e-6 and 6.6e-4) and the 10 steps within float8's band, jaxpar's float8
    layouts' 5e-4 (measured 3.4e-5), which float32's run is not (3.9e-3). ddp also samples on rank 0 (no collective:
    under no_grad each rank scales its own tensors).
    """
    runs = {}
    for backend, nproc, extra in (("none", 0, []), ("ddp", 2, ["train.sample_every=5"]), ("fsdp", 2, [])):
        run_dir = base["tmp"] / f"float8-{backend}"
        run(["--backend", backend, *base["args"], "model.float8=true", *extra, f"run.dir={run_dir}"], nproc=nproc)
        runs[backend] = metrics(run_dir)
    ref = runs.pop("none")
    for backend, got in runs.items():
        for key in ("loss", "grad_norm"):
            np.testing.assert_allclose(
                [got[s][key] for s in (1, 2)], [ref[s][key] for s in (1, 2)], rtol=1e-6, err_msg=f"{backend} {key}"
            )
        np.testing.assert_allclose(_losses(got), _losses(ref), rtol=5e-4, err_msg=backend)
    assert np.abs(np.array(_losses(reference)) / _losses(ref) - 1).max() > 5e-4


def _losses(m: dict) -> list[float]:
    return [m[s]["loss"] for s in range(1, 11)]
