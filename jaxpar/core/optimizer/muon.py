"""Muon's shared rules (optim.name=muon), written once for jaxpar/optim.py and torchpar/optim.py.

Which parameters are its matrices, how each is read as a matrix, and how its step is scaled.

The algorithm both frameworks run (Keller Jordan's, as torch.optim.Muon), per matrix W with gradient G:
    B <- m B + (1 - m) G                      momentum (optim.muon_momentum), no bias correction
    U <- (1 - m) G + m B                      Nesterov
    O <- NS_k(U)                              k = optim.muon_ns_steps quintic Newton-Schulz steps on
                                              U / max(|U|_F, EPS), X <- a X + (b A + c A A) X with A = X X^T,
                                              on the wide orientation
    W <- W (1 - lr wd) - lr scale(W) O        wd = optim.weight_decay, scale: optim.muon_lr_rule
in float32. Neither library's own Muon is used as it is: optax.contrib.muon bias-corrects its Nesterov momentum (the
first steps point elsewhere) and torch.optim.Muon runs Newton-Schulz in bfloat16 (no float32 parity).

A matrix is a parameter's per-layer tensor with its reduction axes (the input) and output axes; every other axis is a
batch axis: each of q, k and v of a fused projection, each expert, and in jaxpar each layer of the stack is a matrix
of its own. Embeddings, the head, the router, norms and biases are not matrices here: they stay on AdamW.
Pure Python: no jax, no torch.
"""

from __future__ import annotations

import math

COEFFS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's and optax's (a, b, c)
EPS = 1e-7  # the Frobenius norm's floor before the iteration (torch.optim.Muon's)

_FLAT = ((0,), (1,))
# per-layer name (the stack's prefix dropped) -> (reduction axes, output axes) of its per-layer shape
MATRICES = {
    "attn.qkv.kernel": ((0,), (2, 3)),  # [embed, 3, heads, head_dim]: q, k and v apart
    "attn.kv.kernel": ((0,), (2, 3)),  # [embed, 2, kv_heads, head_dim]
    "attn.kv_up.kernel": ((0,), (2, 3)),  # [kv_latent, 2, heads, head_dim]
    "attn.q.kernel": ((0,), (1, 2)),  # [embed, heads, head_dim]
    "attn.q_up.kernel": ((0,), (1, 2)),
    "attn.q_down.kernel": _FLAT,
    "attn.kv_down.kernel": _FLAT,
    "attn.out.kernel": ((0, 1), (2,)),  # [heads, head_dim, embed]
    **{f"mlp.{n}.kernel": _FLAT for n in ("fc", "proj", "gate", "up", "down")},
    **{f"mlp.{n}.factor": _FLAT for n in ("fc", "proj")},  # model.linear=sketched: [m, out]
    **{f"moe.{n}": ((1,), (2,)) for n in ("gate", "up", "down")},  # [experts, in, out]
    **{f"moe.shared.{n}.kernel": _FLAT for n in ("gate", "up", "down")},
}
# jaxpar's layer stacks (jaxpar/core/weights/names.py layer_stacks),
# multi-token prediction's blocks stacked on their depth
STACKS = ("blocks.", "dense_blocks.", "mtp.block.")
LR_RULES = ("match_rms_adamw", "original")


def per_layer_axes(shared: str) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(reduction axes, output axes) of a shared per-layer name ("blocks.mlp.fc.kernel"), None if not Muon's."""
    for prefix in STACKS:
        if shared.startswith(prefix):
            return MATRICES.get(shared.removeprefix(prefix))
    return None


def stacked_axes(path: str) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The same for a jaxpar parameter path, whose stacked tensor leads with the layers axis (a batch axis)."""
    axes = per_layer_axes(path)
    return None if axes is None else tuple(tuple(a + 1 for a in side) for side in axes)


def fans(shape, axes) -> tuple[int, int]:
    reduction, output = axes
    return math.prod(shape[a] for a in reduction), math.prod(shape[a] for a in output)


def lr_scale(rule: str, fan_in: int, fan_out: int) -> float:
    """A matrix's step relative to optim.lr.

    match_rms_adamw (Moonlight's, arXiv 2502.16982) gives the update AdamW's typical RMS, 0.2, so AdamW's lr and
    weight decay carry over; original (Keller Jordan's) scales by the aspect ratio only. torch.optim.Muon's
    adjust_lr_fn of the same names.
    """
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(fan_in, fan_out))
    return math.sqrt(max(1.0, fan_out / fan_in))
