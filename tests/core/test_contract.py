"""The config contract (jaxpar/core/config/contract.py) against the code, over the whole schema.

For every key: its row exists; where the row says a trainer/backend does not consume it (or its mode is off),
setting it is refused in one line naming it; where the row says it is consumed, setting it to another valid
value changes what the row says it changes -- the initial parameters, the traced step, the batches, the shared
loop's calls, torchpar's engine settings -- measured here on tiny models, or shown by the named test.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os

import jax
import numpy as np
import pytest
import torch

from jaxpar.core.config.schema import Config, load_config
from jaxpar.core.config.contract import BACKENDS, CONTRACT, EFFECTS, Run, check_contract, refusal
from jaxpar.core.errors import UserError
from tests.helpers import ROOT, TINY, make_dataset

KEYS = sorted(f"{s}.{k}" for s, d in Config().to_dict().items() for k in d)
RUNS = [("jaxpar", "")] + [("torchpar", b) for b in BACKENDS]

# another valid value for each key where adding or flipping the default would not be valid on the tiny config
ALTERNATIVE = {
    "train.scan_layers": "off",  # "on" is what auto does on the CPU
    "train.eval_tasks": "hellaswag",
    "train.eval_tasks_fewshot": "1",
    "model.family": "llama",
    "model.n_head": "2",
    "model.d_model": "64",
    "model.n_kv_head": "2",
    "model.d_ff": "64",
    "model.ffn_multiple_of": "32",
    "model.max_seq_len": "64",
    "model.vocab_size": "300",
    "model.rope_head_dim": "8",
    "model.head_dim": "12",
    "model.full_attention_every": "2",  # gpt-oss's alternation (1 would make every layer full: refused)
    "model.rope_attention_factor": "1.5",
    "model.rope_mscale_all_dim": "1.0",  # half of the default 0 would be 0
    "model.moe_swiglu_limit": "0.01",  # a clamp the tiny model's gate and up values reach (half of 7 would not)
    "model.rope_original_max_seq_len": "4096",  # a ramp over the pairs of the tiny heads (1: every pair slow alike)
    "model.segment_lengths": "4,16",
    "model.dilation_rates": "1,4",
    "model.sparsity_ratio": "0.5",
    "model.sparsity_block": "4",
    "model.attention": "mla",
    "model.linear": "sketched",
    "model.compute_dtype": "bfloat16",
    "model.remat": "full",
    "model.sketch": "sign",
    "model.sketch_ratio": "0.25",
    "data.seq_len": "8",
    "data.val_fraction": "0.3",
    "train.global_batch_size": "16",
    "train.microbatches": "2",
    "train.profile_steps": "1:2",
    "train.sample_every": "1",
    "train.eval_every": "2",
    "train.log_every": "2",
    "train.steps": "3",
    "train.matmul_precision": "high",
    "train.compile": "on",
    "optim.min_lr": "0.0",
    "optim.warmup_steps": "1",
    "optim.decay_steps": "5",
    "optim.loss_scale_init": "1e30",
    "optim.loss_scale_growth_interval": "1",
    "optim.loss_scale_backoff_factor": "0.25",
    "optim.loss_scale_min": "1e20",
    "optim.loss_scale_growth_factor": "4",
    "parallel.mesh": "dp=2,fsdp=-1",
    "parallel.zero_stage": "1",
    "parallel.sequence_attention": "ulysses",
    "parallel.pipeline_schedule": "1f1b",
    "parallel.pipeline_microbatches": "2",
    "parallel.pipeline_virtual_stages": "2",
    "parallel.offload": "params+optimizer",
    "checkpoint.every": "2",
    "train.batch_rampup": "4,4,8",
    "data.buckets": "16",
    "train.tokens_per_batch": "256",
    "model.moe_experts": "4",
    "model.moe_aux_loss": "0.01",
    "model.moe_capacity_factor": "1.0",
    "model.moe_bias_update": "0.01",
}
# settings a key's effect needs beyond its mode (a loss scale that overflows, so that backing off shows)
NEEDS = {
    "optim.loss_scale_backoff_factor": ["optim.loss_scale_init=1e30"],
    "optim.loss_scale_min": ["optim.loss_scale_init=1e30"],
    "optim.loss_scale_growth_factor": ["optim.loss_scale_growth_interval=1"],
    "optim.min_lr": ["optim.warmup_steps=0"],
    "model.rope_truncate": ["model.rope_beta_slow=0.1"],  # a ramp end between two pairs, which rounding moves
    "model.rope_scaling": ["model.rope_factor=4"],  # YaRN by a factor of 1 is plain rotary
    # the tiny heads' 4 pairs: the fast end of the ramp inside them, and not rounded to the same pair
    "model.rope_beta_fast": ["model.rope_original_max_seq_len=100000", "model.rope_truncate=false"],
    "optim.decay_steps": ["optim.warmup_steps=0"],
    **{f"train.eval_tasks_{k}": ["train.eval_tasks=hellaswag"] for k in ("every", "limit", "fewshot")},
}


def alternative(key: str) -> str:
    if key in ALTERNATIVE:
        return ALTERNATIVE[key]
    section, name = key.split(".")
    field = next(f for f in dataclasses.fields(getattr(Config(), section)) if f.name == name)
    default, choices = field.default, field.metadata.get("choices")
    if choices:
        return str(next(c for c in choices if c != default))
    if isinstance(default, bool):
        return str(not default)
    return str(default / 2 if isinstance(default, float) else default * 2 or 1)


def settings(key: str, with_key: bool) -> tuple[list[str], dict]:
    """Overrides and mesh under which `key`'s row says it is consumed (and the key itself, if asked)."""
    row, overrides, mesh = CONTRACT[key], [], {}
    for item in row.example:
        if item.startswith("mesh:"):
            mesh.update({a: int(n) for a, n in (p.split("=") for p in item[5:].split(","))})
        else:
            overrides.append(item)
    overrides += NEEDS.get(key, [])
    if with_key:
        overrides.append(f"{key}={alternative(key)}")
    return overrides, mesh


def config(overrides: list[str], dataset: str = "stdlib"):
    return load_config(None, TINY + [f"data.dataset={dataset}"] + overrides)


def test_every_schema_key_has_one_row():
    assert sorted(CONTRACT) == KEYS
    for key, row in CONTRACT.items():
        assert row.effect in EFFECTS, key
        assert set(row.torchpar) <= set(BACKENDS), key
        assert row.jaxpar or row.torchpar, f"{key}: nobody consumes it (remove it from the schema)"
        assert (row.effect == "test") == bool(row.evidence), key


def test_the_named_evidence_tests_exist():
    for key, row in CONTRACT.items():
        if row.evidence:
            path, name = row.evidence.split("::")
            with open(os.path.join(ROOT, path)) as f:
                names = {n.name for n in ast.walk(ast.parse(f.read())) if isinstance(n, ast.FunctionDef)}
            assert name in names, f"{key}: {row.evidence} does not exist"


def refused(overrides: list[str], run: tuple[str, str], mesh: dict) -> str | None:
    """The one-line refusal of these settings by loading or by the contract; None if the run would go ahead."""
    try:
        check_contract(Run(config(overrides), *run, mesh))
    except UserError as e:
        return str(e)
    return None


def test_a_refusal_writes_the_setting_as_a_user_types_it():
    """A bool as the config and the command line spell it (true), not Python's True."""
    why = refused(["model.float8=true"], ("torchpar", "deepspeed"), {})
    assert why and "model.float8=true " in why, why


@pytest.mark.parametrize("key", KEYS)
def test_a_key_is_refused_wherever_its_row_says_it_is_not_consumed(key):
    row = CONTRACT[key]
    overrides, mesh = settings(key, with_key=True)
    for trainer, backend in RUNS:
        run_mesh = {"pp": mesh.get("pp", 2)} if backend == "pipeline" else ({} if trainer == "torchpar" else mesh)
        run = Run(config(overrides), trainer, backend, run_mesh)
        consumed = (row.jaxpar if trainer == "jaxpar" else backend in row.torchpar) and row.when(run)
        why = refused(overrides, (trainer, backend), run_mesh)
        if consumed:
            assert why is None, (trainer, backend, why)
        else:  # refused in one line (it may name the example's key first: its mode is off here too)
            assert why and "\n" not in why, (trainer, backend)
            assert key in refusal(key, getattr(run.cfg, key.split(".")[0]).__dict__[key.split(".")[1]], run)
    if row.example:  # without its mode the key is refused (jaxpar on one device, torchpar on one process)
        for trainer, backend in (("jaxpar", ""), ("torchpar", "none")):
            assert refused([f"{key}={alternative(key)}"], (trainer, backend), {}), (key, trainer)


# ---- effects: what a consumed key changes, measured ----


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    d = tmp_path_factory.mktemp("contract")
    # packed documents (short ones), so that data.document_mask changes what a step computes
    return make_dataset(d / "a.bin", document_length=8), make_dataset(d / "b.bin", seed=1)


def jax_params(cfg) -> dict:
    from jaxpar.core.weights.names import flatten
    from jaxpar.layout import Layout
    from jaxpar.mesh import make_mesh
    from jaxpar.state import init_state

    layout = Layout(cfg, make_mesh({"dp": 1}, jax.devices()[:1]))
    return {k: np.asarray(v) for k, v in flatten(jax.device_get(init_state(layout)["params"])).items()}


def jax_step(cfg, mesh: dict) -> str:
    """The train step lowered for this config and mesh (StableHLO text: ops, constants and shardings)."""
    from jaxpar.core.config.mesh_spec import parse_mesh, resolve_sizes
    from jaxpar.layout import Layout
    from jaxpar.mesh import make_mesh
    from jaxpar.state import abstract_state, init_state
    from jaxpar.step import make_train_step

    spec = cfg.parallel.mesh or ",".join(f"{a}={n}" for a, n in mesh.items()) or "dp=1"  # as jaxpar.train: the key wins
    sizes = resolve_sizes(parse_mesh(spec), int(np.prod([n for n in parse_mesh(spec).values() if n > 0])))
    layout = Layout(cfg, make_mesh(sizes, jax.devices()[: int(np.prod(list(sizes.values())))]))
    batch = jax.ShapeDtypeStruct(layout.batch_shape, "int32", sharding=layout.batch_sharding)
    with jax.default_matmul_precision(cfg.train.matmul_precision):
        text = make_train_step(layout).lower(abstract_state(layout), batch).as_text()
    scaler = init_state(layout).get("loss_scale") if cfg.model.compute_dtype == "float16" else None
    return text, jax.device_get(scaler)


def data_rows(cfg) -> list:
    from jaxpar.core.data.order import open_splits

    train, val = open_splits(cfg)
    return [train.global_batch(s) for s in (0, 1)] + [val.global_batch(0)]


class Recording:
    """One part of a RecordingTrainer (the trainer or one of its collaborators), writing down every call it gets."""

    def __init__(self, calls: list, part: str = ""):
        self.calls, self.part = calls, part

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((self.part + name, *args))
            if name == "train_step":
                return {"loss": 1.0, "grad_norm": 1.0, "lr": 0.1}
            if name == "data_wait_s":
                return 0.0
            if name == "record_extra":
                return {}
            return (
                {"memory_in_use_gib": None, "memory_gib": None}
                if name == "memory"
                else ([1, 2] if name == "sample" else (1.0 if name == "evaluate" else args[0] if args else None))
            )

        return call


class RecordingTrainer(Recording):
    """The shared loop's view of a trainer, writing down every call it and its collaborators get."""

    process_count, rank, train_data, is_main = 1, 0, None, False

    def __init__(self):
        super().__init__([])
        self.processes, self.probes, self.profiling, self.faults = (
            Recording(self.calls, f"{part}.") for part in ("processes", "probes", "profiling", "faults")
        )
        self.faults.prefix = "NOBODY"


def loop_calls(cfg, tmp_path) -> list:
    from jaxpar.core.run.metrics import MetricsLog
    from jaxpar.core.run.loop import train_loop

    os.makedirs(tmp_path, exist_ok=True)
    fw, log = RecordingTrainer(), MetricsLog(str(tmp_path), True, cfg.train.steps)
    train_loop(cfg, fw, 0, log, {})
    log.close()
    with open(tmp_path / "metrics.jsonl") as f:
        logged = [json.loads(line)["step"] for line in f]
    return [c for c in fw.calls if c[0] not in ("probes.memory", "fetch", "probes.data_wait_s")] + logged


def torch_params(cfg) -> dict:
    from torchpar.trainer import build_model

    return {k: v.numpy().copy() for k, v in build_model(cfg).state_dict().items()}


def torch_step(cfg, tmp_path, batches) -> list:
    """Two updates of torchpar's engine (--backend none): losses, norms, loss scales, forward calls, parameters."""
    from torchpar.backends import build
    from torchpar.dist import Env
    from torchpar.dist import PRECISION
    from torchpar.parallelize import checkpoint_blocks
    from torchpar.trainer import build_model

    torch.set_float32_matmul_precision(PRECISION[cfg.train.matmul_precision])
    model = build_model(cfg)
    checkpoint_blocks(model, cfg.model.remat)  # torchpar/parallelize.py's first stage
    calls = []
    for module in model.modules():  # recomputation (model.remat) calls them again in the backward pass
        module.register_forward_hook(lambda *_: calls.append(1))
    engine = build("none", model, cfg, Env(0, 1, 0, torch.device("cpu")))
    out = [engine.update(torch.from_numpy(b).long()) for b in batches]
    return (
        [[float(x) if not isinstance(x, dict) else x for x in o] for o in out]
        + [len(calls)]
        + [p.detach().numpy().copy() for p in model.parameters()]
    )


def torch_engine(cfg, backend: str):
    """What torchpar hands the engine for `backend`, beside the model.

    DeepSpeed's JSON, the pipeline's schedule, torch.compile, the matmul precision.
    """
    from torchpar.parallelize import use_compile
    from jaxpar.core.config.mesh_spec import check_torch_mesh
    from torchpar.dist import PRECISION

    out = {"compile": use_compile(cfg, backend, "cpu"), "precision": PRECISION[cfg.train.matmul_precision]}
    if backend == "deepspeed":
        from torchpar.backends.deepspeed import generated_config

        out["deepspeed"] = generated_config(cfg, 2)
    if backend == "pipeline":
        from torchpar.backends.pipeline import SCHEDULES, pipeline_sizes
        from jaxpar.core.pipeline.schedules import concrete, resolve_microbatches

        S = pipeline_sizes(cfg, 4)[0]
        p = cfg.parallel
        out["pipeline"] = (
            S,
            SCHEDULES[concrete(p.pipeline_schedule)],
            resolve_microbatches(S, p.pipeline_microbatches),
            p.pipeline_virtual_stages,
        )
    if backend == "fsdp":
        from torchpar.backends.fsdp import fsdp_options

        out["fsdp"] = fsdp_options(cfg, 4)
    if backend == "ddp":
        from torchpar.backends.ddp import comm_hook

        out["ddp"] = comm_hook(cfg)
    try:
        check_torch_mesh(cfg.parallel.mesh, backend, 4)
    except UserError as e:
        out["mesh"] = str(e)
    return out


def differ(a, b) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() != b.keys() or any(differ(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) != len(b) or any(differ(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.shape(a) != np.shape(b) or not np.array_equal(a, b)
    return a != b


def probe(effect: str, trainer: str, backend: str, cfg, mesh: dict, tmp_path, key: str):
    if effect == "loop":
        return loop_calls(cfg, tmp_path)
    if effect == "data":
        return data_rows(cfg)
    if trainer == "jaxpar":
        return jax_params(cfg) if effect == "params" else jax_step(cfg, mesh)
    if effect == "params":
        return torch_params(cfg)
    if torch_engine_key(key):
        return torch_engine(cfg, backend)
    return torch_step(cfg, tmp_path, data_rows(cfg)[:2])


def torch_engine_key(key: str) -> bool:
    """Keys torchpar hands its engine (per backend) rather than its model or optimizer."""
    return key.startswith("parallel.") or key in ("train.compile", "train.matmul_precision")


MEASURED = [k for k in KEYS if CONTRACT[k].effect != "test"]
BEFORE: dict = {}  # the unchanged run's measurement, by what decides it


@pytest.mark.parametrize("key", MEASURED)
def test_a_consumed_key_changes_the_run(key, datasets, tmp_path):
    row = CONTRACT[key]
    overrides, mesh = settings(key, with_key=False)
    changed, key_mesh = settings(key, with_key=True)
    if key == "data.dataset":
        changed[-1] = f"data.dataset={datasets[1]}"
    runs = ([("jaxpar", "")] if row.jaxpar else []) + [("torchpar", b) for b in row.torchpar]
    if row.effect in ("params", "data", "loop") or (row.effect == "step" and not torch_engine_key(key)):
        # one torchpar backend stands for all: the model, data and loop are shared
        runs = runs[:1] + [r for r in runs[1:2]]
        if row.effect in ("data", "loop"):
            runs = runs[:1]  # one code path for both trainers (jaxpar/core/data/order.py, jaxpar/core/run/loop.py)
    for trainer, backend in runs:
        base = load_config(None, TINY + [f"data.dataset={datasets[0]}"] + overrides)
        other = load_config(None, TINY + [f"data.dataset={datasets[0]}"] + changed)
        kind = "engine" if torch_engine_key(key) else row.effect  # what `probe` measures for this key
        before_id = (tuple(overrides), tuple(sorted(mesh.items())), kind, trainer, backend)
        if before_id not in BEFORE:  # most keys share their unchanged run: measured once
            BEFORE[before_id] = probe(row.effect, trainer, backend, base, mesh, tmp_path / "a", key)
        before = BEFORE[before_id]
        after = probe(row.effect, trainer, backend, other, key_mesh, tmp_path / "b", key)
        assert differ(before, after), f"{key}={alternative(key)} changed nothing in {trainer} {backend}"


def test_checkpoint_keep_is_the_number_of_steps_kept(tmp_path):
    from jaxpar.checkpoint import Checkpointer

    for keep in (1, 2):
        ckpt = Checkpointer(str(tmp_path / str(keep)), keep)
        for step in (1, 2, 3):
            ckpt.save(step, {"x": jax.numpy.ones(2) * step}, {"step": step})
        ckpt.close()
        assert sorted(os.listdir(tmp_path / str(keep) / "checkpoints")) == [str(s) for s in (1, 2, 3)][-keep:]


ISSUE_CASES = [  # the silent accepts a user met: each is now one line and exit 2, before any training
    ("torchpar", ["--backend", "none", "parallel.zero_stage=3"]),
    ("torchpar", ["--backend", "none", "parallel.pipeline_schedule=zb_h1"]),
    ("torchpar", ["--backend", "pipeline", "parallel.sequence_attention=ulysses"]),
    ("torchpar", ["--backend", "none", "model.q_latent_dim=7"]),
    ("jaxpar", ["model.rope_theta=500"]),
    ("jaxpar", ["--mesh", "dp=2", "parallel.sequence_zigzag=false"]),
]


@pytest.mark.parametrize("trainer,args", ISSUE_CASES, ids=[a[-1] for _, a in ISSUE_CASES])
def test_the_trainers_refuse_what_they_would_not_act_on(trainer, args, dataset, tmp_path):
    from tests.helpers import run_cli, torch_env

    env = torch_env() if trainer == "torchpar" else None
    r = run_cli(tmp_path, dataset, *args, env=env, module=f"{trainer}.train", timeout=120)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert args[-1].split("=")[0] in errors[0] and not os.path.exists(tmp_path / "metrics.jsonl"), errors[0]
