"""Time a standalone single-device JAX train step of jaxpar's GPT-2, optionally against jaxpar's and torchpar's.

The step here uses no jaxpar code and is timed like jaxpar.tools.bench; it can be A/B-compared with jaxpar's own step
(and torchpar's) in the same process, the variants alternating.

    python benchmarks/cpu_gap/minimal_step.py [--d_model 128 --n_layer 4 --n_head 4 --seq_len 64 --batch 16 --vocab 256]
        [--impls min,jaxpar] [--rounds 5] [--steps 10] [--warmup 3]

Each impl is compiled once and warmed up (`--warmup` steps); then, for each of `--rounds` rounds, every impl in turn
runs `--steps` timed steps (each synchronised with block_until_ready) whose median is that round's step time.
Reported per impl: tokens/s of the best round (min step time) and of the median round.

Impl specs (comma separated):
  min[:opt:opt...]   this file's step. Options (defaults first):
                     loop|scan|scanU (Python loop over layers | lax.scan | lax.scan unroll=True)
                     hand|xla        attention: hand-written softmax attention | jax.nn.dot_product_attention
                     gather|masked   cross-entropy target logit: take_along_axis | masked sum over the vocab (jaxpar's)
                     w2d|w4d         qkv / out weights as 2-D matrices | jaxpar's [d,3,h,k] / [h,k,d] einsums
                     opt|noopt       optax AdamW+clip update | plain SGD (to price the optimizer)
                     tgrad           dense layers with a custom VJP whose backward transposes x in a copy of its
                                     own (behind an optimization barrier), so the weight gradient is a plain
                                     [in,tokens]@[tokens,out] dot (YNNPACK) instead of an Eigen dot with a transposed
                                     lhs; tgradfwd: the same with x saved transposed in the forward pass instead
  jaxpar[:plaindense]  jaxpar.step.make_train_step on a dp=1 layout (imports jaxpar; same config via the flags);
                     :plaindense traces GPT-2 with autodiff's tensordot instead of ops.project (in-process A/B)
  torch-compiled, torch-eager   torchpar's `none` engine step (blocks torch.compile'd or not)
A JAX impl may end in @flag=value@flag=value: XLA debug options for that compilation only (compiler_options), e.g.
  jaxpar@xla_cpu_use_onednn=true@xla_cpu_experimental_onednn_fusion_type=dot
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import numpy as np

# the optimizer and schedule of configs/gpt2-tiny.yaml (jaxpar's defaults for the rest)
LR, MIN_LR, WARMUP, TOTAL = 3e-3, 3e-4, 15, 150
B1, B2, EPS, WD, CLIP = 0.9, 0.95, 1e-8, 0.1, 1.0
INIT_STD, LN_EPS = 0.02, 1e-5


# ---------------------------------------------------------------- the minimal JAX step (no jaxpar)
def init_params(key, a, w4d: bool):
    import jax
    import jax.numpy as jnp

    d, L, V, P, f, h = a.d_model, a.n_layer, a.vocab, a.seq_len, 4 * a.d_model, a.n_head
    k = d // h
    keys = iter(jax.random.split(key, 8))
    nrm = lambda shape, std=INIT_STD: std * jax.random.normal(next(keys), shape, jnp.float32)
    ps = INIT_STD / math.sqrt(2 * L)
    blocks = {
        "ln1": {"scale": jnp.ones((L, d)), "bias": jnp.zeros((L, d))},
        "ln2": {"scale": jnp.ones((L, d)), "bias": jnp.zeros((L, d))},
        "qkv": {
            "kernel": nrm((L, d, 3, h, k) if w4d else (L, d, 3 * d)),
            "bias": jnp.zeros((L, 3, h, k) if w4d else (L, 3 * d)),
        },
        "out": {"kernel": nrm((L, h, k, d) if w4d else (L, d, d), ps), "bias": jnp.zeros((L, d))},
        "fc": {"kernel": nrm((L, d, f)), "bias": jnp.zeros((L, f))},
        "proj": {"kernel": nrm((L, f, d), ps), "bias": jnp.zeros((L, d))},
    }
    return {
        "wte": nrm((V, d)),
        "wpe": nrm((P, d)),
        "blocks": blocks,
        "ln_f": {"scale": jnp.ones((d,)), "bias": jnp.zeros((d,))},
    }


def build_min(a, opts: set[str], xla: dict | None = None):
    import jax
    import jax.numpy as jnp
    import optax

    layers = "scanU" if "scanU" in opts else "scan" if "scan" in opts else "loop"
    w4d = "w4d" in opts
    h = a.n_head

    def layernorm(x, p):
        mean = x.mean(-1, keepdims=True)
        var = jnp.square(x - mean).mean(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + LN_EPS) * p["scale"] + p["bias"]

    def attention(q, k, v):  # [b, t, h, k]
        if "xla" in opts:
            return jax.nn.dot_product_attention(q, k, v, is_causal=True)
        T = q.shape[1]
        s = jnp.einsum("bqhk,bshk->bhqs", q, k) / math.sqrt(q.shape[-1])
        mask = jnp.tril(jnp.ones((T, T), bool))
        s = jnp.where(mask, s, -1e30)
        p = jax.nn.softmax(s, axis=-1)
        return jnp.einsum("bhqs,bshk->bqhk", p, v)

    @jax.custom_vjp
    def dense_t(x, w):
        return x @ w

    def dense_t_fwd(x, w):
        return x @ w, (x.reshape(-1, x.shape[-1]).T if "tgradfwd" in opts else x, w)

    def dense_t_bwd(res, dy):
        x, w = res
        xt = x if "tgradfwd" in opts else jax.lax.optimization_barrier(x.reshape(-1, x.shape[-1]).T)
        return dy @ w.T, xt @ dy.reshape(-1, dy.shape[-1])

    dense_t.defvjp(dense_t_fwd, dense_t_bwd)
    mm = dense_t if {"tgrad", "tgradfwd"} & opts else (lambda x, w: x @ w)

    def block(x, p):
        B, T, d = x.shape
        y = layernorm(x, p["ln1"])
        if w4d:
            q, k, v = jnp.einsum("btd,dchk->cbthk", y, p["qkv"]["kernel"]) + p["qkv"]["bias"][:, None, None]
            o = attention(q, k, v)
            x = x + jnp.einsum("bthk,hkd->btd", o, p["out"]["kernel"]) + p["out"]["bias"]
        else:
            qkv = (mm(y, p["qkv"]["kernel"]) + p["qkv"]["bias"]).reshape(B, T, 3, h, d // h)
            o = attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]).reshape(B, T, d)
            x = x + mm(o, p["out"]["kernel"]) + p["out"]["bias"]
        y = layernorm(x, p["ln2"])
        y = jax.nn.gelu(mm(y, p["fc"]["kernel"]) + p["fc"]["bias"], approximate=True)
        return x + mm(y, p["proj"]["kernel"]) + p["proj"]["bias"]

    def loss_fn(params, batch):
        inputs, targets = batch[:, :-1], batch[:, 1:]
        x = params["wte"][inputs] + params["wpe"][: inputs.shape[1]]
        if layers == "loop":
            for i in range(a.n_layer):
                x = block(x, jax.tree.map(lambda t: t[i], params["blocks"]))
        else:
            x = jax.lax.scan(
                lambda c, p: (block(c, p), None), x, params["blocks"], unroll=True if layers == "scanU" else 1
            )[0]
        logits = layernorm(x, params["ln_f"]) @ params["wte"].T
        logz = jax.nn.logsumexp(logits, -1)
        if "masked" in opts:
            vocab = jax.lax.broadcasted_iota(targets.dtype, logits.shape, 2)
            picked = jnp.sum(jnp.where(vocab == targets[..., None], logits, 0.0), -1)
        else:
            picked = jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
        return jnp.mean(logz - picked)

    def lr(step):
        step = jnp.asarray(step, jnp.float32)
        ramp = LR * (step + 1) / WARMUP
        progress = jnp.clip((step - WARMUP) / (TOTAL - WARMUP), 0.0, 1.0)
        return jnp.where(step < WARMUP, ramp, MIN_LR + 0.5 * (LR - MIN_LR) * (1 + jnp.cos(math.pi * progress)))

    decay_mask = lambda params: jax.tree_util.tree_map_with_path(
        lambda path, _: path[-1].key not in ("bias", "scale"), params
    )
    if "noopt" in opts:
        tx = optax.sgd(lr)
    else:
        tx = optax.chain(
            optax.clip_by_global_norm(CLIP), optax.adamw(lr, b1=B1, b2=B2, eps=EPS, weight_decay=WD, mask=decay_mask)
        )

    def step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        new = {
            "params": optax.apply_updates(state["params"], updates),
            "opt_state": opt_state,
            "step": state["step"] + 1,
        }
        return new, {"loss": loss, "grad_norm": optax.global_norm(grads), "lr": lr(state["step"])}

    params = init_params(jax.random.key(0), a, w4d)
    state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}
    batch = jnp.asarray(tokens(a))
    compiled = jax.jit(step, donate_argnums=0).lower(state, batch).compile(xla or None)
    return jax_runner(compiled, state, batch)


def tokens(a):
    return np.random.default_rng(0).integers(0, a.vocab, (a.batch, a.seq_len + 1), dtype=np.int32)


def jax_runner(compiled, state, batch):
    import jax

    box = [state]

    def run():
        box[0], metrics = compiled(box[0], batch)
        jax.block_until_ready(metrics)
        return metrics

    run.compiled = compiled
    return run


# ---------------------------------------------------------------- jaxpar's own step (A/B mode)
def overrides(a) -> list[str]:
    return [
        f"model.d_model={a.d_model}",
        f"model.n_layer={a.n_layer}",
        f"model.n_head={a.n_head}",
        f"model.vocab_size={a.vocab}",
        f"data.seq_len={a.seq_len}",
        f"model.max_seq_len={a.seq_len}",
        f"train.global_batch_size={a.batch}",
    ]


def config(a):
    from jaxpar.core.config.schema import load_config

    here = os.path.dirname(os.path.abspath(__file__))
    return load_config(os.path.join(here, "..", "..", "configs", "gpt2-tiny.yaml"), overrides(a) + a.override)


def build_jaxpar(a, xla: dict | None = None, opts: set[str] = frozenset()):
    """opts: "plaindense" traces the model with autodiff's tensordot where jaxpar calls ops.project (A/B of it)."""
    import jax

    import jaxpar.models.decoder as decoder

    from jaxpar.step import build_step

    saved = decoder.project
    if "plaindense" in opts:
        decoder.project = lambda x, w, n_in=1: jax.numpy.tensordot(x, w, n_in)
    try:
        layout, state, compiled = build_step(config(a), {"dp": 1}, compiler_options=xla or None)
    finally:
        decoder.project = saved
    batch = jax.device_put(tokens(a), layout.batch_sharding)
    return jax_runner(compiled, state, batch)


def build_torch(a, compiled: bool):
    import torch

    from torchpar import dist
    from torchpar.parallelize import parallelize
    from torchpar.models.decoder import Decoder

    cfg = config(a)
    env = dist.init(False, cfg.run.peer_timeout_s)
    model = Decoder(cfg.model)
    model.init_weights(cfg.train.seed)
    engine = parallelize(model, cfg, env, "none", compile_model=compiled)[0]
    batch = torch.from_numpy(tokens(a)).long()
    return lambda: engine.update(batch)


# ---------------------------------------------------------------- timing
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (
        ("d_model", 128),
        ("n_layer", 4),
        ("n_head", 4),
        ("seq_len", 64),
        ("batch", 16),
        ("vocab", 256),
    ):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--impls", default="min,jaxpar")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--override", action="append", default=[], help="extra jaxpar config override (k=v)")
    a = ap.parse_args(argv)
    impls = a.impls.split(",")
    if any(i.startswith(("jaxpar", "torch")) for i in impls):
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    if any(i.split("@")[0].split(":")[0] == "jaxpar" for i in impls):
        from jaxpar.mesh import setup_devices

        setup_devices({"dp": 1})
    runners = {}
    for impl in impls:
        t0 = time.perf_counter()
        base, *flags = impl.split("@")
        xla = {k: {"true": True, "false": False}.get(v, v) for k, v in (f.split("=", 1) for f in flags)}
        if base.split(":")[0] == "jaxpar":
            runners[impl] = build_jaxpar(a, xla, set(base.split(":")[1:]))
        elif base.startswith("torch-"):
            runners[impl] = build_torch(a, base == "torch-compiled")
        else:
            runners[impl] = build_min(a, set(base.split(":")[1:]), xla)
        for _ in range(a.warmup):
            runners[impl]()
        print(f"# {impl}: built + warmed up in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    per_round = {impl: [] for impl in impls}
    for _ in range(a.rounds):
        for impl, run in runners.items():
            run()  # one untimed step after switching impls
            times = []
            for _ in range(a.steps):
                t0 = time.perf_counter()
                run()
                times.append(time.perf_counter() - t0)
            per_round[impl].append(statistics.median(times))
    tok = a.batch * a.seq_len
    print(
        f"# d_model={a.d_model} n_layer={a.n_layer} n_head={a.n_head} seq_len={a.seq_len} batch={a.batch} "
        f"vocab={a.vocab}; {a.rounds} rounds x {a.steps} steps"
    )
    print(f"{'impl':<32} {'tok/s best':>11} {'tok/s median':>13} {'ms best':>8} {'ms median':>10}")
    for impl, ts in per_round.items():
        best, med = min(ts), statistics.median(ts)
        print(f"{impl:<32} {tok / best:>11,.0f} {tok / med:>13,.0f} {best * 1e3:>8.2f} {med * 1e3:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
