"""parallel.pipeline_schedule=auto's chooser (jaxpar/core/pipeline/choice.py).

The least modeled step time, found without taking every schedule's figures.
"""

import itertools

import pytest

from jaxpar.core.errors import UserError
from jaxpar.core.pipeline.choice import choose, modeled_time, resolve
from jaxpar.core.config.schema import load_config


def test_choose_is_the_argmin_of_every_figure_and_asks_only_for_those_that_could_win():
    """On a grid of FLOPs ratios (each >= 1.0) the lazy visit picks what the full table's argmin picks.

    A ratio is asked for only while its bubble's bound could still beat the best.
    """
    bubbles = {"gpipe": 0.273, "1f1b": 0.273, "interleaved": 0.158, "zb_h1": 0.111, "zb_v": 0.059}
    asked = set()
    for ratios in itertools.product((1.0, 1.2, 1.45), repeat=5):
        figures = dict(zip(bubbles, ratios))
        asked.clear()
        best, times = choose(bubbles, lambda s: asked.add(s) or figures[s])
        table = {s: modeled_time(bubbles[s], figures[s]) for s in bubbles}
        assert table[best] == min(table.values()) and set(times) == asked
    best, times = choose(bubbles, lambda s: 1.0)
    assert (best, set(times)) == ("zb_v", {"zb_v"})  # one figure taken, not five
    best, _ = choose(bubbles, lambda s: 1.0, fits=lambda s: s in ("gpipe", "1f1b"))
    assert best == "1f1b"  # a tie in time goes to 1f1b, which holds less than gpipe


def test_resolve_is_inert_without_a_pipeline_or_a_named_schedule_and_names_every_refusal():
    cfg = load_config(None, [])
    assert cfg.parallel.pipeline_schedule == "auto"  # the default
    never = lambda c: pytest.fail("no figures without a pipeline")
    assert resolve(cfg, 1, never, never) == (cfg, None)
    named = load_config(None, ["parallel.pipeline_schedule=1f1b"])
    assert resolve(named, 4, never, never) == (named, None)

    def refuse(c):
        if c.parallel.pipeline_schedule != "gpipe":
            raise UserError(f"no {c.parallel.pipeline_schedule}")

    chosen, line = resolve(cfg, 4, refuse, lambda c: 1.37)
    assert chosen.parallel.pipeline_schedule == "gpipe" and line.startswith("pipeline schedule auto -> gpipe")
    with pytest.raises(UserError, match="no schedule runs this config.*gpipe: no.*zb_v: no zb_v"):
        resolve(
            cfg,
            4,
            lambda c: (
                refuse(c) if c.parallel.pipeline_schedule != "gpipe" else (_ for _ in ()).throw(UserError("no gpipe"))
            ),
            lambda c: 1.0,
        )
    with pytest.raises(UserError, match="^the same for all$"):  # a refusal no schedule changes, said once
        resolve(cfg, 4, lambda c: (_ for _ in ()).throw(UserError("the same for all")), lambda c: 1.0)


def test_virtual_stages_the_user_set_leave_auto_interleaved_alone():
    """parallel.pipeline_virtual_stages=4 under auto: interleaved with its 4 (another schedule would drop them)."""
    cfg = load_config(None, ["parallel.pipeline_virtual_stages=4"])
    chosen, line = resolve(cfg, 2, lambda c: None, lambda c: 1.0)
    assert (chosen.parallel.pipeline_schedule, chosen.parallel.pipeline_virtual_stages) == ("interleaved", 4), line
