"""torchpar's expert parallelism (parallel.mesh=ep=N on --backend ddp, torchpar/backends/experts.py).

The experts split over the ranks give the one-process run's numbers, dropped choices included; its checkpoints move to
other layouts and back; what it does not run beside is refused in one line.
"""

import re

import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxpar.core.config.schema import load_config
from jaxpar.core.errors import UserError
from jaxpar.core.config.mesh_spec import check_torch_mesh
from tests.helpers import metrics
from tests.torchpar.runs import assert_same_run, run
from torchpar.checks import check_expert_parallel

# Mixtral's shape plus a shared expert and the balance loss (as tests/jaxpar/test_moe.py), at its learning rate
MOE = [
    "model.family=llama",
    "model.n_kv_head=2",
    "model.moe_experts=8",
    "model.moe_top_k=2",
    "model.moe_shared_experts=1",
    "model.moe_d_ff=16",
    "model.moe_aux_loss=0.01",
    "optim.lr=3e-3",
    "optim.min_lr=3e-4",
    "train.microbatches=2",
]
# 2 choices per expert and row of 16: many dropped; behind a dense first layer (model.moe_first_dense), which the
# experts' split skips; the balance bias (model.moe_bias_update) moved alike on every rank by every rank's loads
CAPACITY = ["model.moe_capacity_factor=0.5", "model.moe_first_dense=1", "model.d_ff=24", "model.moe_bias_update=0.001"]


def _args(base, *extra):
    return [a for a in base["args"] if not a.startswith("model.init_from=")] + MOE + list(extra)


@pytest.fixture(scope="module")
def one_process(base):
    """The one-process runs every layout is held to: dropless (its final weights written) and with a capacity."""
    out = {}
    for name, extra in (("dropless", []), ("capacity", CAPACITY)):
        run_dir = base["tmp"] / f"moe-{name}"
        run(
            [
                "--backend",
                "none",
                *_args(base, *extra),
                f"run.dir={run_dir}",
                "--write-final",
                str(base["tmp"] / f"moe-{name}.safetensors"),
            ]
        )
        out[name] = metrics(run_dir)
    return out


def _assert_same_experts(got: dict, ref: dict) -> None:
    for key in ("moe_max_load", "moe_dropped", "moe_balance"):
        np.testing.assert_allclose(
            [got[s][key] for s in range(1, 11)], [ref[s][key] for s in range(1, 11)], rtol=1e-5, atol=1e-7
        )


def test_experts_split_over_ranks_equal_one_process(base, one_process):
    run_dir, final = base["tmp"] / "ep2-dp2", base["tmp"] / "ep2-dp2.safetensors"
    out = run(
        [
            "--backend",
            "ddp",
            *_args(base, "parallel.mesh=ep=2,dp=2"),
            f"run.dir={run_dir}",
            "--write-final",
            str(final),
        ],
        nproc=4,
    )
    assert "tokens travel over ep=2 by all_to_all_single" in out.stderr, out.stderr[-2000:]
    total, per_rank = (
        int(n.replace(",", "")) for n in re.search(r"([\d,]+) params .*?([\d,]+) per rank", out.stdout).groups()
    )
    assert per_rank == total - 2 * 8 * 3 * 32 * 16 // 2  # half of each layer's 8 experts (3 matrices of 32 x 16)
    got, ref = metrics(run_dir), one_process["dropless"]
    assert_same_run(got, ref)
    _assert_same_experts(got, ref)
    want, have = load_file(str(base["tmp"] / "moe-dropless.safetensors")), load_file(str(final))
    assert sorted(have) == sorted(want)  # the experts gathered whole from both ep ranks
    for name in want:
        np.testing.assert_allclose(have[name], want[name], atol=5e-6, err_msg=name)


def test_dropped_choices_are_the_one_process_runs(base, one_process):
    run_dir = base["tmp"] / "ep4-capacity"
    run(["--backend", "ddp", *_args(base, *CAPACITY, "parallel.mesh=ep=4"), f"run.dir={run_dir}"], nproc=4)
    got, ref = metrics(run_dir), one_process["capacity"]
    assert min(ref[s]["moe_dropped"] for s in range(1, 11)) > 0.05
    assert_same_run(got, ref)
    _assert_same_experts(got, ref)


def test_an_expert_parallel_checkpoint_moves_to_other_layouts(base, one_process):
    """ep=2 stops after step 3, one process resumes to step 6, ep=4 finishes: the one-process run.

    Each rank saves only its experts (as DTensor shards): were they saved as replicas, the next layout would read
    rank 0's alone.
    """
    run_dir = base["tmp"] / "ep-chain"
    for i, (mesh, nproc, stop) in enumerate([("ep=2", 2, 3), (None, 0, 6), ("ep=4", 4, None)]):
        args = [
            "--backend",
            "ddp" if mesh else "none",
            *_args(base, *([f"parallel.mesh={mesh}"] if mesh else [])),
            f"run.dir={run_dir}",
        ]
        out = run(args, nproc=nproc, **({"TORCHPAR_FAULT_SIGTERM_AFTER_STEP": str(stop)} if stop else {}))
        assert i == 0 or "resumed from" in out.stderr, out.stderr[-2000:]
    assert_same_run(metrics(run_dir), one_process["dropless"])


# DeepSeek-V3's routing (model.moe_n_group, moe_topk_group, moe_routed_scale; tests/jaxpar/test_moe_routing.py holds it
# to HF's router): the 8 experts in 4 groups of 2, the best 2 groups kept, weights scaled by 2.5, sigmoid scores and the
# balance bias, which a group's score counts
GROUPED = [
    "model.moe_n_group=4",
    "model.moe_topk_group=2",
    "model.moe_routed_scale=2.5",
    "model.moe_router=sigmoid",
    "model.moe_bias_update=0.001",
]


def test_grouped_routing_split_over_ranks_equals_one_process(base):
    runs, finals = {}, {}
    for name, backend, mesh, nproc in (("one", "none", [], 0), ("ep", "ddp", ["parallel.mesh=dp=2,ep=2"], 4)):
        run_dir, finals[name] = base["tmp"] / f"grouped-{name}", base["tmp"] / f"grouped-{name}.safetensors"
        run(
            [
                "--backend",
                backend,
                *_args(base, *GROUPED, *mesh),
                f"run.dir={run_dir}",
                "--write-final",
                str(finals[name]),
            ],
            nproc=nproc,
        )
        runs[name] = metrics(run_dir)
    assert_same_run(runs["ep"], runs["one"])
    _assert_same_experts(runs["ep"], runs["one"])
    want, have = load_file(str(finals["one"])), load_file(str(finals["ep"]))
    assert np.abs(want["blocks.moe.router.bias"]).max() > 0
    for name in want:
        np.testing.assert_allclose(have[name], want[name], atol=5e-6, err_msg=name)


@pytest.mark.parametrize(
    "setting,backend,world,named",
    [
        ("parallel.mesh=ep=2,dp=2", "fsdp", 4, "--backend fsdp does not implement ep"),
        ("parallel.mesh=ep=3", "ddp", 3, "model.moe_experts=8 is not divisible by ep=3"),
        ("model.moe_experts=0", "ddp", 4, "ep=4 shards a mixture of experts, and this model has none"),
        ("model.compute_dtype=float16", "ddp", 4, "model.compute_dtype=float16 with expert parallelism (ep=4)"),
        ("train.sample_every=5", "ddp", 4, "train.sample_every with expert parallelism"),
        ("parallel.grad_compression=bf16", "ddp", 4, "parallel.grad_compression with expert parallelism"),
    ],
)
def test_what_expert_parallelism_does_not_run_beside_is_refused(setting, backend, world, named):
    cfg = load_config(None, MOE + ["parallel.mesh=ep=4", setting])
    with pytest.raises(UserError, match=re.escape(named)):
        check_torch_mesh(cfg.parallel.mesh, backend, world)
        check_expert_parallel(cfg, backend, world)
