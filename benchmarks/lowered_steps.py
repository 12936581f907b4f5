"""The lowered train step of 10 representative configurations, for comparing two trees of jaxpar.

A restructuring that changes no behaviour leaves each configuration's lowered (not compiled) StableHLO identical
once location metadata is stripped:

  git worktree add ../before REV
  python benchmarks/lowered_steps.py --repo ../before --out /tmp/lowered_before
  python benchmarks/lowered_steps.py --repo . --out /tmp/lowered_after
  python benchmarks/lowered_steps.py --compare /tmp/lowered_before /tmp/lowered_after

Each configuration runs in its own subprocess in the tree (cwd and PYTHONPATH), on 8 simulated CPU devices, through
jaxpar.step (make_train_step, abstract_state), jaxpar.layout (Layout), jaxpar.mesh (make_mesh) and the config
loader only, so that trees of different layouts compare.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import subprocess
import sys
import time

# name -> (base config relative to the repo, mesh sizes, overrides)
CONFIGS = {
    "01_single": ("configs/gpt2-tiny.yaml", {"dp": 1}, []),
    "02_dp2_tp4": ("configs/gpt2-tiny.yaml", {"dp": 2, "tp": 4}, []),
    "03_dp2_fsdp2_tp2_zero3": ("configs/gpt2-tiny.yaml", {"dp": 2, "fsdp": 2, "tp": 2}, ["parallel.zero_stage=3"]),
    "04_pp2_gpipe": ("configs/gpt2-tiny.yaml", {"pp": 2}, ["parallel.pipeline_schedule=gpipe"]),
    "05_dp2_pp2_1f1b": ("configs/gpt2-tiny.yaml", {"dp": 2, "pp": 2}, ["parallel.pipeline_schedule=1f1b"]),
    "06_pp2_zb_v": ("configs/gpt2-tiny.yaml", {"pp": 2}, ["parallel.pipeline_schedule=zb_v"]),
    "07_dp2_sp2_ring": ("configs/gpt2-tiny.yaml", {"dp": 2, "sp": 2}, ["parallel.sequence_attention=ring"]),
    "08_moe_dp2_ep2": ("configs/moe-tiny.yaml", {"dp": 2, "ep": 2}, []),
    "09_llama_mla_dp2_tp2": (
        "configs/llama-tiny.yaml",
        {"dp": 2, "tp": 2},
        ["model.attention=mla", "model.q_latent_dim=64", "model.kv_latent_dim=32", "model.rope_head_dim=16"],
    ),
    "10_bf16_powersgd_dp4": (
        "configs/gpt2-tiny.yaml",
        {"dp": 4},
        ["model.compute_dtype=bfloat16", "parallel.grad_compression=powersgd"],
    ),
}

LOC_ATTR = re.compile(r"\s*loc\((?:[^()]|\((?:[^()]|\([^()]*\))*\))*\)")  # loc(...) with up to 2 nesting levels
LOC_LINE = re.compile(r"^#loc\d*\s*=.*$\n?", re.M)


def strip_locations(text: str) -> str:
    return LOC_ATTR.sub("", LOC_LINE.sub("", text))


def child(repo: str, name: str, out: str) -> None:
    """In the subprocess: lower the train step of configuration `name` in `repo`, write <out>/<name>.mlir."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [repo] + [p for p in sys.path if os.path.abspath(p or ".") not in (here, repo)]
    import inspect

    import jax

    try:
        from jaxpar.core.config.schema import load_config
    except ImportError:
        from jaxpar.core.config import load_config
    import jaxpar
    import jaxpar.step as step_mod
    from jaxpar.layout import Layout
    from jaxpar.mesh import make_mesh

    assert os.path.abspath(jaxpar.__file__).startswith(os.path.abspath(repo) + os.sep), jaxpar.__file__
    abstract_state = getattr(step_mod, "abstract_state", None)
    if abstract_state is None:  # step.py no longer imports it under that name
        from jaxpar.state import abstract_state

    base, sizes, overrides = CONFIGS[name]
    cfg = load_config(base, overrides)
    if cfg.train.matmul_precision != "default":  # as jaxpar/train.py sets it before building the step
        jax.config.update("jax_default_matmul_precision", cfg.train.matmul_precision)
    n = 1
    for v in sizes.values():
        n *= v
    layout = Layout(cfg, make_mesh(sizes, jax.devices()[:n]))
    state = abstract_state(layout)
    batch = jax.ShapeDtypeStruct(layout.batch_shape, "int32", sharding=layout.batch_sharding)
    lowered = step_mod.make_train_step(layout).lower(state, batch)
    if "debug_info" in inspect.signature(lowered.as_text).parameters:
        text = lowered.as_text(debug_info=False)
    else:
        text = lowered.as_text()
    text = strip_locations(text)
    with open(os.path.join(out, f"{name}.mlir"), "w") as f:
        f.write(text)


def run_all(repo: str, out: str, only: list[str] | None) -> int:
    repo, out = os.path.abspath(repo), os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": repo,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    env.pop("JAXPAR_CPU_DEVICES", None)
    failed, times, t_all = [], {}, time.time()
    for name in only or CONFIGS:
        t0 = time.time()
        r = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--child", name, "--repo", repo, "--out", out],
            cwd=repo,
            env=env,
            capture_output=True,
            text=True,
        )
        times[name] = round(time.time() - t0, 1)
        if r.returncode:
            failed.append(name)
            print(f"FAILED {name} ({times[name]}s):\n{r.stderr[-4000:]}", flush=True)
        else:
            print(f"ok     {name} ({times[name]}s)", flush=True)
    total = round(time.time() - t_all, 1)
    with open(os.path.join(out, "_run.json"), "w") as f:
        json.dump({"repo": repo, "seconds": times, "total_seconds": total, "failed": failed}, f, indent=1)
    print(f"{len(times) - len(failed)}/{len(times)} lowered in {total}s -> {out}")
    return 1 if failed else 0


def compare(a: str, b: str, diff_lines: int = 60) -> int:
    bad = 0
    for name in CONFIGS:
        pa, pb = os.path.join(a, f"{name}.mlir"), os.path.join(b, f"{name}.mlir")
        missing = [p for p in (pa, pb) if not os.path.exists(p)]
        if missing:
            print(f"MISSING   {name}: {', '.join(missing)}")
            bad += 1
            continue
        ta, tb = open(pa).read(), open(pb).read()
        if ta == tb:
            print(f"identical {name} ({len(ta.splitlines())} lines)")
            continue
        bad += 1
        diff = list(difflib.unified_diff(ta.splitlines(), tb.splitlines(), pa, pb, lineterm="", n=2))
        print(f"DIFFERENT {name} ({len(diff)} diff lines; first {diff_lines}):")
        print("\n".join(diff[:diff_lines]))
    print(f"{len(CONFIGS) - bad}/{len(CONFIGS)} identical")
    return 1 if bad else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo")
    p.add_argument("--out")
    p.add_argument("--only", nargs="*", help="a subset of configuration names")
    p.add_argument("--compare", nargs=2, metavar=("DIR_A", "DIR_B"))
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--list", action="store_true", help="print the configurations")
    args = p.parse_args()
    if args.list:
        for name, (base, sizes, ov) in CONFIGS.items():
            print(name, base, ",".join(f"{k}={v}" for k, v in sizes.items()), " ".join(ov))
        return 0
    if args.compare:
        return compare(*args.compare)
    if args.child:
        child(os.path.abspath(args.repo), args.child, os.path.abspath(args.out))
        return 0
    if not (args.repo and args.out):
        p.error("--repo and --out (or --compare DIR_A DIR_B)")
    return run_all(args.repo, args.out, args.only)


if __name__ == "__main__":
    sys.exit(main())
