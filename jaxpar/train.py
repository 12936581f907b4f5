"""python -m jaxpar.train --config configs/gpt2-tiny.yaml --mesh dp=2,tp=4 [section.key=value ...]"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

from jaxpar.config import Config, load_config, profile_window
from jaxpar.errors import UserError, cli
from jaxpar.faults import fault_hooks
from jaxpar.mesh import format_mesh, parse_mesh, setup_devices


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m jaxpar.train", description=__doc__)
    p.add_argument("--config", help="YAML config (configs/*.yaml); built-in defaults if omitted")
    p.add_argument("--mesh", help="mesh axes, e.g. dp=2,fsdp=2,tp=2 (overrides parallel.mesh)")
    p.add_argument("--write-init", metavar="PATH",
                   help="write the initial weights (shared safetensors layout) to PATH and exit")
    p.add_argument("--write-final", metavar="PATH",
                   help="after training, also write the final weights (shared safetensors layout) to PATH")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    return p.parse_intermixed_args(argv)


def _write_weights(path: str, params, which: str) -> None:
    """Gather the parameters (every process takes part) and write the shared file from process 0."""
    import jax
    from jax.experimental import multihost_utils

    from jaxpar.compat.weights import save_weights

    params = multihost_utils.process_allgather(params, tiled=True)
    if jax.process_index() == 0:
        save_weights(path, params)
        print(f"wrote {which} weights to {path}", file=sys.stderr)


def train(cfg: Config, mesh_spec: str, write_init: str | None = None, write_final: str | None = None) -> int:
    sizes = parse_mesh(mesh_spec)
    setup_devices(sizes)
    import jax

    from jaxpar import state as st

    from jaxpar.checkpoint import Checkpointer, abstract_like
    from jaxpar.compat.weights import flatten, load_weights, unflatten
    from jaxpar.data import TokenBatches, resolve_dataset
    from jaxpar.mesh import make_mesh
    from jaxpar.parallel.pipeline import resolve_microbatches
    from jaxpar.parallel.schedules import bubble_fraction, simulate
    from jaxpar.metrics import MetricsLog, device_memory_gib, flops_per_token, peak_flops
    from jaxpar.sharding import rules_for

    if cfg.train.matmul_precision != "default":
        jax.config.update("jax_default_matmul_precision", cfg.train.matmul_precision)
    mesh = make_mesh(sizes)
    main_proc = jax.process_index() == 0
    t, d = cfg.train, cfg.data
    dataset = resolve_dataset(d)
    micro_batch = t.global_batch_size // t.microbatches
    train_data = TokenBatches(dataset, d.seq_len, t.global_batch_size, t.seed, "train", d.val_fraction)
    val_data = TokenBatches(dataset, d.seq_len, micro_batch, t.seed, "val", d.val_fraction)
    if train_data.vocab_size > cfg.model.vocab_size:
        raise UserError(f"dataset {dataset} has vocab {train_data.vocab_size} > model.vocab_size={cfg.model.vocab_size}")

    layout = st.Layout(cfg, mesh, rules_for(cfg.parallel.zero_stage))
    os.makedirs(cfg.run.dir, exist_ok=True)
    ckpt = Checkpointer(cfg.run.dir, cfg.checkpoint.keep)
    abstract = abstract_like(jax.eval_shape(lambda: st.init_state(layout)), layout.state_shardings)
    restored = ckpt.restore_latest(abstract) if cfg.checkpoint.resume else None
    if restored:
        state, meta = restored
        print(f"resumed from {ckpt.dir}/{meta['step']}", file=sys.stderr)
    elif cfg.model.init_from:
        shapes = {k: v.shape for k, v in flatten(abstract["params"]).items()}
        state = st.state_from_params(layout, unflatten(load_weights(cfg.model.init_from, shapes)))
    else:
        state = st.init_state(layout)
    if write_init:
        _write_weights(write_init, state["params"], "initial")
        return 0
    if main_proc:
        with open(os.path.join(cfg.run.dir, "config.json"), "w") as f:
            json.dump({**cfg.to_dict(), "resolved_mesh": format_mesh(dict(mesh.shape))}, f, indent=2)

    batch_shape = (t.global_batch_size, d.seq_len + 1)
    t0 = time.perf_counter()
    train_step = st.make_train_step(layout).lower(state, jax.ShapeDtypeStruct(batch_shape, "int32", sharding=layout.batch_sharding)).compile()
    eval_step = st.make_eval_step(layout)
    if main_proc:
        print(f"mesh {format_mesh(dict(mesh.shape))} on {jax.device_count()} {jax.devices()[0].platform} devices; "
              f"{sum(x.size for x in jax.tree.leaves(state['params'])):,} params; compiled in {time.perf_counter() - t0:.1f}s",
              flush=True)

    def evaluate(params) -> float:
        losses = [eval_step(params, st.device_batch(val_data, i, layout.batch_sharding, (micro_batch, d.seq_len + 1)))
                  for i in range(t.eval_batches)]
        return float(sum(jax.device_get(losses)) / len(losses))

    stop = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _: stop.setdefault("signal", signum))

    log = MetricsLog(cfg.run.dir, main_proc, t.steps)
    peak = peak_flops(jax.devices()[0].device_kind, cfg.model.compute_dtype)
    stages, par = mesh.shape["pp"], cfg.parallel
    bubble = None
    if stages > 1:
        n_micro = resolve_microbatches(stages, par.pipeline_microbatches)
        bubble = bubble_fraction(simulate(par.pipeline_schedule, stages, n_micro, par.pipeline_virtual_stages))
        if main_proc:
            print(f"pipeline {par.pipeline_schedule}: {stages} stages x {par.pipeline_virtual_stages} virtual, "
                  f"{n_micro} microbatches, bubble {bubble:.3f}", flush=True)
    fpt = flops_per_token(cfg.model, d.seq_len)
    step, mark, mark_step = int(state["step"]), time.perf_counter(), int(state["step"])
    meta = lambda s: {"step": s, "data_step": s, "mesh": format_mesh(dict(mesh.shape))}  # noqa: E731
    prof = profile_window(t.profile_steps)
    while step < t.steps and "signal" not in stop:
        if prof and step == prof[0]:
            jax.profiler.start_trace(os.path.join(cfg.run.dir, "profile"))
        state, metrics = train_step(state, st.device_batch(train_data, step, layout.batch_sharding, batch_shape))
        step += 1
        if prof and step == prof[1]:
            jax.profiler.stop_trace()
        last = step == t.steps or "signal" in stop
        do_eval = last or (t.eval_every and step % t.eval_every == 0)
        logged = step % t.log_every == 0 or do_eval or last
        if logged:
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}  # waits for the step
            now = time.perf_counter()
            tps = (step - mark_step) * t.global_batch_size * d.seq_len / (now - mark)
            record = {"step": step, **metrics, "tokens_per_sec": tps, "step_time_s": (now - mark) / (step - mark_step),
                      "mfu": tps * fpt / (peak * jax.device_count()) if peak else None,
                      "memory_gib": device_memory_gib(jax.local_devices()[0]), "pipeline_bubble": bubble}
            if do_eval:
                record["eval_loss"] = evaluate(state["params"])
            log.log(record)
        if last or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
            ckpt.save(step, state, meta(step))
        if logged:  # throughput covers training steps only, not evaluation or checkpoint saves
            mark, mark_step = time.perf_counter(), step
        fault_hooks("JAXPAR", step)  # test hooks (jaxpar/faults.py)
    if prof and prof[0] <= step < prof[1]:
        jax.profiler.stop_trace()  # stopped early (signal or end of training) inside the window
    if "signal" in stop:
        ckpt.save(step, state, meta(step))
        print(f"stopped by signal {stop['signal']} after step {step}; checkpoint saved", file=sys.stderr)
    if write_final:
        _write_weights(write_final, state["params"], "final")
    ckpt.close()
    log.close()
    return 0


@cli
def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    cfg = load_config(args.config, args.overrides)
    return train(cfg, args.mesh or cfg.parallel.mesh, args.write_init, args.write_final)


if __name__ == "__main__":
    sys.exit(main())
