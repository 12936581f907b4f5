"""torchpar's DiLoCo (parallel.mesh=diloco=G on --backend ddp or fsdp): groups of ranks held to the reference.

The reference is tests/jaxpar/test_diloco.py's, from the same initial-weights file: one-device runs of jaxpar's plain
step on each group's rows, their deltas averaged every H steps and applied with optax's Nesterov SGD. torchpar's
groups of one rank (DDP), of two (DDP, and FSDP2 with streaming's fragments) equal it, so jaxpar and torchpar agree.
A killed run resumes exactly across a meeting; what a DiLoCo checkpoint cannot become is refused in one line.
"""

import subprocess
import sys

import numpy as np
import pytest
import torch

from jaxpar.core.config.schema import load_config
from jaxpar.core.errors import UserError
from jaxpar.core.weights.names import read_weights
from tests.helpers import assert_params_close, metrics, run_in_session, tiny_config, torch_env
from tests.jaxpar.test_diloco import DELAYED, SETTINGS, STREAMING, reference
from tests.torchpar.runs import assert_resumes_exactly_after_sigkill, run
from torchpar.checks import check_groups
from torchpar.weights import to_shared


MOE = ("model.moe_experts=4", "model.moe_bias_update=0.01")  # as tests/jaxpar/test_diloco.py's


def _dataset(base) -> str:
    return next(a.split("=", 1)[1] for a in base["args"] if a.startswith("data.dataset="))


@pytest.mark.parametrize(
    "backend, mesh, nproc, extra",
    [
        ("ddp", "diloco=2", 2, ()),
        ("ddp", "diloco=2,dp=2", 4, ()),
        ("fsdp", "diloco=2,fsdp=2", 4, STREAMING),
        ("fsdp", "diloco=2,fsdp=2", 4, DELAYED),
    ],
    ids=["ddp diloco=2", "ddp diloco=2,dp=2", "streaming fsdp diloco=2,fsdp=2", "delayed fsdp diloco=2,fsdp=2"],
)
def test_diloco_equals_the_reference_from_one_weights_file(base, backend, mesh, nproc, extra):
    assert_equals_the_reference(base, backend, mesh, nproc, [*base["args"], *SETTINGS, *extra])


def test_the_experts_balance_bias_becomes_the_groups_mean(base):
    """Experts in groups of two ranks: each group's bias moved by its own loads, their mean at a meeting.

    The bias equals the reference's, and differs from it by far more where the outer optimizer moves it instead. The
    experts' weights are held to 1e-4 at most: few rows reach an expert, and Adam divides its gradient by their small
    second moment, so the two frameworks' rounding shows more there than in dense weights.
    """
    init = str(base["tmp"] / "diloco-moe-init.safetensors")
    args = [a for a in base["args"] if not a.startswith("model.init_from=")] + list(MOE)
    run(["--backend", "none", "--write-init", init, *args])
    args = [*args, *SETTINGS, f"model.init_from={init}"]
    got = assert_equals_the_reference(base, "ddp", "diloco=2,dp=2", 4, args, most=1e-4)
    bias, other = "blocks.moe.router.bias", reference(load_config(None, args), _dataset(base), bias_mean=False)
    assert np.max(np.abs(got[bias] - other["params"][bias])) > 100 * 1e-6


def assert_equals_the_reference(
    base, backend: str, mesh: str, nproc: int, args: list[str], most=5e-5, torch_args=(), rtol=1e-5
) -> dict:
    """torchpar's run of `args` (and `torch_args`) on `mesh` logs the reference's losses, writes its final parameters.

    The final parameters are returned; the balance bias, where there is one, within 1e-6.
    """
    want = reference(load_config(None, args), _dataset(base))
    name = f"diloco-{backend}-{mesh}-{len(args)}-{len(torch_args)}"
    run_dir, final = base["tmp"] / name, base["tmp"] / f"{name}.safetensors"
    out = run(
        ["--backend", backend, *args, *torch_args, f"parallel.mesh={mesh}", f"run.dir={run_dir}"]
        + ["--write-final", str(final)],
        nproc=nproc,
    )
    assert "DiLoCo: 2 groups" in out.stdout + out.stderr
    got = metrics(run_dir)
    np.testing.assert_allclose([got[s + 1]["loss"] for s in range(len(want["loss"]))], want["loss"], rtol=rtol)
    if rtol > 1e-5:  # a lossy setting: the losses alone
        return {}
    weights = read_weights(str(final))
    assert_params_close(weights, want["params"], most=most)
    bias = "blocks.moe.router.bias"
    if bias in want["params"]:
        np.testing.assert_allclose(weights[bias], want["params"][bias], atol=1e-6)
    return weights


def test_fsdp_groups_evaluated_between_meetings_train_on_their_own_parameters(base):
    """Evaluation reads the synchronised parameters; with parallel.zero_stage=2 FSDP2 keeps what a forward gathered.

    Evaluated after every step (between meetings too), the next step still trains each group's own parameters: the run
    equals the reference.
    """
    torch_args = ["parallel.zero_stage=2", "train.eval_every=1"]
    assert_equals_the_reference(base, "fsdp", "diloco=2,fsdp=2", 4, [*base["args"], *SETTINGS], torch_args=torch_args)


def test_bf16_compression_reduces_inside_each_group(base):
    """parallel.grad_compression=bf16 on ddp's groups: DDP's hook averages over the group's ranks, not every rank.

    bf16 keeps 8 significant bits, so the losses stay within 1e-3 of the float32 reference (8e-5 measured); a hook
    over every rank averages the groups' gradients, and the losses miss it by 2e-2 (measured).
    """
    torch_args = ["parallel.grad_compression=bf16"]
    args = [*base["args"], *SETTINGS]
    assert_equals_the_reference(base, "ddp", "diloco=2,dp=2", 4, args, torch_args=torch_args, rtol=1e-3)


def test_a_killed_diloco_run_resumes_exactly_across_a_meeting(base):
    """Saved at step 4 (after the meeting of step 3), killed after step 6 (after the next): resumed, bit for bit."""
    assert_resumes_exactly_after_sigkill(
        base, "fsdp", ["parallel.mesh=diloco=2", "parallel.diloco_inner_steps=3"], "diloco"
    )


def test_a_killed_streaming_run_resumes_exactly_with_an_exchange_in_flight(base):
    """Saved at step 4 with fragment 0's exchange of that step in flight (it lands after step 5), killed after 6.

    Resumed, bit for bit: the checkpoint holds the exchange's mean delta (each rank's shard: FSDP2 over the 2 ranks of
    each group) and its step.
    """
    delayed = ["parallel.diloco_inner_steps=2", "parallel.diloco_fragments=2", "parallel.diloco_delay=1"]
    overrides = ["parallel.mesh=diloco=2,fsdp=2", *delayed]
    assert_resumes_exactly_after_sigkill(base, "fsdp", overrides, "diloco-delayed", nproc=4)


def test_what_torchpar_groups_do_not_run_with_is_refused_in_one_line():
    for settings, named in (
        (("parallel.mesh=diloco=2,ep=2", "model.moe_experts=4"), "ep=2 in parallel.mesh is not built in torchpar"),
        (("parallel.mesh=diloco=2,dp=2", "parallel.grad_compression=powersgd"), "powersgd"),
        (("parallel.mesh=diloco=2,dp=2", "parallel.diloco_fragments=4", "parallel.diloco_inner_steps=4"), "layers"),
    ):
        with pytest.raises(UserError, match=named) as e:
            check_groups(tiny_config(*settings), 4)
        assert "\n" not in str(e.value)
    assert check_groups(tiny_config("parallel.mesh=diloco=2,dp=2"), 4) == 2


@pytest.fixture(scope="module")
def diloco_run(base):
    """A ddp diloco=2 run (meetings after steps 2, 4 and 6) killed after step 5, a checkpoint after every step.

    Its newest checkpoint (step 5) is between two meetings: each group's parameters are its own there.
    """
    run_dir = base["tmp"] / "diloco-saved"
    args = ["--backend", "ddp", *base["args"], *SETTINGS, "parallel.mesh=diloco=2", "checkpoint.every=1"]
    run([*args, f"run.dir={run_dir}"], nproc=2, expect_rc="nonzero", TORCHPAR_FAULT_KILL_AFTER_STEP="5")
    return run_dir


def saved(run_dir, step: int) -> dict:
    """A DCP checkpoint's whole state dict: {"model", "groups": {g: {"model", "optim"}}, "outer"}."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = run_dir / f"saved-{step}.pt"
    dcp_to_torch_save(run_dir / "checkpoints" / str(step), out)
    return torch.load(out, weights_only=False)


def test_a_diloco_checkpoint_resumes_on_its_number_of_groups_or_says_so(base, diloco_run):
    out = run(
        ["--backend", "ddp", *base["args"], "train.steps=8", "parallel.mesh=dp=2", f"run.dir={diloco_run}"],
        nproc=2,
        expect_rc="nonzero",
    )
    assert "holds DiLoCo's state for 2 groups and parallel.mesh has no DiLoCo groups" in out.stderr, out.stderr[-2000:]


def test_a_diloco_run_samples_and_converts_its_synchronised_parameters_and_its_state_file_is_refused(
    base, diloco_run, tmp_path
):
    """Between meetings the checkpoint's model is the synchronised parameters: what sampling and conversion read.

    Step 5's model equals every group's parameters right after the meeting of step 4, and differs from group 0's own
    at step 5; the weights conversion writes exactly it, and torchpar.generate runs on it. The training-state file is
    refused in one line.
    """
    at4, at5 = saved(diloco_run, 4), saved(diloco_run, 5)
    for name, synced in at5["model"].items():
        assert all(torch.equal(synced, at4["groups"][g]["model"][name]) for g in ("0", "1")), name
    assert any(not torch.equal(t, at5["groups"]["0"]["model"][n]) for n, t in at5["model"].items())
    sample = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchpar.generate",
            "--run",
            str(diloco_run),
            "--prompt",
            "ab",
            "--max-new-tokens",
            "4",
        ],
        capture_output=True,
        text=True,
        env=torch_env(),
        timeout=120,
    )
    assert sample.returncode == 0, sample.stderr[-2000:]
    weights = tmp_path / "weights.safetensors"
    command = [sys.executable, "-m", "jaxpar.tools.convert", "--from", "torchpar", str(diloco_run), "--to", "shared"]
    out = run_in_session([*command, str(weights)], torch_env(), 120, "convert --to shared")
    assert out.returncode == 0, out.stderr[-2000:]
    want = to_shared(at5["model"], load_config(None, base["args"]).model.n_layer)
    got = read_weights(str(weights))
    assert sorted(got) == sorted(want) and all(np.array_equal(got[k], v) for k, v in want.items())
    state = tmp_path / "state.safetensors"
    command = [sys.executable, "-m", "torchpar.tools.convert", "--from", "torchpar", str(diloco_run), "--to", "state"]
    out = run_in_session([*command, str(state)], torch_env(), 120, "convert")
    assert out.returncode != 0 and not state.exists()
    assert "is a DiLoCo run" in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
