"""parallel.pipeline_schedule=auto on pp=4 with 8 microbatches.

jaxpar's choice is the schedule of least modeled time in the full table of the chooser's own figures, and configs where
different schedules win get different choices (a fixed auto fails one). Each schedule is traced once (its FLOPs),
nothing is compiled: the table reuses the figures the choice took and traces only the schedules it skipped.
"""

import jax
import pytest

from jaxpar.pipeline import auto as pipeline_auto
from jaxpar.core.pipeline.choice import candidates, modeled_time, with_schedule
from jaxpar.pipeline.auto import resolve_schedule
from tests.helpers import tiny_config

EIGHT = ("model.n_layer=8", "parallel.pipeline_microbatches=8", "train.global_batch_size=8")
SIZES = {"pp": 4}
NEVER = lambda *a: pytest.fail("nothing is compiled without a memory budget")


@pytest.fixture
def memo_flops(monkeypatch):
    """pipeline_auto.flops_ratio, each schedule traced once: {schedule: ratio} of those asked for so far."""
    real, figures = pipeline_auto.flops_ratio, {}

    def once(cfg, *args):
        s = cfg.parallel.pipeline_schedule
        if s not in figures:
            figures[s] = real(cfg, *args)
        return figures[s]

    monkeypatch.setattr(pipeline_auto, "flops_ratio", once)
    return figures


@pytest.mark.parametrize("layers,remat,winner", [(8, "none", "zb_v"), (8, "full", "zb_v"), (4, "full", "zb_h1")])
def test_auto_picks_the_least_modeled_time_of_the_full_table(layers, remat, winner, memo_flops):
    """pipeline_schedule=auto picks the least modeled time of the full table.

    Zero-bubble V has the least bubble (0.059) and, its W the weight matmuls alone, one device's FLOPs with
    model.remat=full too: it wins on 8 layers. 4 layers do not split into pp=4's 8 chunks, so zb_v and interleaved are
    refused and ZB-H1 (0.111) wins.
    """
    cfg = tiny_config(f"model.n_layer={layers}", *EIGHT[1:], f"model.remat={remat}")
    devices = jax.devices()[:4]
    chosen, line = resolve_schedule(cfg, SIZES, devices, NEVER)
    asked = set(memo_flops)
    sizes = pipeline_auto._full(SIZES)
    bubbles, refused = candidates(cfg, 4, lambda c: pipeline_auto.refusal(c, sizes))
    assert set(bubbles) | set(refused) == {"gpipe", "1f1b", "interleaved", "zb_h1", "zb_v", "dualpipev"}
    assert set(refused) == (set() if layers == 8 else {"interleaved", "zb_v", "dualpipev"})
    one: list = []
    table = {
        s: modeled_time(b, pipeline_auto.flops_ratio(with_schedule(cfg, s), sizes, devices, one))
        for s, b in bubbles.items()
    }
    assert chosen.parallel.pipeline_schedule == min(table, key=table.get) == winner
    assert len(asked) < len(table)  # the choice took fewer figures than the table has
    assert line.startswith(f"pipeline schedule auto -> {winner} (modeled step time {table[winner]:.2f}")


def test_auto_leaves_out_what_the_config_refuses_and_what_does_not_fit(monkeypatch):
    """pipeline_schedule=auto leaves out the schedules the config refuses and those that do not fit.

    A mixture of experts (dense first layers too) runs on every schedule, so the least bubble (zb_v) wins at equal
    FLOPs; with model.remat=offload it runs on gpipe alone; a budget that only gpipe's peak fits leaves gpipe. The
    figures here are stand-ins: what is tested is which schedules are candidates.
    """
    monkeypatch.setattr(pipeline_auto, "flops_ratio", lambda cfg, *a: 1.0)
    devices = jax.devices()[:4]
    moe = tiny_config(*EIGHT, "model.moe_experts=4")
    assert resolve_schedule(moe, SIZES, devices, NEVER)[0].parallel.pipeline_schedule == "zb_v"
    first_dense = tiny_config(*EIGHT, "model.n_layer=12", "model.moe_experts=4", "model.moe_first_dense=4")
    assert resolve_schedule(first_dense, SIZES, devices, NEVER)[0].parallel.pipeline_schedule == "zb_v"
    offload = tiny_config(*EIGHT, "model.moe_experts=4", "model.remat=offload")
    assert resolve_schedule(offload, SIZES, devices, NEVER)[0].parallel.pipeline_schedule == "gpipe"
    cfg = tiny_config(*EIGHT)
    peaks = {"gpipe": 100, "1f1b": 200, "interleaved": 200, "zb_h1": 200, "zb_v": 200, "dualpipev": 200}
    peak = lambda c, sizes, devices: peaks[c.parallel.pipeline_schedule]
    assert resolve_schedule(cfg, SIZES, devices, peak, 150)[0].parallel.pipeline_schedule == "gpipe"
    assert resolve_schedule(cfg, SIZES, devices, peak, 250)[0].parallel.pipeline_schedule == "zb_v"
