"""The train state, a plain pytree, created directly in the layout's shardings (never materialised on one device).

"params": a nested dict; "opt_state": optax's state; "step": int32; with float16 "loss_scale", jaxpar/loss_scale.py's
scaler; with PowerSGD "powersgd", jaxpar/parallel/powersgd.py's. With DiLoCo's groups "opt_state" is every group's and
"diloco" holds their parameters and the outer optimizer's state (jaxpar/parallel/diloco.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar import loss_scale
from jaxpar.checkpoint import abstract_like
from jaxpar.layout import Layout
from jaxpar.models.decoder import Decoder
from jaxpar.optim import make_optimizer, with_clip_slot
from jaxpar.parallel import diloco, powersgd


def state_from_params(layout: Layout, params):
    """A fresh state around given parameters (random ones, or weights loaded with model.init_from)."""
    tx = make_optimizer(layout.cfg)
    return jax.jit(lambda p: _fresh(layout, tx, p), out_shardings=layout.state_shardings)(params)


def _fresh(layout: Layout, tx, params) -> dict:
    state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}
    if powersgd.enabled(layout):
        state["powersgd"] = powersgd.initial(layout, params)
    if layout.group is not None:  # DiLoCo: every group's inner optimizer state and parameters, the outer state
        state["opt_state"], state["diloco"] = diloco.initial(layout, params, state["opt_state"])
    return {**state, "loss_scale": loss_scale.initial(layout.cfg)} if loss_scale.enabled(layout.cfg) else state


def init_state(layout: Layout):
    cfg, tx = layout.cfg, make_optimizer(layout.cfg)

    def create():
        return _fresh(layout, tx, nnx.state(Decoder(cfg.model, nnx.Rngs(cfg.train.seed)), nnx.Param).to_pure_dict())

    return jax.jit(create, out_shardings=layout.state_shardings)()


def abstract_state(layout: Layout):
    """ShapeDtypeStructs of the state in the layout's shardings: what a checkpoint restore produces."""
    return abstract_like(jax.eval_shape(lambda: init_state(layout)), layout.state_shardings)


def restore_latest(ckpt, layout: Layout, params_only: bool = False):
    """(state, meta) of the newest loadable checkpoint in `ckpt` (a Checkpointer), or None if there is none.

    The state comes in the layout's shardings, PowerSGD's per-data-rank state fitted to this layout (and an older
    unclipped optimizer state to today's). `params_only`: a reader of the parameters (conversion, sampling), which
    takes a DiLoCo run's synchronised parameters on any mesh: the state then holds "params" and "step" alone.
    """
    if not params_only:
        diloco.check_saved_groups(ckpt.newest_tree(), diloco.groups(layout.mesh))
    abstract = abstract_state(layout)
    fit = with_clip_slot(powersgd.restore_fit(layout, abstract))
    return ckpt.restore_latest(abstract, fit=diloco.params_fit(layout, abstract, fit) if params_only else fit)
