"""parallel.pipeline_schedule=auto on pp=4 with 8 microbatches: jaxpar's choice is the planner's `--schedules` row of
least modeled time, and configs where different schedules win get different choices (a fixed auto fails one)."""
import jax
import pytest

from jaxpar.pipeline_auto import resolve_schedule
from jaxpar.tools.plan import compare_schedules, peak_bytes
from tests.helpers import tiny_config

EIGHT = ("model.n_layer=8", "parallel.pipeline_microbatches=8", "train.global_batch_size=8")


@pytest.mark.parametrize("remat,winner", [("none", "zb_v"), ("full", "interleaved")])
def test_auto_picks_the_least_modeled_time_of_the_planners_table(remat, winner):
    """Without remat zero-bubble V wins (FLOPs 1.00x, bubble 0.059); with model.remat=full its W recomputes the
    forward (1.41x) and interleaved's 1.00x / (1 - 0.158) is least (issue 48's table)."""
    cfg = tiny_config(*EIGHT, f"model.remat={remat}")
    devices = jax.devices()[:4]
    chosen, line = resolve_schedule(cfg, {"pp": 4}, devices, peak_bytes)
    rows = {r["schedule"]: r for r in compare_schedules(cfg, {"pp": 4}, devices) if "refused" not in r}
    least = min(rows, key=lambda s: rows[s]["modeled_time"])
    assert chosen.parallel.pipeline_schedule == least == winner
    assert [s for s, r in rows.items() if r["auto"]] == [winner]  # the table marks it
    assert line.startswith(f"pipeline schedule auto -> {winner} (modeled step time {rows[winner]['modeled_time']:.2f}")


def test_auto_leaves_out_what_the_config_refuses_and_what_does_not_fit():
    """A mixture of experts runs on gpipe alone; a memory budget under every schedule's peak but gpipe's (remat
    full: gpipe holds the least) leaves gpipe."""
    devices = jax.devices()[:4]
    moe = tiny_config(*EIGHT, "model.moe_experts=4")
    assert resolve_schedule(moe, {"pp": 4}, devices, peak_bytes)[0].parallel.pipeline_schedule == "gpipe"
    cfg = tiny_config(*EIGHT, "model.remat=full")
    rows = {r["schedule"]: r for r in compare_schedules(cfg, {"pp": 4}, devices) if "refused" not in r}
    budget = min(r["peak_bytes"] for s, r in rows.items() if s != "gpipe") - 1
    assert rows["gpipe"]["peak_bytes"] <= budget
    assert resolve_schedule(cfg, {"pp": 4}, devices, peak_bytes, budget)[0].parallel.pipeline_schedule == "gpipe"
