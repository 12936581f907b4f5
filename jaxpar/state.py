"""The train state, a plain pytree {"params": nested dict, "opt_state": optax state, "step": int32},
created directly in the layout's shardings (never materialised on one device)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.checkpoint import abstract_like
from jaxpar.layout import Layout
from jaxpar.models.gpt import GPT
from jaxpar.optim import make_optimizer


def state_from_params(layout: Layout, params):
    """A fresh state around given parameters (random ones, or weights loaded with model.init_from)."""
    tx = make_optimizer(layout.cfg)
    create = lambda p: {"params": p, "opt_state": tx.init(p), "step": jnp.zeros((), jnp.int32)}  # noqa: E731
    return jax.jit(create, out_shardings=layout.state_shardings)(params)


def init_state(layout: Layout):
    cfg, tx = layout.cfg, make_optimizer(layout.cfg)

    def create():
        params = nnx.state(GPT(cfg.model, nnx.Rngs(cfg.train.seed)), nnx.Param).to_pure_dict()
        return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}

    return jax.jit(create, out_shardings=layout.state_shardings)()


def abstract_state(layout: Layout):
    """ShapeDtypeStructs of the state in the layout's shardings: what a checkpoint restore produces."""
    return abstract_like(jax.eval_shape(lambda: init_state(layout)), layout.state_shardings)
