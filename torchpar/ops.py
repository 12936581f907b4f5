"""Model-free tensor functions the models and decoding use (jaxpar/ops.py's counterparts).

Causal attention on one device, within packed documents when asked, the documents' positions and ids
(document_positions), and the projections' float8 matmul (model.float8, torchao's float8 training).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from jaxpar.core.errors import quiet_logs


def document_positions(tokens: torch.Tensor, eod: int, segment=0, position=0):
    """(positions, segments) [B, T] of rows of packed documents, as jaxpar/ops.py `document_positions`.

    A document starts at each `eod` token, its positions count from 0 there, its segment id is the previous one's
    plus one; a row's first tokens continue document `segment` from `position` (ints or [B, 1]).
    """
    starts, idx = tokens == eod, torch.arange(tokens.shape[1], device=tokens.device)
    last_start = torch.cummax(torch.where(starts, idx, -1), dim=1).values
    return torch.where(last_start >= 0, idx - last_start, position + idx), segment + torch.cumsum(starts, dim=1)


def document_mask(positions, segments, k_positions=None, k_segments=None) -> torch.Tensor:
    """[B, 1, T, K] bool, True where a query attends to a key.

    At or before it in its own document (keys: the queries themselves, or a cache's).
    """
    k_positions = positions if k_positions is None else k_positions
    k_segments = segments if k_segments is None else k_segments
    mask = (positions[:, :, None] >= k_positions[:, None, :]) & (segments[:, :, None] == k_segments[:, None, :])
    return mask[:, None]


def causal_attention(q, k, v, mask=None, window: int = 0, sinks=None):
    """Causal attention on [b, h, t, k]; `mask` (document_mask) instead of the plain causal one when given.

    `window` (model.sliding_window): each query also sees only the `window` latest tokens of the row, itself
    included (within a document the row's distance is the positions'). `sinks` [heads] (model.attention_sinks):
    attention_with_sinks.
    """
    rows = lambda: torch.arange(q.shape[2], device=q.device)
    if window and window < k.shape[2]:
        band = sliding_band(rows(), torch.arange(k.shape[2], device=q.device), window)
        mask = band if mask is None else mask & band
    if sinks is not None:
        return attention_with_sinks(q, k, v, sliding_band(rows(), rows(), q.shape[2]) if mask is None else mask, sinks)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def attention_with_sinks(q, k, v, mask, sinks):
    """Attention whose softmax also takes each head's sink logit, dropped after (gpt-oss's), written out.

    No fused kernel takes the sinks. q, k, v [b, h, t, k]; `mask` broadcasts to the scores [b, h, t, keys].
    """
    scores = (q @ k.transpose(-1, -2)).float() / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~mask, torch.finfo(torch.float32).min)
    column = sinks.float()[None, :, None, None].expand(*scores.shape[:-1], 1)
    weights = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    return weights.to(v.dtype) @ v


def sliding_band(q_idx, k_idx, window: int) -> torch.Tensor:
    """[q, k] bool: keys at or before the query's slot and fewer than `window` slots behind it."""
    ahead = q_idx[:, None] - k_idx[None, :]
    return (ahead >= 0) & (ahead < window)


# model.float8: the projections in float8 through torchao's float8 training (its "tensorwise" recipe, as jaxpar/ops.py
# `_float8_project`): input and weight e4m3, output gradient e5m2, each with its tensor's current scale, accumulated
# in float32 (torch._scaled_mm: a GPU's float8 matmul, the output's with cuBLAS's fast accumulation as the recipe
# sets, which jaxpar's XLA product does not ask for; on a CPU torch's own). torchao swaps nn.Linear modules,
# which these einsum projections are not: its functional pieces are used on the projection as a 2-D matmul.


@functools.cache
def _torchao_float8() -> dict:
    """torchao's tensorwise recipe and its three matmuls' settings (as its Float8Linear builds them), made once."""
    with quiet_logs("torchao", "torch.utils._pytree"):  # torchao's CUDA kernels it cannot load here: not used
        from torchao.float8 import (  # deferred: torchao, optional (~2 s): model.float8 only
            float8_linear,
            float8_scaling_utils,
            float8_training_tensor as t,
        )
        from torchao.float8.config import Float8LinearConfig  # deferred: torchao, optional (~2 s): model.float8 only

    c = Float8LinearConfig.from_recipe_name("tensorwise")
    mm = t.LinearMMConfig(
        *(
            t.ScaledMMConfig(c.emulate, g.use_fast_accum, False, c.pad_inner_dim)
            for g in (c.gemm_config_output, c.gemm_config_grad_input, c.gemm_config_grad_weight)
        )
    )
    return dict(
        config=c,
        mm=mm,
        matmul=float8_linear.matmul_with_hp_or_float8_args,
        roles=t.GemmInputRole,
        cast=float8_scaling_utils.hp_tensor_to_float8_dynamic,
    )


def _whole_batch() -> bool:
    """Whether a tensor's scale takes its largest magnitude over every rank's batch (all_reduce MAX).

    In a training step of a group, so that a layout picks one process's scales (jaxpar's amax is the whole array's).
    Not under no_grad -- evaluation, and decoding, which rank 0 alone runs: there each rank's own (torchao's
    default).
    """
    return torch.is_grad_enabled() and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class _GradToFloat8(torch.autograd.Function):
    """Forward: y itself.

    Backward: its gradient cast to e5m2 once, for both of the matmul's backward products (torchao's
    NoopFwToFloat8BwDynamic, with the amax reduced over the group when asked).
    """

    @staticmethod
    def forward(ctx, y, reduce: bool):
        ctx.reduce = reduce
        return y

    @staticmethod
    def backward(ctx, dy):
        f = _torchao_float8()
        return f["cast"](
            dy, torch.float8_e5m2, f["mm"], reduce_amax=ctx.reduce, gemm_input_role=f["roles"].GRAD_OUTPUT
        ), None


def float8_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [tokens, in] @ w [in, out] in float8.

    Both cast here (x's amax over the batch, w's over the whole weight -- FSDP2 has gathered it), so the matmul's
    backward reuses these float8 copies (jaxpar's saved ones).
    """
    f, reduce = _torchao_float8(), _whole_batch()
    x8 = f["cast"](x, torch.float8_e4m3fn, f["mm"], reduce_amax=reduce, gemm_input_role=f["roles"].INPUT)
    w8 = f["cast"](w, torch.float8_e4m3fn, f["mm"], gemm_input_role=f["roles"].WEIGHT)
    return _GradToFloat8.apply(f["matmul"].apply(x8, w8, f["mm"], f["config"]), reduce)


def float8_einsum(equation: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """torch.einsum(equation, x, w) for a projection, computed as one float8_matmul.

    A projection keeps x's leading dims and produces w's last ones, with no batch dims in w. x's contracted dims are
    moved last in w's order and flattened, and the output is put back.
    """
    (xs, ws), out = equation.replace(" ", "").split("->")[0].split(","), equation.split("->")[1].strip()
    summed = [c for c in ws if c in xs and c not in out]
    lead, made = [c for c in xs if c not in summed], [c for c in ws if c not in summed]
    x2 = x.permute(*(xs.index(c) for c in lead + summed)).reshape(-1, math.prod(w.shape[ws.index(c)] for c in summed))
    w2 = w.permute(*(ws.index(c) for c in summed + made)).reshape(x2.shape[1], -1)
    y = float8_matmul(x2, w2).reshape(*(x.shape[xs.index(c)] for c in lead), *(w.shape[ws.index(c)] for c in made))
    return y.permute(*((lead + made).index(c) for c in out))
