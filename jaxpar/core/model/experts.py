"""A mixture of experts' rules that both frameworks share (jax-free, torch-free).

The capacity of an expert in a row, the dispatch buffer's slots (jaxpar and its planner), and the records a step's
expert statistics make (jaxpar/models/moe.py, torchpar/models/moe.py).
"""

from __future__ import annotations

import math

from jaxpar.core.errors import UserError


def row_capacity(cfg, T: int) -> int:
    """Choices one expert takes from a row of T tokens (model.moe_capacity_factor x its even share, rounded up).

    0: no limit (dropless).
    """
    c = cfg.moe_capacity_factor
    return 0 if c <= 0 else max(1, math.ceil(c * cfg.moe_top_k * T / cfg.moe_experts))


def slots_for(tokens: int, rows: int, capacity: int) -> int:
    """Slots per expert a device's dispatch buffer needs (jaxpar/parallel/expert_dispatch.py).

    All its tokens (dropless, capacity 0: a token picks an expert at most once), or a row's capacity per row.
    """
    return tokens if capacity <= 0 else min(tokens, rows * capacity)


def expert_records(stats, experts: int) -> dict:
    """The step's mixture-of-experts records, from the experts' statistics.

    `stats`: [choices each expert received (summed over rows and microbatches; over the layers too, or layer-major per
    expert layer), choices dropped, the mean balance loss per row and layer]. The records: each expert's share of the
    choices over the layers (moe_load), the busiest one's share x experts (moe_max_load; 1.0 when even), the share
    dropped by the capacity, the balance loss (1.0 when even; model.moe_aux_loss weighs it into the loss).
    """
    per_layer = [float(r) for r in stats[:-2]]
    received = [sum(per_layer[e::experts]) for e in range(experts)]
    total = max(sum(received), 1.0)
    load = [r / total for r in received]
    return {
        "moe_load": load,
        "moe_max_load": max(load) * len(load),
        "moe_dropped": float(stats[-2]) / total,
        "moe_balance": float(stats[-1]),
    }


# The auxiliary-loss-free balance (DeepSeek-V3, model.moe_bias_update = g > 0): each expert layer keeps a bias per
# expert that is added to the scores when the top_k experts are chosen, never to the weights the chosen outputs are
# summed with; after every applied update, each expert's bias moves by g towards balance: + g where the expert
# received fewer choices than its layer's mean over the step's whole batch, - g where more, 0 where exactly as many.
# No gradient reaches it. Both frameworks apply it to the step's integer counts in float32, so they agree exactly.


def check_expert_axis(model, ep: int) -> None:
    """The ep mesh axis (either framework) shards a mixture of experts, evenly."""
    if ep > 1 and not model.moe_experts:
        raise UserError(
            f"mesh axis ep={ep} shards a mixture of experts, and this model has none (set "
            "model.moe_experts, or put those devices on dp)"
        )
    if model.moe_experts % ep:
        raise UserError(f"model.moe_experts={model.moe_experts} is not divisible by ep={ep}")
