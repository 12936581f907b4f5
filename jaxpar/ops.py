"""Mesh-free array functions that models, parallel strategies and the train step all use."""

from __future__ import annotations

import contextlib
import contextvars
import sys
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name


def causal_attention(q, k, v, q_pos=None, k_pos=None, q_seg=None, k_seg=None, window: int = 0, sinks=None):
    """Causal attention on q, k, v [batch, seq, heads, head_dim] on one device.

    Masked by global positions when given (a permuted or partial sequence) and, with segment ids, within each
    document (`visible`). `window` (model.sliding_window): each query sees the `window` latest keys, itself
    included; in natural order on the CPU only the key blocks the band reaches are computed (`banded_attention`).
    `sinks` [heads] (model.attention_sinks): a learned logit per head beside each query's scores, which takes its
    share of the softmax and reads no value (gpt-oss). cuDNN flash attention on GPU where it applies. float16 on CPU
    runs in float32 (XLA:CPU has no float16 dot with float32 accumulation, which the scores need; GPU kernels
    accumulate in float32 too) and returns float16.
    """
    if q.dtype == jnp.float16 and jax.default_backend() == "cpu":
        upcast = (t.astype(jnp.float32) for t in (q, k, v))
        return causal_attention(*upcast, q_pos, k_pos, q_seg, k_seg, window, sinks).astype(q.dtype)
    window = 0 if window >= k.shape[1] else window  # a band as wide as the keys is the causal mask itself
    with jax.named_scope("causal_attention"):  # what the FLOPs tests count
        if q_pos is None and window and not _on_gpu() and q.shape[1] == k.shape[1]:
            return banded_attention(q, k, v, window, sinks)
        T, K = q.shape[1], k.shape[1]
        if sinks is not None:  # no fused kernel takes the sinks: written out
            mask = visible(*((jnp.arange(T), jnp.arange(K)) if q_pos is None else (q_pos, k_pos)), q_seg, k_seg, window)
            return _softmax_attention(q, k, v, mask=mask if mask.ndim == 4 else mask[None, None], sinks=sinks)
        if q_pos is None and (not window or _on_gpu()):
            return _attention(q, k, v, is_causal=True, **({"local_window_size": (window - 1, 0)} if window else {}))
        if q_pos is None:  # a band over unequal lengths off the GPU: a mask of the natural positions
            q_pos, k_pos = jnp.arange(T), jnp.arange(K)
        mask = visible(q_pos, k_pos, q_seg, k_seg, window)
        return _attention(q, k, v, mask=mask if mask.ndim == 4 else mask[None, None])


def visible(q_pos, k_pos, q_seg=None, k_seg=None, window: int = 0):
    """Which keys each query attends to: those at its position or before and, with segment ids, in its own document.

    With `window`, only the `window` latest of them (positions within window - 1 of the query's). Positions [q], [k]
    -> [q, k]; per row ([b, q], [b, k]) -> [b, 1, q, k], against scores [b, h, q, k].
    """
    ahead = q_pos[..., :, None] - k_pos[..., None, :]
    mask = ahead >= 0 if not window else (ahead >= 0) & (ahead < window)
    if q_seg is not None:
        mask = mask & (q_seg[..., :, None] == k_seg[..., None, :])
    return mask if mask.ndim == 2 else mask[:, None]


def banded_attention(q, k, v, window: int, sinks=None):
    """Causal attention of a natural-order sequence within a band of `window` keys, computed by blocks.

    The sequence splits into blocks of B tokens (the largest divisor of its length up to the window); each query
    block is scored against the n key blocks the band reaches (its own and ceil((window - 1) / B) before it), so
    the scores cost T x n x B instead of T x T. What is outside the band inside those blocks is masked. `sinks`
    [heads]: causal_attention's.
    """
    b, T, h, d = q.shape
    B = max(s for s in range(1, min(window, T) + 1) if T % s == 0)
    n, nb = -(-(window - 1) // B) + 1, T // B
    if n >= nb:  # the band reaches every block: nothing to skip
        band = jnp.asarray(_band(np.arange(T)[:, None], np.arange(T)[None, :], window))
        return _softmax_attention(q, k, v, mask=band, sinks=sinks)
    lead = jnp.zeros((b, (n - 1) * B, h, d), k.dtype)
    reach = (
        lambda t: jnp.concatenate(  # [b, nb, n * B, h, d]: each query block's key blocks, oldest first
            [jnp.concatenate([lead, t], axis=1)[:, s * B : s * B + T].reshape(b, nb, B, h, d) for s in range(n)], axis=2
        )
    )
    keys, values = reach(k), reach(v)
    q_idx = np.arange(T).reshape(nb, B)
    k_idx = q_idx[:, :1] - (n - 1) * B + np.arange(n * B)  # [nb, n * B]; negative: the zeros before the sequence
    mask = _band(q_idx[:, :, None], k_idx[:, None, :], window) & (k_idx[:, None, :] >= 0)  # [nb, B, n * B]
    scores = jnp.einsum("bqxhd,bqyhd->bqhxy", q.reshape(b, nb, B, h, d), keys) / jnp.sqrt(jnp.asarray(d, q.dtype))
    scores = jnp.where(mask[None, :, None], scores, jnp.finfo(scores.dtype).min)
    weights = _softmax(scores, None if sinks is None else sinks[None, None, :, None, None]).astype(v.dtype)
    return jnp.einsum("bqhxy,bqyhd->bqxhd", weights, values).reshape(b, T, h, d)


def _band(q_idx, k_idx, window: int):
    """Keys at or before the query and fewer than `window` positions behind it (numpy, broadcast)."""
    ahead = q_idx - k_idx
    return (ahead >= 0) & (ahead < window)


def document_positions(tokens, eod: int, segment=None, position=None):
    """(positions, segments) [B, T] int32 of rows of packed documents.

    A document starts at each `eod` token (the data puts one before every document: jaxpar/core/data/tokens.py), its
    positions count from 0 there and its segment id is the previous one's plus one. `segment`, `position` [B]: the
    document a row's first tokens continue and their first position (a row decoded in pieces); by default a document
    starting at 0.
    """
    B, T = tokens.shape
    starts, idx = tokens == eod, jnp.arange(T, dtype=jnp.int32)
    last_start = jax.lax.cummax(jnp.where(starts, idx, -1), axis=1)
    segment = jnp.zeros((B,), jnp.int32) if segment is None else segment
    position = jnp.zeros((B,), jnp.int32) if position is None else position
    segments = segment[:, None] + jnp.cumsum(starts, axis=1, dtype=jnp.int32)
    return jnp.where(last_start >= 0, idx - last_start, position[:, None] + idx), segments


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


_said: set[str] = set()


def _attention(q, k, v, **mask):
    """Attention: on a GPU cuDNN's fused kernel where it accepts the inputs, else XLA's; elsewhere written out.

    On a GPU cuDNN's fused (flash) attention where it accepts the inputs, else XLA's own, the fallback said once per
    reason, never silent (gpu_check also reports what the compiled step calls); elsewhere the attention written out
    (_softmax_attention).
    """
    if not _on_gpu():
        return _softmax_attention(q, k, v, **mask)
    if q.dtype in (jnp.bfloat16, jnp.float16):
        try:
            return jax.nn.dot_product_attention(q, k, v, implementation="cudnn", **mask)
        except Exception as e:  # noqa: BLE001 - cuDNN refuses at trace time (version, shape, head size, GPU)
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
    else:
        reason = f"{q.dtype} inputs; cuDNN's kernel takes bfloat16 or float16"
    if reason not in _said:
        _said.add(reason)
        print(
            f"attention: cuDNN flash attention not used ({reason}); XLA's attention runs instead",
            file=sys.stderr,
            flush=True,
        )
    return jax.nn.dot_product_attention(q, k, v, implementation="xla", **mask)


def _softmax_attention(q, k, v, is_causal: bool = False, mask=None, sinks=None):
    """softmax(q k^T / sqrt(d)) v written out (scores [batch, heads, q, k], float32 softmax).

    What jax.nn.dot_product_attention's XLA path computes, faster on XLA:CPU (benchmarks/cpu_gap/README.md). `sinks`
    [heads]: causal_attention's.
    """
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.asarray(q.shape[-1], q.dtype))
    if is_causal:
        mask = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
    if mask is not None:
        scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    weights = _softmax(scores, None if sinks is None else sinks[None, :, None, None]).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


def _softmax(scores, sinks=None):
    """float32 softmax over the last axis.

    With `sinks` (broadcast to the scores' other axes) one more logit per row takes its share and is dropped (gpt-oss's
    attention sinks).
    """
    scores = scores.astype(jnp.float32)
    if sinks is None:
        return jax.nn.softmax(scores, axis=-1)
    column = jnp.broadcast_to(sinks.astype(jnp.float32), scores.shape[:-1] + (1,))
    return jax.nn.softmax(jnp.concatenate([scores, column], axis=-1), axis=-1)[..., :-1]


def local_attention(q, k, v, positions=None, segments=None, window: int = 0, sinks=None):
    """The default attention of a parallel context: every position of the sequence on this device."""
    return causal_attention(q, k, v, positions, positions, segments, segments, window, sinks)


# the name of every projection's output (jax.ad_checkpoint.checkpoint_name): what model.remat=offload moves to the
# host. A name, not the dot's shape (checkpoint_policies' "no batch dims"), so GPipe's vmap over the stages keeps it
PROJECTION = "projection"


def project(x: jax.Array, w: jax.Array, n_in: int = 1) -> jax.Array:
    """x [..., *in] contracted with w [*in, *out] over its last `n_in` dims -> [..., *out], named PROJECTION.

    The models' projections (the logits keep their einsum). On XLA:CPU through `_cpu_project`, whose backward pass makes
    a training step faster there (benchmarks/cpu_gap/README.md); elsewhere autodiff's own. Inside a shard_map with
    check_vma=True (jaxpar's all pass False) its backward would need w marked varying (jax.lax.pvary) when x varies and
    w does not. While a pipeline stage splits its backward (`split_backward`), what its mode says instead.
    """
    return checkpoint_name(_project(x, w, n_in), PROJECTION)


def _project(x: jax.Array, w: jax.Array, n_in: int) -> jax.Array:
    if _split is not None:
        return _split.project(x, w, n_in)
    if FLOAT8.get():
        return _float8_project(x, w, n_in)
    if jax.default_backend() == "cpu":
        return _cpu_project(x, w, n_in)
    return jnp.tensordot(x, w, n_in)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _cpu_project(x, w, n_in):
    return jnp.tensordot(x, w, n_in)


def _cpu_project_fwd(x, w, n_in):
    return jnp.tensordot(x, w, n_in), (x, w)


def _cpu_project_bwd(n_in, saved, dy):
    """A projection's backward on the CPU, its weight gradient computed as a plain dot that XLA:CPU runs fast.

    Autodiff's weight gradient x^T @ dy is a dot whose left operand XLA:CPU reads transposed, which it runs in Eigen,
    slower than YNNPACK; here x is transposed in a copy of its own ([*in, *lead]), kept from being folded back into the
    dot by an optimization barrier, so the dot is a plain [in, tokens] @ [tokens, out]. No reshapes: a sharded dim
    (tp's heads) never merges with another one.
    """
    x, w = saved
    lead = x.ndim - n_in
    dx = jnp.tensordot(dy, w, (tuple(range(lead, dy.ndim)), tuple(range(n_in, w.ndim))))
    return dx.astype(x.dtype), _weight_grad(x, dy, n_in).astype(w.dtype)


def _weight_grad(x, dy, n_in: int):
    """x [*lead, *in], dy [*lead, *out] -> [*in, *out]; on XLA:CPU x transposed first (_cpu_project_bwd)."""
    lead = x.ndim - n_in
    if jax.default_backend() == "cpu":
        x = jax.lax.optimization_barrier(jnp.moveaxis(x, tuple(range(lead)), tuple(range(n_in, x.ndim))))
        return jnp.tensordot(x, dy, (tuple(range(n_in, x.ndim)), tuple(range(lead))))
    return jnp.tensordot(x, dy, (tuple(range(lead)), tuple(range(lead))))


_cpu_project.defvjp(_cpu_project_fwd, _cpu_project_bwd)

# model.float8: the projections' matmuls in float8 (set while a step is traced: jaxpar/context.py `use`)
FLOAT8: contextvars.ContextVar = contextvars.ContextVar("jaxpar_float8", default=False)


def to_float8(t: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Tensorwise current scaling.

    t divided by its largest magnitude over the format's largest value (the whole tensor's, so every layout picks
    the same scale), in float8 `dtype`; and that scale, which undoes it.
    """
    scale = jnp.maximum(jnp.max(jnp.abs(t)).astype(jnp.float32), 1e-12) / float(jnp.finfo(dtype).max)
    return (t.astype(jnp.float32) / scale).astype(dtype), scale


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _float8_project(x, w, n_in):
    return _float8_project_fwd(x, w, n_in)[0]


def _float8_project_fwd(x, w, n_in):
    """torchao's "tensorwise" recipe.

    Input and weight in e4m3 forward, each with its own scale, the product accumulated in float32 and scaled back;
    the float8 copies are what the backward keeps.
    """
    (x8, sx), (w8, sw) = to_float8(x, jnp.float8_e4m3fn), to_float8(w, jnp.float8_e4m3fn)
    y = jnp.tensordot(x8, w8, n_in, preferred_element_type=jnp.float32) * (sx * sw)
    return y.astype(x.dtype), (x8, sx, w8, sw)


def _float8_project_bwd(n_in, saved, dy):
    """The output gradient in e5m2 (more range, less precision: gradients span more decades than activations)."""
    x8, sx, w8, sw = saved
    dy8, sdy = to_float8(dy, jnp.float8_e5m2)
    lead = x8.ndim - n_in
    dx = jnp.tensordot(
        dy8, w8, (tuple(range(lead, dy.ndim)), tuple(range(n_in, w8.ndim))), preferred_element_type=jnp.float32
    ) * (sdy * sw)
    dw = jnp.tensordot(x8, dy8, (tuple(range(lead)), tuple(range(lead))), preferred_element_type=jnp.float32)
    return dx.astype(dy.dtype), (dw * (sx * sdy)).astype(dy.dtype)


_float8_project.defvjp(_float8_project_fwd, _float8_project_bwd)


class _SplitBackward:
    """How a pipeline stage's projections are traced when its backward is split in two (ZB-H1, ZB-V).

    The split makes B compute no weight gradient of a projection and W compute nothing else
    (jaxpar/pipeline/executor.py):
    - "probe": as usual, each projection's input and output recorded (their shapes);
    - "tap": the weight a constant (B's pullback computes no gradient for it) and a pair of zero taps, (y_tap, x_tap)
      (`_tapped_project`): B's pullback gives y_tap the projection's output gradient dy and x_tap its input x,
      which B's own pass has (kept by F, or recomputed under model.remat). Nothing is recorded, so the layer may be
      a jax.checkpoint (model.remat): what W needs leaves B as cotangents, whatever the remat policy kept;
    - "weights": nothing computed (zeros out); records a scalar zero whose gradient w.r.t. the weight is x^T dy
      from the kept input and output gradient: W differentiates the sum of those scalars, so the layers' own
      forward and backward are dead code.
    scan_layers hands each layer its slice of `side` (tap pairs, or (input, output gradient) pairs, one per
    projection in the order the layer calls them) and stacks what the layer records into `recorded`. remat_layers
    leaves the layer unrecomputed while probing or in W (`recording`): a record made inside a jax.checkpoint would
    leak from its trace, and neither runs a backward of the layers.
    """

    def __init__(self, mode: str, side):
        self.mode, self.side, self.layer, self.recorded = mode, side, None, None

    def project(self, x, w, n_in: int):
        if self.layer is None:
            raise RuntimeError("a projection outside the layer scan while a pipeline stage splits its backward")
        side, records = self.layer
        i = len(records)
        if self.mode == "probe":
            y = jnp.tensordot(x, w, n_in)
            records.append((x, y))
        elif self.mode == "tap":
            y = _tapped_project(x, jax.lax.stop_gradient(w), *side[i], n_in)
            records.append(None)  # counts the layer's projections
        else:
            x, dy = side[i]
            y = jnp.zeros(dy.shape, dy.dtype)
            records.append(_weight_only(w, x, dy, n_in))
        return y

    @property
    def recording(self) -> bool:
        return self.mode != "tap"

    def scan(self, layer: Callable, stacked, x: jax.Array, unroll: bool) -> jax.Array:
        def body(h, xs):
            p, side = xs
            self.layer = (side, [])
            h = layer(h, p)
            records, self.layer = self.layer[1], None
            return h, records if self.recording else []

        h, self.recorded = jax.lax.scan(body, x, (stacked, self.side), unroll=unroll)
        return h


_split: _SplitBackward | None = None


@contextlib.contextmanager
def split_backward(mode: str, side=None):
    """Within: projections traced as `mode` says (_SplitBackward).

    Yields it, whose `recorded` holds what the layer scan's projections recorded, stacked over the layers.
    """
    global _split
    saved, _split = _split, _SplitBackward(mode, side)
    try:
        yield _split
    finally:
        _split = saved


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _weight_only(w, x, dy, n_in):
    return jnp.zeros((), jnp.float32)


def _weight_only_fwd(w, x, dy, n_in):
    return jnp.zeros((), jnp.float32), (w, x, dy)


def _weight_only_bwd(n_in, saved, scale):
    w, x, dy = saved
    return (_weight_grad(x, dy, n_in) * scale.astype(dy.dtype)).astype(w.dtype), None, None


_weight_only.defvjp(_weight_only_fwd, _weight_only_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _tapped_project(x, w, y_tap, x_tap, n_in):
    """x .

    w + y_tap (x_tap unused): the cotangents are dx = dy . w^T, none for w (a constant), dy for y_tap and x itself
    for x_tap -- the pair W's x^T dy needs, out of B's pullback. Where dy is a symbolic zero JAX skips this rule and
    both taps get zeros: x^T 0 is that weight's gradient anyway.
    """
    return jnp.tensordot(x, w, n_in) + y_tap


def _tapped_project_fwd(x, w, y_tap, x_tap, n_in):
    return jnp.tensordot(x, w, n_in) + y_tap, (x, w)


def _tapped_project_bwd(n_in, saved, dy):
    x, w = saved
    lead = x.ndim - n_in
    dx = jnp.tensordot(dy, w, (tuple(range(lead, dy.ndim)), tuple(range(n_in, w.ndim))))
    return dx.astype(x.dtype), jnp.zeros_like(w), dy, x


_tapped_project.defvjp(_tapped_project_fwd, _tapped_project_bwd)


def scan_layers(layer: Callable, stacked, x: jax.Array, rows: tuple = (), unroll: bool = False) -> jax.Array:
    """`layer(h, per_layer_slice, *rows) -> h` applied over the leading axis of `stacked`, in order.

    `rows`: per-row arrays every layer reads (packed documents' positions and segment ids), loop constants outside
    the carry; unrolled: each layer traced on its own (no loop: no per-layer copies into and out of stacked buffers,
    longer compile).
    """
    one = (lambda h, p: layer(h, p, *rows)) if rows else layer
    if _split is not None:
        return _split.scan(one, stacked, x, unroll)
    return jax.lax.scan(lambda h, p: (one(h, p), None), x, stacked, unroll=unroll)[0]


# model.remat: what a recomputed layer keeps from its forward pass
REMAT_POLICIES = {
    "full": None,  # nothing: the backward pass recomputes the whole layer from its input
    "save_matmuls": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # the projections' outputs kept in host memory from the forward pass to the backward, the rest recomputed
    "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(),
        names_which_can_be_offloaded=(PROJECTION,),
        offload_src="device",
        offload_dst="pinned_host",
    ),
}


def remat_layers(run_layers: Callable, remat: str) -> Callable:
    """A layer runner (scan_layers' signature) whose layers the backward pass recomputes as model.remat says.

    `none`: `run_layers` itself. The runner is the parallel context's (jaxpar/parallelize.py), so the same
    recomputed layer runs in a scan, unrolled, as GPipe stages, or in the pipeline executor's stages.
    """
    if remat == "none":
        return run_layers
    policy = REMAT_POLICIES[remat]

    def recomputed(layer, stacked, x, rows=()):
        if _split is not None and _split.recording:  # no backward of the layers runs (_SplitBackward)
            return run_layers(layer, stacked, x, rows)
        return run_layers(jax.checkpoint(layer, policy=policy), stacked, x, rows)

    return recomputed


def split_microbatches(x: jax.Array, M: int) -> jax.Array:
    """[B, ...] -> [M, B/M, ...]; microbatch m takes rows m, m+M, ... so each device keeps its own rows."""
    return x.reshape(x.shape[0] // M, M, *x.shape[1:]).swapaxes(0, 1)


def sum_over_microbatches(
    value_and_grad: Callable, params, batch: jax.Array, scale, M: int, pin: Callable = lambda mb: mb, value=None
):
    """(loss, grads) of value_and_grad(params, microbatch, scale) summed over the batch's M microbatches.

    The sum runs in a scan whose float32 carry is the accumulation; `pin` places each microbatch first (a sharding
    constraint); `value`: zeros shaped as the loss (with experts, (loss, their statistics)).
    """

    def accumulate(carry, mb):
        return jax.tree.map(jnp.add, carry, value_and_grad(params, pin(mb), scale)), None

    zero = (jnp.zeros((), jnp.float32) if value is None else value, jax.tree.map(jnp.zeros_like, params))
    return jax.lax.scan(accumulate, zero, split_microbatches(batch, M))[0]


def join_microbatches(x: jax.Array) -> jax.Array:
    """The inverse of split_microbatches."""
    return x.swapaxes(0, 1).reshape(-1, *x.shape[2:])
