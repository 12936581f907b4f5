"""DiLoCo in jaxpar: groups of devices that train alone for H steps, then apply their mean delta by an outer optimizer.

The reference here is independent of jaxpar/parallel/diloco.py: R one-device runs (jaxpar's plain step on one device),
each on its group's rows of every global batch, their deltas from the synchronised parameters averaged every H steps
and applied with optax's SGD with Nesterov momentum. jaxpar's DiLoCo on diloco=2 alone, with fsdp and with tp inside
the groups, equals it over 3 outer steps. The compiled inner step sends nothing between groups; the outer step's
all-reduce over `diloco` carries the parameters' bytes once.
"""

import dataclasses
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxpar.core.config.mesh_spec import check_torch_mesh, parse_mesh, resolve_sizes
from jaxpar.core.data.order import open_splits
from jaxpar.core.errors import UserError
from jaxpar.core.weights.names import flatten, load_weights, read_weights, unflatten
from jaxpar.state import state_from_params
from jaxpar.cost.hlo_collectives import group_axes, parse
from jaxpar.data import grain_batches
from jaxpar.parallel.diloco import make_outer_step, piece
from jaxpar.step import build_step, compiled_train_step
from jaxpar.tools import convert
from jaxpar.core.run.resume import read_run_config
from tests.helpers import (
    assert_params_close,
    assert_resumes_exactly,
    make_dataset,
    metrics,
    run_cli,
    run_steps,
    tiny_config,
)

H, OUTER_STEPS, GROUPS = 2, 3, 2
SETTINGS = (
    f"parallel.diloco_inner_steps={H}",
    f"train.steps={H * OUTER_STEPS}",
    "optim.outer_lr=0.7",
    "optim.outer_momentum=0.9",
    "optim.warmup_steps=1",
)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("diloco") / "data.bin")


def reference(cfg, dataset, momentum: float = 0.9, groups_counted: int = GROUPS, bias_mean: bool = True) -> dict:
    """R one-device runs on their groups' rows, meeting every H steps: per-step mean losses and the final parameters.

    From model.init_from's weights where it is set. With F fragments (parallel.diloco_fragments): fragment f is the
    f-th of F runs of layers of "blocks" (the other parameters are fragment 0's) and meets after every H-th step
    counted from f x H / F; every fragment after the last step. The experts' balance bias, which no gradient moves,
    becomes the groups' mean at each meeting. With parallel.diloco_delay=D a meeting's mean delta is taken after its
    step and applied D steps later, replacing the fragment's parameters in every group; one that would not land before
    the last step is left to the last step's meeting. `momentum`, `groups_counted` (the deltas averaged: fewer drops a
    group's) and `bias_mean` make the variants the test must tell apart from DiLoCo.
    """
    H, F, L = cfg.parallel.diloco_inner_steps, cfg.parallel.diloco_fragments, cfg.model.n_layer
    rows = cfg.train.global_batch_size // GROUPS
    one = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, global_batch_size=rows))
    layout, state, step = build_step(one, {"dp": 1}, jax.devices()[:1])
    if cfg.model.init_from:  # one weights file for both frameworks (tests/torchpar/test_diloco.py)
        shapes = {k: v.shape for k, v in flatten(state["params"]).items()}
        state = state_from_params(layout, unflatten(load_weights(cfg.model.init_from, shapes)))
    data = open_splits(
        dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, dataset=str(dataset))), grain_batches
    )[0]
    outer_tx = optax.sgd(cfg.optim.outer_lr, momentum=momentum or None, nesterov=True)
    synced = {k: np.array(v) for k, v in flatten(jax.device_get(state["params"])).items()}

    def part(name: str, f: int):  # the index of fragment f's share of a parameter, or None
        if name.startswith("blocks."):
            return slice(f * L // F, (f + 1) * L // F)
        return slice(None) if f == 0 else None

    fragment = lambda flat, f: {n: jnp.asarray(x[part(n, f)]) for n, x in flat.items() if part(n, f) is not None}
    outer_states = [outer_tx.init(fragment(synced, f)) for f in range(F)]
    copy = lambda tree: jax.tree.map(jnp.copy, tree)  # the compiled step donates its state
    delay, in_flight = cfg.parallel.diloco_delay, {}  # fragment -> (the step its exchange started, its mean delta)

    def mean_delta(f: int, local: list) -> dict:
        mine, theirs = fragment(synced, f), [fragment(g, f) for g in local[:groups_counted]]
        return {n: sum(mine[n] - t[n] for t in theirs) / len(theirs) for n in mine}

    def meet(f: int, mean: dict, local: list) -> None:  # the outer step on `mean`; every group takes the result
        mine = fragment(synced, f)
        updates, outer_states[f] = outer_tx.update(mean, outer_states[f], mine)
        new = optax.apply_updates(mine, updates)
        bias = "blocks.moe.router.bias"
        if cfg.model.moe_bias_update and bias_mean and bias in new:
            new[bias] = mine[bias] - mean[bias]  # the groups' mean
        for n, x in new.items():
            synced[n][part(n, f)] = np.asarray(x)
            for g in local:
                g[n][part(n, f)] = np.asarray(x)

    group_states, losses = [copy(state) for _ in range(GROUPS)], []
    for s in range(cfg.train.steps):
        batch = data.rows(s, 0, cfg.train.global_batch_size)
        stepped = [step(g, jnp.asarray(batch[i * rows : (i + 1) * rows])) for i, g in enumerate(group_states)]
        losses.append(np.mean([float(m["loss"]) for _, m in stepped]))
        local = [{k: np.array(v) for k, v in flatten(jax.device_get(new["params"])).items()} for new, _ in stepped]
        last = s + 1 == cfg.train.steps
        on_schedule = [f for f in range(F) if (s + 1 - f * H // F) % H == 0]
        landing = [f for f, (t, _) in in_flight.items() if t + delay == s or last]
        for f in landing:  # an exchange started `delay` steps before: the mean delta taken then
            meet(f, in_flight.pop(f)[1], local)
        for f in range(F) if last else [] if delay else on_schedule:
            if f not in landing:
                meet(f, mean_delta(f, local), local)
        if delay and s + delay < cfg.train.steps - 1:  # exchanges that land before the last step start
            in_flight.update({f: (s, mean_delta(f, local)) for f in on_schedule})
        group_states = [
            {**new, "params": unflatten({k: jnp.asarray(v) for k, v in g.items()})}
            for (new, _), g in zip(stepped, local)
        ]
    return {"loss": losses, "params": synced}


@pytest.fixture(scope="module")
def want(dataset):
    return reference(tiny_config(*SETTINGS), dataset)


STREAMING = ("parallel.diloco_fragments=2", "train.steps=5")  # the last step's meeting not on the schedule
# streaming's overlap: fragment 1's exchange starts after step 0 and lands after step 1, fragment 0's after 1 and 2,
# fragment 1's after 2 and 3; fragment 0's of step 3 would land after the last step, so the last step's meeting has it
DELAYED = (*STREAMING, "parallel.diloco_delay=1")


@pytest.mark.parametrize(
    "mesh, extra",
    [
        ("diloco=2", ()),
        ("diloco=2,fsdp=2", ()),
        ("diloco=2,tp=2", ()),
        ("diloco=2,fsdp=2", STREAMING),
        ("diloco=2,fsdp=2", DELAYED),
    ],
    ids=["diloco=2", "diloco=2,fsdp=2", "diloco=2,tp=2", "streaming diloco=2,fsdp=2", "delayed diloco=2,fsdp=2"],
)
def test_diloco_equals_its_reference(mesh, extra, dataset, want):
    cfg, n = tiny_config(*SETTINGS, *extra), int(np.prod(list(parse_mesh(mesh).values())))
    got = run_steps(cfg, mesh, dataset, devices=jax.devices()[:n])
    want = reference(cfg, dataset) if extra else want
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
    assert_params_close(got["params"], want["params"])


def test_the_reference_tells_momentum_and_every_groups_delta_apart(dataset, want):
    """The comparison above can fail: the reference's parameters move by far more than its tolerance.

    That is so without the outer momentum, or with one group's delta dropped; and streaming's exchanges applied at
    their start rather than parallel.diloco_delay steps later.
    """
    for variant in (dict(momentum=0.0), dict(groups_counted=1)):
        other = reference(tiny_config(*SETTINGS), dataset, **variant)
        with pytest.raises(AssertionError):
            assert_params_close(other["params"], want["params"])
    delayed, at_once = (
        reference(tiny_config(*SETTINGS, *DELAYED), dataset),
        reference(tiny_config(*SETTINGS, *STREAMING), dataset),
    )
    with pytest.raises(AssertionError):
        assert_params_close(delayed["params"], at_once["params"])


def test_the_experts_balance_bias_becomes_the_groups_mean(dataset):
    """Experts over ep inside each group, their balance bias moved by each group's choices, equal the reference.

    The bias rule matters: applied by the outer optimizer instead, the parameters differ.
    """
    cfg = tiny_config(*SETTINGS, "model.moe_experts=4", "model.moe_bias_update=0.01")
    want = reference(cfg, dataset)
    got = run_steps(cfg, "diloco=2,ep=2", dataset, devices=jax.devices()[:4])
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
    assert_params_close(got["params"], want["params"])
    with pytest.raises(AssertionError):
        assert_params_close(reference(cfg, dataset, bias_mean=False)["params"], want["params"])


def _collectives(compiled, mesh):
    return [(c, group_axes(c.groups, mesh)) for c in parse(compiled.as_text(), mesh.devices.size)]


def test_the_inner_step_sends_nothing_between_groups_and_the_outer_step_the_parameters_once():
    cfg = tiny_config(*SETTINGS)
    layout, state, inner = build_step(cfg, parse_mesh("diloco=2,fsdp=2"), jax.devices()[:4])
    inside = _collectives(inner, layout.mesh)
    assert any("fsdp" in axes for _, axes in inside)  # the group's own fsdp traffic is there to be seen
    assert not [c for c, axes in inside if "diloco" in axes]
    outer = _collectives(make_outer_step(layout).lower(state, 0).compile(), layout.mesh)
    between = [c for c, axes in outer if "diloco" in axes]
    assert {c.op for c in between} == {"all-reduce"} and all(axes == ("diloco",) for c, axes in outer if c in between)
    device = layout.mesh.devices.flat[0]
    held = sum(
        s.data.nbytes for x in jax.tree.leaves(state["params"]) for s in x.addressable_shards if s.device == device
    )
    assert sum(c.result_bytes * c.count for c in between) == held


def test_a_delayed_exchange_rides_in_the_next_inner_step_and_sends_its_fragment_once():
    """parallel.diloco_delay: an exchange's start sends nothing; the step compiled to carry it all-reduces the fragment.

    The plain inner step has no collective over `diloco`; the step compiled to carry fragment 1's exchange (the second
    of the two layers' runs) has all-reduces over `diloco` alone, of exactly the bytes of that fragment's parameters on
    a device. (Which step carries it is the trainer's choice: the reference tests hold it.)
    """
    cfg = tiny_config(*SETTINGS, *DELAYED)
    layout, state, inner = build_step(cfg, parse_mesh("diloco=2,fsdp=2"), jax.devices()[:4])
    assert not [c for c, axes in _collectives(inner, layout.mesh) if "diloco" in axes]
    started = _collectives(make_outer_step(layout, 1, "start").lower(state, 0).compile(), layout.mesh)
    assert not [c for c, axes in started if "diloco" in axes]
    carrying = compiled_train_step(layout, state, carry=1)
    between = [(c, axes) for c, axes in _collectives(carrying, layout.mesh) if "diloco" in axes]
    assert {c.op for c, _ in between} == {"all-reduce"} and {axes for _, axes in between} == {("diloco",)}
    device, fragment = layout.mesh.devices.flat[0], piece(state["params"], layout.fragments[1])
    held = sum(s.data.nbytes for x in jax.tree.leaves(fragment) for s in x.addressable_shards if s.device == device)
    assert 0 < held < sum(x.nbytes for x in jax.tree.leaves(state["params"])) / 2
    assert sum(c.result_bytes * c.count for c, _ in between) == held


def test_the_planner_reports_the_bytes_between_groups():
    """Nothing per inner step; each meeting a ring all-reduce of the parameters over 2 groups; their mean over H.

    A ring all-reduce of P bytes over 2 devices sends P bytes from each.
    """
    from jaxpar.tools.plan import plan

    cfg = tiny_config(*SETTINGS)
    p = plan(cfg, parse_mesh("diloco=2,fsdp=2"), jax.devices()[:4])
    d = p["diloco"]
    assert d["inner_step_bytes"] == 0 and d["meeting_bytes"] == [p["params_bytes"]] and p["params_bytes"] > 0
    assert d["per_step_bytes"] == p["params_bytes"] / H
    streaming = plan(tiny_config(*SETTINGS, "parallel.diloco_fragments=2"), parse_mesh("diloco=2"), jax.devices()[:2])
    halves = streaming["diloco"]["meeting_bytes"]
    assert sum(halves) == streaming["params_bytes"] and all(0 < b < streaming["params_bytes"] for b in halves)
    delayed = plan(tiny_config(*SETTINGS, *DELAYED), parse_mesh("diloco=2"), jax.devices()[:2])  # the carrying steps'
    assert delayed["diloco"]["meeting_bytes"] == halves and delayed["diloco"]["inner_step_bytes"] == 0


def test_settings_diloco_does_not_run_with_are_refused_in_one_line():
    from jaxpar.checks import check_config

    sizes = resolve_sizes(parse_mesh("diloco=2,dp=2"), 4)
    for setting, named in (
        ("parallel.grad_compression=powersgd", "powersgd"),
        ("parallel.offload=optimizer", "offload"),
        ("model.compute_dtype=float16", "float16"),
    ):
        with pytest.raises(UserError, match=named):
            check_config(tiny_config(setting), sizes)
    with pytest.raises(UserError, match="diloco_fragments=3 does not divide parallel.diloco_inner_steps=4"):
        check_config(tiny_config("parallel.diloco_fragments=3", "parallel.diloco_inner_steps=4"), sizes)
    with pytest.raises(UserError, match="diloco_delay=4 must be below parallel.diloco_inner_steps=4") as e:
        check_config(tiny_config("parallel.diloco_delay=4", "parallel.diloco_inner_steps=4"), sizes)
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="does not divide the 2 layers of blocks"):
        build_step(
            tiny_config("parallel.diloco_fragments=4", "parallel.diloco_inner_steps=4"), sizes, jax.devices()[:4]
        )
    for backend in ("deepspeed", "pipeline"):  # torchpar's groups: ddp and fsdp (tests/torchpar/test_diloco.py)
        with pytest.raises(UserError, match="does not implement diloco"):
            check_torch_mesh("diloco=2", backend, 2)


IN_FLIGHT = ("parallel.diloco_inner_steps=4", "parallel.diloco_fragments=2", "parallel.diloco_delay=2")


@pytest.mark.parametrize("extra", [(), IN_FLIGHT], ids=["meeting", "exchange in flight"])
def test_a_killed_diloco_run_resumes_exactly_across_an_outer_step(tmp_path, dataset, extra):
    """Saved after step 3 (the groups apart, the outer momentum moving), killed after 4, resumed: all bit for bit.

    The resumed run repeats step 4, the meeting after it, and every step after that. Streaming (H = 4) with a delay
    of two steps: saved with fragment 1's exchange of step 2 in flight, its mean taken by step 3's program and waiting
    to land after step 4. That run, through the trainer (jaxpar.train), also equals the reference.
    """
    args = ["--mesh", "diloco=2", "parallel.diloco_inner_steps=2", "checkpoint.every=3", "train.steps=8", *extra]
    assert_resumes_exactly(tmp_path, dataset, args, kill_after=4)
    if extra:
        got, want = metrics(tmp_path / "full"), reference(read_run_config(str(tmp_path / "full")), dataset)
        np.testing.assert_allclose([got[s + 1]["loss"] for s in range(8)], want["loss"], rtol=1e-5)


def test_a_resume_with_another_delay_is_refused_in_one_line_also_from_a_run_before_the_key(tmp_path):
    """parallel.diloco_delay changed on resume is refused: the exchanges in flight were started for the old one.

    A run's config.json written before the key existed had no delay (its default): resuming it with one is refused
    too, before its checkpoint (which has no exchange state) is read.
    """
    import json

    from jaxpar.core.run.resume import check_resume

    (tmp_path / "checkpoints" / "2").mkdir(parents=True)
    saved = tiny_config(*SETTINGS, f"run.dir={tmp_path}", "parallel.diloco_delay=1").to_dict()
    (tmp_path / "config.json").write_text(json.dumps(saved))
    check_resume(tiny_config(*SETTINGS, f"run.dir={tmp_path}", "parallel.diloco_delay=1"))
    for record in (saved, {**saved, "parallel": {k: v for k, v in saved["parallel"].items() if k != "diloco_delay"}}):
        (tmp_path / "config.json").write_text(json.dumps(record))
        with pytest.raises(UserError, match=r"parallel.diloco_delay: [01] -> [02]") as e:
            check_resume(tiny_config(*SETTINGS, f"run.dir={tmp_path}", "parallel.diloco_delay=2"))
        assert "\n" not in str(e.value)


def test_a_resume_on_another_number_of_groups_is_refused_in_one_line(tmp_path, dataset):
    args, groups = ["checkpoint.every=2", "train.steps=4"], ["--mesh", "diloco=2", "parallel.diloco_inner_steps=2"]
    first = run_cli(tmp_path, dataset, *groups, *args, env={"JAXPAR_FAULT_KILL_AFTER_STEP": "2"})
    assert first.returncode == -signal.SIGKILL, first.stderr
    again = run_cli(tmp_path, dataset, "--mesh", "dp=2", *args)
    assert again.returncode != 0
    assert "DiLoCo's state for 2 groups" in again.stderr.strip().splitlines()[-1], again.stderr


def test_conversion_reads_the_synchronised_parameters_and_a_state_file_is_refused(tmp_path, dataset, capsys):
    run, final = tmp_path / "run", tmp_path / "final.safetensors"
    args = ["--mesh", "diloco=2", "parallel.diloco_inner_steps=2", "train.steps=4", "--write-final", str(final)]
    trained = run_cli(run, dataset, *args)
    assert trained.returncode == 0, trained.stderr
    converted = tmp_path / "converted.safetensors"
    assert convert.main(["--from", "jaxpar", str(run), "--to", "shared", str(converted)]) == 0
    got, want = read_weights(str(converted)), read_weights(str(final))
    assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)
    capsys.readouterr()
    assert convert.main(["--from", "jaxpar", str(run), "--to", "state", str(tmp_path / "state.safetensors")]) == 2
    assert "is a DiLoCo run" in capsys.readouterr().err.strip().splitlines()[-1]
