"""Multi-token prediction in the layout fuzzer's cases (parity_tests/fuzz_cases.py draws them through `with_mtp`).

One or two depths, now and then another loss weight, in a share of the cases whose run takes model.mtp_depth.
"""

from __future__ import annotations

import random
import zlib

MTP_SHARE = 0.15  # of the cases that run it
# the fuzz_cases.MODE_KEYS entry: the weight goes when the depth goes
MODE_KEYS = {"model.mtp_loss_weight": lambda c: c.get("model.mtp_depth", "0") != "0"}


# the schedules torchpar's pipeline runs it on (pp alone or pp x dp); auto picks among those it does not refuse
TORCH_PIPELINE = ("auto", "gpipe", "1f1b", "interleaved")


def runs_mtp(case) -> bool:
    """Whether the case's run takes model.mtp_depth.

    Every jaxpar pipeline schedule does, torchpar's pipeline backend with gpipe, 1f1b or interleaved, but pp x fsdp;
    model.linear=sketched does not (docs/architecture.md 'Multi-token prediction').
    """
    if case.get("model.linear") == "sketched":
        return False
    if case.side == "jax" or case.backend != "pipeline":
        return True
    sizes = case.mesh()
    return sizes["fsdp"] == 1 and case.get("parallel.pipeline_schedule", "auto") in TORCH_PIPELINE


def with_mtp(case):
    """The case with multi-token prediction, in a share of the cases that can run it.

    Drawn from the case's own spec (as fuzz_cases.with_routing): the cases a seed drew before stay what they were,
    but for these keys.
    """
    rng = random.Random(zlib.crc32(b"mtp " + case.spec.encode()))
    if rng.random() >= MTP_SHARE or not runs_mtp(case):
        return case
    s = {"model.mtp_depth": rng.choice(("1", "1", "2"))}
    if rng.random() < 0.3:
        s["model.mtp_loss_weight"] = rng.choice(("0.1", "1.0"))
    return case.with_settings(tuple(sorted({**dict(case.settings), **s}.items())))
