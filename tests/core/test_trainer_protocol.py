"""The adapter the shared run drives stays small, and both trainers implement all of it.

jaxpar/core/run/loop.py's `Trainer` has at most a dozen methods; the rest of a trainer's work goes to its collaborators
(jaxpar/core/run/adapter.py), each implemented by a class of the trainer's own, not by the trainer again.
"""

from __future__ import annotations

import importlib
import typing

import pytest

from jaxpar.core.run import adapter
from jaxpar.core.run.loop import Trainer

MAX_METHODS = 12


def methods(cls) -> list[str]:
    """The public methods a class (a protocol) defines in its own body."""
    return sorted(name for name, value in vars(cls).items() if callable(value) and not name.startswith("_"))


def collaborators(cls) -> dict[str, type]:
    """{attribute: class} of the attributes `cls` annotates (a protocol: those typed by a collaborator protocol)."""
    hints = typing.get_type_hints(cls)
    if cls is Trainer:
        return {name: hint for name, hint in hints.items() if getattr(hint, "__module__", None) == adapter.__name__}
    return {name: hint for name, hint in hints.items() if isinstance(hint, type)}


def missing(protocol, cls) -> list[str]:
    """The protocol's methods and annotated attributes that `cls` lacks."""
    return [name for name in methods(protocol) if not callable(getattr(cls, name, None))] + [
        name for name in vars(protocol).get("__annotations__", {}) if not hasattr(cls, name)
    ]


def gaps(trainer) -> list[str]:
    """What `trainer` lacks of the Trainer protocol: its methods, its collaborators and theirs."""
    found = [name for name in methods(Trainer) if not callable(getattr(trainer, name, None))]
    implemented = collaborators(trainer)
    for name, protocol in collaborators(Trainer).items():
        cls = implemented.get(name)
        if cls is None or cls is trainer:
            found.append(f"{name}: no class of its own")
        else:
            found += [f"{name}.{m} ({cls.__name__})" for m in missing(protocol, cls)]
    return found


def test_the_trainer_protocol_is_small():
    assert len(methods(Trainer)) <= MAX_METHODS, f"Trainer has {len(methods(Trainer))} methods: {methods(Trainer)}"
    assert set(collaborators(Trainer)) == {"processes", "probes", "profiling", "faults"}, collaborators(Trainer)
    assert all(methods(p) for p in collaborators(Trainer).values())


@pytest.mark.parametrize("module,name", [("jaxpar.trainer", "JaxTrainer"), ("torchpar.trainer", "TorchTrainer")])
def test_both_trainers_implement_the_protocol_and_its_collaborators(module, name):
    trainer = getattr(importlib.import_module(module), name)
    assert not (bad := gaps(trainer)), f"{trainer.__name__} lacks: {bad}"


LARGE = type("Large", (), {name: lambda self: None for name in "abcdefghijklm"})  # a planted adapter: 13 methods


class Half:
    """A planted trainer: some of the methods, its probes itself."""

    probes: Half

    def restore_or_init(self):
        return 0


def test_the_checks_catch_planted_violations():
    assert len(methods(LARGE)) == 13 > MAX_METHODS
    bad = gaps(Half)
    assert "probes: no class of its own" in bad and "processes: no class of its own" in bad, bad
    assert "train_step" in bad and "restore_or_init" not in bad, bad
