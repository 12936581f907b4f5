"""The parity checks: one run's training series and final parameters against a reference run's.

The per-step loss, gradient norm and lr and the final parameters must match the reference run's within a
`Tolerance`. A failure reads as a table (step, reference, run, difference) for each failing series and names the
first parameter, in model order, that diverges.

Parameters are held by two numbers, as in tests/jaxpar/test_layouts.py: the relative norm of the difference
over all parameters, and a per-tensor maximum absolute difference. One slice is held apart: the
attention key bias (`blocks.attn.qkv.bias[:, 1]`) has an exactly zero true gradient (softmax is
invariant to it), so Adam moves it by normalised rounding noise only (about lr * noise / eps per
step; ~lr per step in bfloat16, where the noise exceeds Adam's eps). Over 50 steps that noise is as
large as the whole float32 budget of the other parameters, so it is compared on its own
("blocks.attn.qkv.bias[key]"), against a fraction of the run's summed learning rate (`key_bias_lr`):
a real gradient would move it by up to ~lr every step; the rest of qkv.bias is checked as usual.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from jaxpar.core.weights.names import ALL_NAMES

SERIES = ("loss", "grad_norm", "lr")
QKV_BIAS, KEY_BIAS = "blocks.attn.qkv.bias", "blocks.attn.qkv.bias[key]"
MTP_QKV_BIAS = "mtp.block.attn.qkv.bias"  # multi-token prediction's blocks (model.mtp_depth): their key bias likewise
STACKS = ("dense_", "")  # model.moe_first_dense's stack ("dense_blocks.*") runs before the experts' ("blocks.*")
# model order: embeddings, each stack's blocks (ln1, attn, ln2, mlp), the final norm, the output projection; the key
# bias after the rest of qkv.bias
_NAMES = tuple(n for name in ALL_NAMES for n in ((name, KEY_BIAS) if name == QKV_BIAS else (name,)))
_STACKED = [n for n in _NAMES if n.startswith("blocks.")]
PARAM_ORDER = ("wte", "wpe", *(stack + n for stack in STACKS for n in _STACKED), "ln_f.scale", "ln_f.bias", "lm_head")


@dataclass(frozen=True)
class Tolerance:
    name: str
    loss: float  # relative, at every step
    grad_norm: float  # relative, at every step
    lr: float  # relative, at every step
    params: float  # relative norm of the difference over all parameters
    param_abs: float  # maximum absolute difference within any one tensor
    key_bias_lr: float  # max abs difference of the attention key bias, as a fraction of sum(lr over steps)


# float32, highest matmul precision, 50 steps: jaxpar vs torchpar, and every layout/backend.
FLOAT32 = Tolerance("float32", loss=1e-5, grad_norm=1e-4, lr=1e-6, params=1e-5, param_abs=5e-5, key_bias_lr=0.01)
# float32 with 8-bit optimizer moments (optim.name=adamw8bit), against its one-device run: a gradient that differs
# in its last bits can put a moment value on the other side of a rounding midpoint, one code away, and that weight
# then steps differently (tests/jaxpar/test_adamw8bit.py, fsdp=2,ep=2 at lr 1e-2 over 10 steps: 40 of 16,384 expert
# weights moved, at most 1.0e-3; parameters 1.4e-4 relative norm; the loss within 3e-7; torchpar ddp against one
# process, tests/torchpar/test_adamw8bit.py: the gradient norm of step 9 2.9e-4 away, the loss within 1e-5)
EIGHT_BIT = Tolerance(
    "float32, 8-bit moments", loss=1e-5, grad_norm=1e-3, lr=1e-6, params=5e-4, param_abs=5e-3, key_bias_lr=0.01
)
# bfloat16 compute against the same framework's float32 run (docs/parity.md has the measured deviations).
BFLOAT16 = Tolerance(
    "bfloat16 vs float32", loss=5e-3, grad_norm=5e-2, lr=1e-6, params=2e-2, param_abs=2e-2, key_bias_lr=2.0
)
# float16 compute on both sides against jaxpar's one-device float16 run: the frameworks round float16 matmuls
# and attention differently (docs/parity.md has the measured deviations).
FLOAT16 = Tolerance("float16", loss=1e-3, grad_norm=1e-2, lr=1e-6, params=1e-2, param_abs=1e-2, key_bias_lr=2.0)


@dataclass
class Comparison:
    run: str  # "float32 torch:fsdp"
    ref: str  # "float32 jax:1"
    tol: Tolerance
    deviations: dict = field(default_factory=dict)  # loss/grad_norm/lr: max rel; params: rel norm; param_abs
    failures: list[str] = field(default_factory=list)
    first_param: str | None = None  # first parameter (model order) over the per-tensor bound

    @property
    def ok(self) -> bool:
        return not self.failures

    def message(self) -> str:
        head = f"parity: {self.run} vs {self.ref} ({self.tol.name} tolerances): " + ("ok" if self.ok else "FAILED")
        return "\n".join([head, *self.failures])


def split_key_bias(params: dict) -> dict:
    """Split qkv.bias into its query/value slices and its key slice.

    qkv.bias [L, 3, heads, kv] -> its query/value slices [L, 2, heads, kv] and the key slice [L, heads, kv],
    in each stack (multi-token prediction's too).
    """
    out = dict(params)
    pairs = [(stack + QKV_BIAS, stack + KEY_BIAS) for stack in STACKS] + [(MTP_QKV_BIAS, MTP_QKV_BIAS + "[key]")]
    for qkv, key in ((qkv, key) for qkv, key in pairs if qkv in params):
        b = np.asarray(params[qkv])
        out[qkv], out[key] = b[:, [0, 2]], b[:, 1]
    return out


def _rel(got, ref) -> np.ndarray:
    """Relative deviation per step.

    A step non-finite on both sides (a float16 overflow both skipped) is 0, on one side only inf.
    """
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    both = ~np.isfinite(got) & ~np.isfinite(ref)
    with np.errstate(invalid="ignore"):
        rel = np.abs(got - ref) / np.maximum(np.abs(ref), 1e-30)
    return np.where(both, 0.0, np.where(np.isnan(rel), np.inf, rel))


def _table(series: str, got, ref, rel, bound, run: str, ref_name: str, rows: int = 8) -> str:
    bad = np.flatnonzero(rel > bound)
    first, worst = int(bad[0]), int(np.argmax(rel))
    shown = sorted(set(range(first, min(first + rows, len(rel)))) | {worst})
    width = max(len(run), len(ref_name), 14)
    lines = [
        f"{series}: {len(bad)} of {len(rel)} steps over {bound:g} relative; first at step {first + 1}, "
        f"worst {rel[worst]:.3e} at step {worst + 1}",
        f"  {'step':>5}  {ref_name:>{width}}  {run:>{width}}  {'diff':>11}  {'rel':>9}",
    ]
    for i in shown:
        mark = " !" if rel[i] > bound else ""
        lines.append(
            f"  {i + 1:>5}  {ref[i]:>{width}.8g}  {got[i]:>{width}.8g}  {got[i] - ref[i]:>11.3e}  {rel[i]:>9.2e}{mark}"
        )
    return "\n".join(lines)


def compare(got, ref, tol: Tolerance) -> Comparison:
    """`got` and `ref` are runner.Run objects (or anything with loss/grad_norm/lr lists, params, side, config)."""
    c = Comparison(f"{got.config} {got.side}", f"{ref.config} {ref.side}", tol)
    for s in SERIES:
        g, r = getattr(got, s), getattr(ref, s)
        if len(g) != len(r):
            c.failures.append(f"{s}: {len(g)} steps vs {len(r)} in the reference")
            continue
        rel = _rel(g, r)
        c.deviations[s] = float(rel.max())
        if rel.max() > getattr(tol, s):
            c.failures.append(_table(s, g, r, rel, getattr(tol, s), got.side, ref.side))
    if set(got.params) != set(ref.params) or any(got.params[n].shape != ref.params[n].shape for n in ref.params):
        c.failures.append(f"parameters: names or shapes differ: {sorted(set(got.params) ^ set(ref.params))[:5]}")
        return c
    gp, rp = split_key_bias(got.params), split_key_bias(ref.params)
    names = [n for n in PARAM_ORDER if n in rp] + sorted(set(rp) - set(PARAM_ORDER))
    diff = {n: gp[n].astype(np.float64) - rp[n] for n in names}
    max_abs = {n: float(np.max(np.abs(d))) for n, d in diff.items()}
    key_bound = tol.key_bias_lr * float(np.sum(ref.lr))
    keys = [n for n in names if n.endswith(KEY_BIAS)]
    bound = {n: key_bound if n in keys else tol.param_abs for n in names}
    if keys:
        c.deviations["key_bias_abs"] = max(max_abs.pop(n) for n in keys)
        c.deviations["key_bias_bound"] = key_bound
    sq = {n: float(np.sum(diff[n] ** 2)) for n in max_abs}
    total = np.sqrt(sum(float(np.sum(rp[n].astype(np.float64) ** 2)) for n in max_abs))
    c.deviations["params"] = float(np.sqrt(sum(sq.values())) / total)
    worst = max(max_abs, key=max_abs.get)
    c.deviations["param_abs"], c.deviations["param_abs_name"] = max_abs[worst], worst
    over = [n for n in names if np.max(np.abs(diff[n])) > bound[n]]
    if over or c.deviations["params"] > tol.params:
        # The first tensor over its bound in model order; else the one holding most of the norm.
        first = c.first_param = over[0] if over else max(sq, key=sq.get)
        d = diff[first]
        at = np.unravel_index(int(np.argmax(np.abs(d))), d.shape)
        lines = [
            f"parameters: relative norm of the difference {c.deviations['params']:.3e} (bound {tol.params:g}); "
            f"{len(over)} tensor(s) over their absolute bound ({tol.param_abs:g}; key bias {key_bound:.2g})",
            f"  first divergent parameter: {first} (max abs diff {np.max(np.abs(d)):.3e} at "
            f"index {tuple(int(i) for i in at)}: {ref.side} {rp[first][at]:.8g}, {got.side} {gp[first][at]:.8g})",
        ]
        lines += [f"  {n:<26} max abs diff {np.max(np.abs(diff[n])):.3e}" for n in over[1:6]]
        c.failures.append("\n".join(lines))
    return c


def assert_parity(got, ref, tol: Tolerance) -> Comparison:
    c = compare(got, ref, tol)
    assert c.ok, c.message()
    return c
