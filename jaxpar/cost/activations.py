"""model.remat=offload in a plan (jaxpar.tools.plan).

The activations each device keeps in host memory between a microbatch's forward and backward passes.

The offload policy (jaxpar/ops.py REMAT_POLICIES) names what moves: each layer's projection outputs, typed
`float32<host>` in the traced step. Counted here on the residuals of one microbatch's forward pass (jax.vjp of the
layout's model loss, as jaxpar/parallelize.py builds it), compiled for the layout, so GSPMD's own placement gives
each residual's shard on a device (fsdp splits the rows, tp the heads and the MLP width, GPipe the stages).

XLA:CPU compiles the policy -- the residuals are in host memory in the traced program -- but lowers a move between
memory kinds to nothing (jax registers the host-placement annotations for TPU and GPU only), so its memory analysis
counts them in the device's peak; a GPU's counts them apart. The plan subtracts them from the peak where the
backend did not.
"""

from __future__ import annotations

import functools
import math

import jax

from jaxpar.context import use
from jaxpar.core.data.tokens import document_token
from jaxpar.loss import model_loss
from jaxpar.models.decoder import abstract_model
from jaxpar.parallelize import parallelize
from jaxpar.state import abstract_state


def is_host(sharding) -> bool:
    return sharding.memory_kind in ("pinned_host", "unpinned_host")


def offloaded_bytes(layout) -> int:
    """Bytes of activations one device holds in host memory at once; 0 unless model.remat=offload.

    That is one microbatch's, all its layers: copied out in the forward pass and back in the backward, once per
    microbatch of train.microbatches.
    """
    if layout.cfg.model.remat != "offload":
        return 0

    cfg = layout.cfg
    context = parallelize(layout).context
    loss = functools.partial(model_loss, layout, abstract_model(cfg.model)[0], document_token(cfg))
    rows = layout.batch_shape[0] // cfg.train.microbatches
    batch = jax.ShapeDtypeStruct((rows, layout.batch_shape[1]), "int32", sharding=layout.batch_sharding)

    def residuals(params, batch):
        with use(context):
            return jax.vjp(lambda p: loss(p, batch), params)[1]

    # in device memory, as the step computes on them (parallel.offload keeps them on the host between steps)
    params = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        abstract_state(layout)["params"],
        layout.device_shardings["params"],
    )
    shapes = jax.tree.leaves(jax.eval_shape(residuals, params, batch))
    shardings = jax.tree.leaves(jax.jit(residuals).lower(params, batch).compile().output_shardings)
    return sum(
        math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize
        for a, s in zip(shapes, shardings, strict=True)
        if is_host(s)
    )


def account(p: dict, layout) -> None:
    """Add the note on model.remat=offload's activations to a plan `p` of the layout's step (jaxpar.tools.plan).

    Their bytes per device (`activation_host_bytes`) and, on XLA:CPU, the peak less them are the plan's memory
    (jaxpar/cost/peak_bytes.py device_memory).
    """
    held = p["activation_host_bytes"]
    if not held:
        return
    counted = layout.mesh.devices.flat[0].platform == "cpu"
    p["notes"].append(
        f"model.remat=offload: {held / 2**20:,.2f} MiB of activations per device wait in host memory "
        "between a microbatch's forward and backward passes (out and back once per microbatch)"
        + (
            "; XLA:CPU lowers the move to host memory to nothing and counts them in its peak: the peak "
            "above is that less them"
            if counted
            else ""
        )
    )
