"""Matmul FLOPs of a traced program, counted on its jaxpr: 2*M*N*K per dot, a scan's body times its length.

Dots are dot_general and ragged_dot_general (model.moe_ragged's experts).

XLA's own cost analysis cannot compare pipeline schedules: it counts a while-loop body once and one branch of a
conditional (a 10-step scan of a matmul reports one matmul's FLOPs), and the executor is a scan over ticks of a switch.
Used by pipeline_memory for the FLOPs column.
"""

from __future__ import annotations

import math

from jax._src.interpreters import partial_eval as pe
from jax.extend.core import jaxprs_in_params


def dot_flops(eqn) -> float:
    """2 x every element of the left operand x the right operand's free (not contracted, not batch) size."""
    (_, rhs_contract), (_, rhs_batch) = eqn.params["dimension_numbers"]
    lhs, rhs = (v.aval.shape for v in eqn.invars)
    rhs_free = math.prod(n for i, n in enumerate(rhs) if i not in rhs_contract and i not in rhs_batch)
    return 2.0 * math.prod(lhs) * rhs_free


def ragged_dot_flops(eqn) -> float:
    """dot_flops of a ragged_dot_general: each left row meets one group of the right operand.

    The groups' axis is not a free one (model.moe_ragged: the rows routed to the experts, not experts x slots).
    """
    numbers = eqn.params["ragged_dot_dimension_numbers"]
    (_, rhs_contract), (_, rhs_batch) = numbers.dot_dimension_numbers
    skip = {*rhs_contract, *rhs_batch, *numbers.rhs_group_dimensions}
    lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
    return 2.0 * math.prod(lhs) * math.prod(n for i, n in enumerate(rhs) if i not in skip)


def _live(jaxpr):
    """`jaxpr` without the equations none of its outputs needs, as XLA will compile it.

    A ZB-H1 B applies a pullback and keeps only the input's gradient. jax's own dead-code pass; an internal module.
    """
    return pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))[0]


def matmul_flops(jaxpr, branch_cost=max, scope: str | None = None) -> float:
    """FLOPs of every dot_general in `jaxpr` (a core Jaxpr) that an output needs, nested calls included.

    A conditional counts `branch_cost` of its branches' FLOPs (default: the largest). `scope`: only those traced
    under jax.named_scope(scope), their gradients included (the backward pass keeps the forward's name).
    """
    jaxpr, total = _live(jaxpr), 0.0
    for eqn in jaxpr.eqns:
        name, inner = eqn.primitive.name, scope
        if scope is not None and scope in str(eqn.source_info.name_stack):
            inner = None  # all of it counts, nested calls (jnp.einsum's jit) too
        if name in ("dot_general", "ragged_dot_general"):
            total += (dot_flops if name == "dot_general" else ragged_dot_flops)(eqn) if inner is None else 0.0
        elif name == "cond":
            total += branch_cost([matmul_flops(b.jaxpr, branch_cost, inner) for b in eqn.params["branches"]])
        elif name == "scan":
            total += eqn.params["length"] * matmul_flops(eqn.params["jaxpr"].jaxpr, branch_cost, inner)
        elif name.startswith("custom_"):  # the primal computation only, not the rule beside it
            sub = eqn.params.get("call_jaxpr") or eqn.params.get("fun_jaxpr")
            total += matmul_flops(getattr(sub, "jaxpr", sub), branch_cost, inner)
        else:
            total += sum(matmul_flops(sub, branch_cost, inner) for sub in jaxprs_in_params(eqn.params))
    return total


def branch_flops(jaxpr, n_branches: int) -> list[float]:
    """FLOPs of each branch of the first conditional with `n_branches` branches (the executor's tick)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cond" and len(eqn.params["branches"]) == n_branches:
            return [matmul_flops(b.jaxpr) for b in eqn.params["branches"]]
        for sub in jaxprs_in_params(eqn.params):
            found = branch_flops(sub, n_branches)
            if found:
                return found
    return []
