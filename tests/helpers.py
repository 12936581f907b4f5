"""Test support shared by tests/ and parity_tests/.

Tiny configs and data, in-process training runs, trainer subprocesses (each in its own session, checked for aborts and
leftovers), metrics.jsonl.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxpar.core.config.schema import Config, load_config
from jaxpar.core.data.tokens import write_tokens

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ABORTS = ("Abort", "SIGABRT", "core dumped", "Fatal Python error")
TINY = [
    "model.n_layer=2",
    "model.n_head=4",
    "model.d_model=32",
    "model.max_seq_len=32",
    "data.seq_len=16",
    "train.global_batch_size=8",
    "train.steps=10",
    "optim.warmup_steps=3",
    "optim.lr=1e-2",
    "optim.min_lr=1e-3",
    "data.val_fraction=0.1",
    "train.eval_batches=2",
    "train.log_every=1",
    "train.matmul_precision=highest",
]


def tiny_config(*overrides: str):
    return load_config(None, TINY + list(overrides))


def make_dataset(path, n_tokens: int = 40_000, seed: int = 0, document_length: int = 0) -> str:
    """Random text with structure (a noisy repeating pattern) so losses move.

    `document_length` > 0: packed documents of 1 to 2x that many tokens, each after an end-of-document token (0, the
    byte tokenizer's).
    """
    rng = np.random.default_rng(seed)
    base = np.tile(np.frombuffer(b"def f(x):\n    return x + 1\n", np.uint8), n_tokens // 27 + 1)[:n_tokens]
    noise = rng.integers(0, 256, n_tokens)
    tokens = np.where(rng.random(n_tokens) < 0.1, noise, base)
    if document_length:
        starts = np.cumsum(rng.integers(1, 2 * document_length + 1, n_tokens))
        tokens[starts[starts < n_tokens]] = 0
    return write_tokens(str(path), tokens, 256, eod=0 if document_length else None)


def make_sft_dataset(path, seq_len: int = 16, records: int = 300, seed: int = 0) -> str:
    """Write a prepared, packed fine-tuning dataset of random prompt/completion records.

    Prompt/completion records of random lengths (1-12 and 1-16 bytes of make_dataset's pattern), prepared with a loss
    mask and packed for data.seq_len=`seq_len` (the longest split): a batch's rows and microbatches hold unequal numbers
    of counted targets.
    """
    from jaxpar.core.data.packing import SftFields
    from jaxpar.core.data.tokens import prepare

    rng = np.random.default_rng(seed)
    text = "def f(x):\n    return x + 1\n" * 4
    pick = lambda n: text[(s := int(rng.integers(0, 27))) : s + int(rng.integers(1, n + 1))]
    lines = [json.dumps({"prompt": pick(12), "completion": pick(16)}) for _ in range(records)]
    corpus = f"{path}.jsonl"
    with open(corpus, "w") as f:
        f.write("\n".join(lines) + "\n")
    return prepare([corpus], str(path), sft=SftFields(), pack=seq_len, too_long="split")


def run_steps(cfg: Config, mesh: str, dataset: str, steps: int | None = None, devices=None, then=None) -> dict:
    """K training steps of a config on a mesh, in-process, with the trainer's own layout, state, step and data code.

    Per-step loss / grad_norm / lr (lists of floats) and the final parameters (flat numpy). `then=(k, cfg2)`: after
    k steps the same state goes on under cfg2 (its step, batches and train.steps) -- what a resume with changed
    settings must compute, with no checkpoint in between (parity_tests/fuzz_transitions.py).
    """
    import dataclasses

    import jax

    from jaxpar.core.data.batch_shapes import batch_shapes
    from jaxpar.core.data.order import open_splits
    from jaxpar.core.model.experts import expert_records
    from jaxpar.core.weights.names import flatten
    from jaxpar.data import device_batch, grain_batches
    from jaxpar.core.config.mesh_spec import parse_mesh
    from jaxpar.parallel import diloco
    from jaxpar.step import build_step, make_train_step

    first = cfg.train.steps if steps is None else steps
    legs = [(cfg, 0, first)] if then is None else [(cfg, 0, then[0]), (then[1], then[0], then[1].train.steps)]
    state, history = None, []
    for leg, start, stop in legs:
        layout, fresh, train_step = build_step(leg, parse_mesh(mesh), devices)
        state = fresh if state is None else state
        if len(batch_shapes(leg)) > 1:  # a ramp-up's or the buckets' shapes: the jitted step compiles each
            train_step = make_train_step(layout)
        # the training batches as the trainer makes them (windows, a ramp-up, buckets), from `dataset`
        data = open_splits(
            dataclasses.replace(leg, data=dataclasses.replace(leg.data, dataset=str(dataset))), grain_batches
        )[0]
        meet, carrying = (diloco.Meetings(layout) if layout.group is not None else None), {}
        for step in range(start, stop):
            carry = meet.carry(state, step) if meet is not None else None  # DiLoCo's exchange in flight, if any
            if carry is not None and carry not in carrying:
                carrying[carry] = make_train_step(layout, carry=carry)
            step_fn = train_step if carry is None else carrying[carry]
            state, metrics = step_fn(state, device_batch(data, step, layout.batch_sharding))
            if meet is not None:  # DiLoCo's groups: their mean metrics; the fragments that meet now
                metrics, state = diloco.mean_over_groups(metrics), meet(state, step)
            history.append(metrics)
    cfg = legs[-1][0]
    history = [
        {**m, **(expert_records(m["expert_stats"], cfg.model.moe_experts) if "expert_stats" in m else {})}
        for m in jax.device_get(history)
    ]
    scalars = [k for k in history[0] if np.ndim(history[0][k]) == 0]  # loss, grad_norm, lr, the experts' records
    out = {k: [float(m[k]) for m in history] for k in scalars}
    if "moe_load" in history[0]:  # each expert's share of the choices, per step
        out["moe_load_per_step"] = [m["moe_load"] for m in history]
    out["params"] = {k: np.asarray(v) for k, v in flatten(jax.device_get(state["params"])).items()}
    return out


def assert_params_close(got: dict, ref: dict, rel: float = 1e-5, most: float = 5e-5) -> None:
    """All parameters within `rel` (1e-5) relative norm, and no single tensor off by more than `most` (5e-5).

    Per-tensor relative norms are not used: the attention key bias has an exactly-zero true
    gradient (softmax ignores it), so Adam moves it by amplified rounding noise only.
    """
    diff = np.sqrt(sum(np.sum((got[k] - v) ** 2) for k, v in ref.items()))
    total = np.sqrt(sum(np.sum(v**2) for v in ref.values()))
    assert diff / total < rel, f"parameters differ by {diff / total:.2e} relative norm"
    for name, v in ref.items():
        assert np.max(np.abs(got[name] - v)) < most, (name, np.max(np.abs(got[name] - v)))


def metrics(run_dir) -> dict[int, dict]:
    """step -> record of <run_dir>/metrics.jsonl; a step logged twice (a resumed run repeats steps) keeps its last."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f)}


def tensorboard_scalars(run_dir) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} as TensorBoard's own event reader sees <run_dir>/tensorboard (run.tensorboard=true)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(run_dir, "tensorboard"))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def run_cli(run_dir, dataset, *args, env=None, timeout=300, module="jaxpar.train"):
    """`python -m jaxpar.train` (or `module`) on the tiny config, as a user would run it."""
    cmd = [sys.executable, "-m", module, *TINY, f"data.dataset={dataset}", f"run.dir={run_dir}", *args]
    full_env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
    if module.startswith("torchpar"):  # one thread, as torch_env: bit-equal runs may not depend on the load
        full_env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


def assert_resumes_exactly(tmp_path, dataset, args, kill_after: int) -> None:
    """Assert a jaxpar run killed by SIGKILL and resumed repeats the whole run bit for bit.

    `python -m jaxpar.train *args` whole (tmp_path/full), and killed by SIGKILL after step `kill_after` then resumed
    (tmp_path/k): every step equal in loss and gradient norm, bit for bit (the resumed run's records of the steps it ran
    again replace the killed run's).
    """
    full = run_cli(tmp_path / "full", dataset, *args)
    assert full.returncode == 0, full.stderr
    killed = run_cli(tmp_path / "k", dataset, *args, env={"JAXPAR_FAULT_KILL_AFTER_STEP": str(kill_after)})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = run_cli(tmp_path / "k", dataset, *args)
    assert resumed.returncode == 0 and "resumed from" in resumed.stderr, resumed.stderr
    m, r = metrics(tmp_path / "full"), metrics(tmp_path / "k")
    assert sorted(m) == sorted(r) and max(m) > kill_after
    assert all(r[s]["loss"] == m[s]["loss"] and r[s]["grad_norm"] == m[s]["grad_norm"] for s in m)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deepspeed_cpu_has_float16() -> bool:
    """Whether DeepSpeed's CPU accelerator runs float16 on this machine.

    What DeepSpeed's CPU accelerator asks before it runs float16 (oneDNN's float16 kernels, which depend on the CPU's
    instruction set): where it says no, torchpar refuses float16 on --backend deepspeed in one line.
    """
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:  # noqa: BLE001 - a torch without the query: no float16 kernels either
        return False


def torch_env(**extra) -> dict:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "DS_ACCELERATOR": "cpu",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    for key in (
        "TORCHPAR_FAULT_KILL_AFTER_STEP",
        "TORCHPAR_FAULT_SIGTERM_AFTER_STEP",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
    ):
        env.pop(key, None)
    return {**env, **extra}


def torch_command(args: list[str], nproc: int) -> list[str]:
    """`python -m torchpar.train ARGS` (nproc=0), or torchrun with nproc processes on a free port."""
    if not nproc:
        return [sys.executable, "-m", "torchpar.train", *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}",
        "-m",
        "torchpar.train",
        *args,
    ]


def no_leftovers(pgid: int) -> None:
    for _ in range(50):  # torchrun reaps its workers before exiting; allow a moment for stragglers
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.killpg(pgid, signal.SIGKILL)
    pytest.fail("processes left behind after the run")


def run_in_session(cmd: list[str], env: dict, timeout: int, what: str, cwd: str = ROOT) -> subprocess.CompletedProcess:
    """Run `cmd` in its own session; fail on a timeout (killing the session) or on a process left behind."""
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{what} timed out after {timeout}s\n{out[-3000:]}\n{err[-3000:]}")
    no_leftovers(proc.pid)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def hf_oracle(model, path) -> tuple:
    """A transformers model saved to `path`, with the answers both frameworks must give after `--from hf`.

    Its logits on two rows of 24 tokens and 12 greedy tokens after the first row's 8.
    """
    import torch

    model.save_pretrained(path)
    tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 24))
    with torch.no_grad():
        out = model(torch.as_tensor(tokens))
        greedy = model.generate(torch.as_tensor(tokens[:1, :8]), max_new_tokens=12, do_sample=False).numpy()
    return path, tokens, out.logits.numpy(), greedy


def assert_both_frameworks_give_hf_answers(flat: dict, cfg, tokens, want, greedy, name: str) -> None:
    """Assert both frameworks reproduce Hugging Face's logits and greedy tokens from converted weights.

    jaxpar and torchpar, from the converted weights `flat`, give `want`'s logits within 1e-5 of their scale and the same
    greedy tokens (`hf_oracle`).
    """
    import jax
    import jax.numpy as jnp
    import torch
    from flax import nnx

    from jaxpar.core.weights.names import unflatten
    from jaxpar.decode import make_generate
    from jaxpar.models.decoder import Decoder
    from torchpar.decode import generate
    from torchpar.models.decoder import Decoder as TorchDecoder
    from torchpar.weights import from_shared

    scale = np.max(np.abs(want))
    assert scale > 1.0  # weights scaled up in the oracle: a mixed-up tensor cannot hide under the tolerance
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))), nnx.Param)
    params = unflatten({k: jnp.asarray(v) for k, v in flat.items()})
    with jax.default_matmul_precision("highest"):
        got = np.asarray(jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, jnp.asarray(tokens)))
        generated = make_generate(graphdef)(
            params, jnp.asarray(tokens[:1, :8]), jax.random.key(0), new_tokens=12, temperature=0.0
        )
    print(f"jaxpar logits off HF {name}'s by {np.max(np.abs(got - want)) / scale:.1e} of their scale {scale:.1f}")
    np.testing.assert_allclose(got, want, atol=1e-5 * scale)
    assert np.asarray(generated).tolist() == greedy[:, 8:].tolist()
    torch_model = TorchDecoder(cfg)
    torch_model.load_state_dict(from_shared(flat, cfg.n_layer))
    with torch.no_grad():
        np.testing.assert_allclose(torch_model(torch.as_tensor(tokens)).numpy(), want, atol=1e-5 * scale)
    assert generate(torch_model.eval(), torch.as_tensor(tokens[:1, :8]), 12).tolist() == greedy[:, 8:].tolist()


def assert_hf_round_trip_through_a_jaxpar_run(oracle: tuple, tmp_path, model_class) -> None:
    """`hf_oracle`'s model --from hf into a jaxpar run and --to hf back.

    Every tensor bit for bit, and the export's config.json loads into `model_class` giving the same logits.
    """
    import torch
    from safetensors.numpy import load_file

    from jaxpar.tools import convert

    path, tokens, logits = oracle[:3]
    assert convert.main(["--from", "hf", str(path), "--to", "jaxpar", str(tmp_path / "run")]) == 0
    assert convert.main(["--from", "jaxpar", str(tmp_path / "run"), "--to", "hf", str(tmp_path / "back")]) == 0
    original, returned = (load_file(str(p / "model.safetensors")) for p in (path, tmp_path / "back"))
    assert set(returned) == set(original)
    for name, value in original.items():
        assert np.array_equal(returned[name], value), name
    hf = model_class.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        np.testing.assert_array_equal(hf(torch.as_tensor(tokens)).logits.numpy(), logits)


def assert_preset_trains_and_converts_to_hf(preset: str, model_class, tmp_path) -> dict:
    """`python -m jaxpar.train --config configs/<preset>.yaml train.steps=2`, then `convert --to hf`.

    transformers' `model_class` on the export gives the run's logits (within 1e-5 of their scale); returns the run's
    flat weights.
    """
    import jax
    import jax.numpy as jnp
    import torch
    from flax import nnx

    from jaxpar.core.config.schema import load_config
    from jaxpar.core.weights.names import unflatten
    from jaxpar.models.decoder import Decoder
    from jaxpar.tools import convert

    run = tmp_path / "run"
    command = [sys.executable, "-m", "jaxpar.train", "--config", f"configs/{preset}.yaml", "train.steps=2"]
    r = subprocess.run(
        [*command, "train.eval_every=0", f"run.dir={run}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    flat, _ = convert.read("jaxpar", str(run))
    assert convert.main(["--from", "jaxpar", str(run), "--to", "hf", str(tmp_path / "hf")]) == 0
    cfg = load_config(f"{ROOT}/configs/{preset}.yaml").model
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))), nnx.Param)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 32))
    with jax.default_matmul_precision("highest"):
        ours = np.asarray(
            nnx.merge(graphdef, unflatten({k: jnp.asarray(v) for k, v in flat.items()}))(jnp.asarray(tokens))
        )
    hf = model_class.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        theirs = hf(torch.as_tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-5 * max(np.max(np.abs(theirs)), 1.0))
    return flat


# three local lm-eval tasks over the tiny runs' text ("def f(x):\n    return x + 1\n", make_dataset): multiple choice,
# generate_until (its max_gen_toks within TINY's max_seq_len of 32) and a text file for perplexity
EVAL_MC = [
    ("def f(x):\n    return x +", [" 1", " 2", " x"], 0),
    ("def f(", ["x):", "y):", "1):"], 0),
    ("def f(x):\n   ", [" return", " yield", " print"], 0),
    ("    return x + 1\n", ["def", "class", "import"], 0),
    ("x + 1\ndef f(x):", ["\n", " ", "x"], 0),
    ("def", [" f", " g", " h"], 0),
]
EVAL_GEN = [
    "def f(x):\n    ",
    "def f(x):\n    return",
    "    return x + 1\nde",
    "x):\n",
    "def f(x):\n    return x + 1\n",
]
EVAL_TEXT = "def f(x):\n    return x + 1\n" * 3 + "\n\nreturn x + 1\n\n" + "def f(x):\n    return x + 2\n" * 2


def write_eval_tasks(folder) -> dict[str, str]:
    """tiny_mc and tiny_gen (YAML + JSON lines) in `folder`, and text.txt: {"include": folder, "text": its path}."""
    folder = str(folder)
    os.makedirs(folder, exist_ok=True)
    rows = {
        "mc": [{"question": q, "choices": c, "answer": a} for q, c, a in EVAL_MC],
        "gen": [{"prompt": p, "target": "return x + 1"} for p in EVAL_GEN],
    }
    for name, docs in rows.items():
        with open(os.path.join(folder, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(d) + "\n" for d in docs)
    common = (
        f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder}/{{name}}.jsonl\ntest_split: test\n"
    )
    with open(os.path.join(folder, "mc.yaml"), "w") as f:
        f.write(
            "task: tiny_mc\n" + common.format(name="mc") + "output_type: multiple_choice\n"
            'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
            'target_delimiter: ""\nmetric_list:\n  - metric: acc\n'
        )
    with open(os.path.join(folder, "gen.yaml"), "w") as f:
        f.write(
            "task: tiny_gen\n" + common.format(name="gen") + "output_type: generate_until\n"
            'doc_to_text: "{{prompt}}"\ndoc_to_target: "{{target}}"\n'
            'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 12\nmetric_list:\n  - metric: exact_match\n'
        )
    text = os.path.join(folder, "text.txt")
    with open(text, "w") as f:
        f.write(EVAL_TEXT)
    return {"include": folder, "text": text}
