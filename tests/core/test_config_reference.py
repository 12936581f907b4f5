"""docs/configuration.md is what jaxpar/tools/config_reference.py makes of the schema and the key contract."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from jaxpar.core.config.schema import Config
from jaxpar.core.config.contract import BACKENDS, Owner
from jaxpar.tools import config_reference as ref

REGENERATE = "run: python -m jaxpar.tools.config_reference --write"


def schema_keys() -> list[tuple[str, type, dataclasses.Field]]:
    return [(f"{name}.{f.name}", cls, f) for name, cls in ref.sections(Config).items() for f in dataclasses.fields(cls)]


def test_the_committed_page_is_the_schemas():
    with open(ref.PAGE, encoding="utf-8") as f:
        committed = f.read()
    assert committed == ref.render(), f"docs/configuration.md is out of date; {REGENERATE}"
    assert ref.main(["--check"]) == 0


def test_every_key_is_on_the_page_with_what_it_does():
    with open(ref.PAGE, encoding="utf-8") as f:
        page = f.read()
    comments = ref.field_comments(open(ref.config_module.__file__, encoding="utf-8").read())
    missing = [key for key, _, _ in schema_keys() if f"- **`{key}`** (" not in page]
    assert not missing, f"keys missing from docs/configuration.md: {missing}; {REGENERATE}"
    silent = [key for key, cls, f in schema_keys() if not ref.describe(key, comments, cls.__name__, f.name)]
    assert not silent, (
        f"keys without a description: {silent}; write a comment beside the field in jaxpar/core/config/schema.py"
    )


def test_notes_only_fill_in_for_keys_without_a_comment():
    """A NOTES line for a key that has a comment in config.py would never show: the table stays the exceptions."""
    comments = ref.field_comments(open(ref.config_module.__file__, encoding="utf-8").read())
    keys = {key: (cls.__name__, f.name) for key, cls, f in schema_keys()}
    assert not (set(ref.NOTES) - set(keys)), f"NOTES for keys the schema does not have: {set(ref.NOTES) - set(keys)}"
    shadowed = [key for key in ref.NOTES if keys[key] in comments]
    assert not shadowed, f"NOTES for keys that have a comment in config.py (drop them from NOTES): {shadowed}"


def test_the_comments_beside_and_above_a_field_are_read():
    comments = ref.field_comments(open(ref.config_module.__file__, encoding="utf-8").read())
    assert comments[("ModelConfig", "n_kv_head")].startswith("llama's key/value heads (GQA)")  # beside it
    assert comments[("ModelConfig", "family")].startswith("gpt2: learned positions")  # the block above it
    assert ("ModelConfig", "vocab_size") not in comments  # the block above `family` is not the next field's


# A planted schema: the page follows whatever the schema, its comments and the contract say.
TOY_SOURCE = """
@dataclass
class ToySection:
    # how big it is,
    # over two lines
    size: int = field(default=2, metadata=_check(lo=1))
    mode: str = field(default="a", metadata=_check(choices=("a", "b")))  # which <kind> * of thing
    ratio: float = field(default=0.5, metadata=_check(lo=0.0, hi=1.0, lo_open=True))
"""


def _meta(choices=None, lo=None, hi=None, lo_open=False):
    return {"choices": choices, "lo": lo, "hi": hi, "lo_open": lo_open}


@dataclass
class ToySection:
    size: int = field(default=2, metadata=_meta(lo=1))
    mode: str = field(default="a", metadata=_meta(choices=("a", "b")))
    ratio: float = field(default=0.5, metadata=_meta(lo=0.0, hi=1.0, lo_open=True))


@dataclass
class Toy:
    toy: ToySection = field(default_factory=ToySection)


def test_a_planted_schema_shows_on_the_page():
    contract = {
        "toy.size": Owner(True, ("ddp",), "step", mode="x>1", why_not="ddp alone"),
        "toy.mode": Owner(False, BACKENDS, "step"),
    }
    page = ref.render(Toy, contract, TOY_SOURCE)
    assert (
        "- **`toy.size`** (`int`, default `2`, >= 1): how big it is, over two lines. Acted on by jaxpar and "
        "torchpar --backend ddp. Only with x>1. Elsewhere it is refused: ddp alone."
    ) in page.replace("\n  ", " ")
    assert (
        "- **`toy.mode`** (`str`, default `a`, one of `a`, `b`): which \\<kind> * of thing. Acted on by torchpar "
        "(every backend)." in page.replace("\n  ", " ")
    )
    assert "- **`toy.ratio`** (`float`, default `0.5`, > 0.0 and <= 1.0). No contract row." in page
    assert "## toy" in page and "## model" not in page
    assert page != ref.render()  # so a key added to the real schema changes the page the first test compares
