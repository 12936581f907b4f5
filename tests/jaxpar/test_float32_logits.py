"""model.float32_logits: the output head's matmul writes its float32 accumulation as the logits.

Against float64 products of the same bfloat16 operands the float32 logits agree to float32's precision where the
rounded head's are off by bfloat16's; the backward is the rounded head's (its gradients equal, every product in the
compute dtype); the chunked loss takes the setting as the whole one does.
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.models.head import chunked_cross_entropy, cross_entropy, logits


def _operands(seed: int = 0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(2, 8, 32)), jnp.bfloat16)
    table = jnp.asarray(rng.normal(size=(48, 32)), jnp.bfloat16)
    return x, table


def test_float32_logits_are_the_products_before_rounding():
    x, table = _operands()
    exact = np.einsum("btd,vd->btv", np.asarray(x, np.float64), np.asarray(table, np.float64))
    scale = np.abs(exact).max()
    got, rounded = (np.asarray(logits(x, table, f)) for f in (True, False))
    assert got.dtype == rounded.dtype == np.float32
    assert np.abs(got - exact).max() < 1e-6 * scale
    assert np.abs(rounded - exact).max() > 1e-3 * scale  # bfloat16's rounding: the setting acts


def test_the_backward_is_the_rounded_heads():
    """A loss linear in the logits: both heads' gradients are equal, and no backward product is in float32."""
    x, table = _operands()
    c = jnp.asarray(np.random.default_rng(1).normal(size=(2, 8, 48)), jnp.float32)
    grads = [jax.grad(lambda x, t: jnp.sum(logits(x, t, f) * c), argnums=(0, 1))(x, table) for f in (True, False)]
    for a, b in zip(*grads):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    from jax.extend.core import jaxprs_in_params

    def products(jaxpr):
        for e in jaxpr.eqns:
            yield from [e] if e.primitive.name == "dot_general" else []
            for sub in jaxprs_in_params(e.params):
                yield from products(sub)

    f = jax.grad(lambda x, t: jnp.sum(jnp.sin(logits(x, t, True))), argnums=(0, 1))
    found = list(products(jax.make_jaxpr(f)(x, table).jaxpr))
    assert len(found) == 3 and all(v.aval.dtype == jnp.bfloat16 for e in found for v in e.invars)


def test_the_chunked_loss_takes_the_setting():
    x, table = _operands(2)
    targets = jnp.asarray(np.random.default_rng(3).integers(0, 48, (2, 8)), jnp.int32)
    whole = cross_entropy(logits(x, table, True), targets)
    chunked, rounded = (chunked_cross_entropy(x, table, targets, 4, f) for f in (True, False))
    np.testing.assert_allclose(float(chunked), float(whole), rtol=1e-6)
    assert abs(float(rounded) - float(whole)) > 1e-6 * abs(float(whole))
    g_whole = jax.grad(lambda x: cross_entropy(logits(x, table, True), targets))(x)
    g_chunked = jax.grad(lambda x: chunked_cross_entropy(x, table, targets, 4, True))(x)
    np.testing.assert_allclose(np.asarray(g_chunked, np.float32), np.asarray(g_whole, np.float32), atol=1e-2 / 16)
