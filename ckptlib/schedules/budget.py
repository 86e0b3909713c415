"""A plan for a memory budget: the least recomputation time whose peak fits, by dynamic programming.

Given what each layer costs (``LayerCost``: the bytes a checkpoint in front of it
keeps, the bytes it saves when recorded, the seconds of its forward), the fastest
plan within a budget is found as rotor does (Beaumont et al. 2019): over
segments ``[a, b)`` and the memory left, the first step either records layer
``a`` or checkpoints a first part ``[a, c)``. :func:`plan_for_budget` says how,
and what it rounds.
"""
from __future__ import annotations

import math
from typing import Sequence

from ckptlib._arguments import number
from ckptlib.schedules.plan import LayerCost, Plan, Segment, Step, checked_costs

__all__ = ["plan_for_budget"]

_GRID_STEPS = 512  # memory resolution of plan_for_budget when sizes share no coarser unit


def plan_for_budget(layer_costs: Sequence[LayerCost | Sequence[float]],
                    memory_budget: float) -> Plan:
    """The plan with the least forward time whose :meth:`Plan.peak_bytes` fits ``memory_budget``.

    ``layer_costs`` has one record per layer: ``LayerCost(input_bytes,
    saved_bytes, forward_s)`` or a plain ``(input_bytes, saved_bytes,
    forward_s)`` tuple (see :class:`LayerCost`;
    ``ckptlib.sequential.measure_layer_costs`` measures them). The budget bounds
    what the plan keeps (checkpoints and recorded layers), not parameters or
    gradients.

    Dynamic programming over segments ``[a, b)`` and memory left ``m``, as in
    rotor (Beaumont et al. 2019): the first step of ``[a, b)`` either records
    layer ``a`` (``m - saved_bytes[a]`` left for ``[a+1, b)``), or checkpoints
    ``[a, c)``: advance over it, reverse ``[c, b)`` with ``m - input_bytes[a]``,
    then rerun ``[a, c)`` with ``m``. Sizes are counted in a common unit: exact
    when all sizes are multiples of ``memory_budget / 512`` or coarser, else
    rounded up to it (the plan then fits, and is optimal up to that rounding).

    Raises ValueError when no plan fits, naming the least memory that does.

    >>> costs = [LayerCost(input_bytes=100, saved_bytes=200, forward_s=1.0)] * 6
    >>> plan_for_budget(costs, 1200).forward_steps          # everything recorded fits
    0
    >>> plan = plan_for_budget(costs, 700)
    >>> plan.peak_bytes(costs) <= 700, plan.forward_steps
    (True, 3)
    >>> plan_for_budget(costs, 250)  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    ValueError: no plan runs these 6 layers within 250 bytes: the least any plan keeps is 300
    bytes. Raise memory_budget to at least 300, or make the layers smaller.
    """
    costs = checked_costs(layer_costs, None)
    if not costs:
        raise ValueError("plan_for_budget: layer_costs is empty; give one LayerCost per layer.")
    memory_budget = number(memory_budget, "memory_budget", least=0, unit="number of bytes",
                           where="plan_for_budget")
    n = len(costs)
    least_bytes, least_body = least_memory_plan(costs)
    if least_bytes > memory_budget:
        raise ValueError(
            f"no plan runs these {n} layers within {memory_budget} bytes: the least any plan "
            f"keeps is {least_bytes} bytes. "
            f"Raise memory_budget to at least {least_bytes}, or make the layers smaller."
        )
    # Rounding sizes up can hide plans that fit only just; the least-memory plan is then the answer.
    body = _fastest_plan_within(costs, memory_budget) or least_body
    return Plan(body, name=f"plan_for_budget({n} layers, {memory_budget} bytes)")


def _body_from_choices(choose, start: int, stop: int, memory: int,
                       record_size: Sequence[int],
                       checkpoint_size: Sequence[int]) -> tuple[Step, ...]:
    """Rebuild a body from a DP's choices: ``choose(a, b, memory)`` is -1 (record a) or c
    (checkpoint [a, c))."""
    steps: list[Step] = []
    while start < stop:
        choice = choose(start, stop, memory)
        if choice < 0:
            steps.append(start)
            memory -= record_size[start]
            start += 1
        else:
            inner = _body_from_choices(choose, start, choice, memory, record_size, checkpoint_size)
            steps.append(Segment(start, choice, inner))
            memory -= checkpoint_size[start]
            start = choice
    return tuple(steps)


def least_memory_plan(costs: list[LayerCost]) -> tuple[float, tuple[Step, ...]]:
    """The smallest peak_bytes of any plan (exact), and a plan that has it."""
    n = len(costs)
    least: dict[tuple[int, int], float] = {(b, b): 0 for b in range(n + 1)}
    choice: dict[tuple[int, int], int] = {}
    for length in range(1, n + 1):
        for a in range(n - length + 1):
            b = a + length
            options = [(costs[a].saved_bytes + least[a + 1, b], -1)]
            options += [(max(costs[a].input_bytes + least[c, b], least[a, c]), c)
                        for c in range(a + 1, b)]
            least[a, b], choice[a, b] = min(options)
    zeros = [0] * n
    body = _body_from_choices(lambda a, b, _: choice[a, b], 0, n, 0, zeros, zeros)
    return least[0, n], body


def _fastest_plan_within(costs: list[LayerCost], memory_budget: float) -> tuple[Step, ...] | None:
    """The body with the least recomputation time within the budget, on a memory grid; None if
    none fits."""
    import numpy as np

    n = len(costs)
    sizes = [size for cost in costs for size in cost[:2]]
    unit: float = memory_budget / _GRID_STEPS
    if all(isinstance(size, int) for size in sizes) and isinstance(memory_budget, int):
        common = math.gcd(*sizes) or 1
        if memory_budget // common <= _GRID_STEPS:
            unit = common
    limit = int(memory_budget // unit)
    record_size = [math.ceil(cost.saved_bytes / unit) for cost in costs]
    checkpoint_size = [math.ceil(cost.input_bytes / unit) for cost in costs]
    advanced_s = np.concatenate([[0.0], np.cumsum([cost.forward_s for cost in costs])])

    def after_spending(times: np.ndarray, size: int) -> np.ndarray:
        # times[..., m - size] at memory level m; infinitely slow where m < size
        shifted = np.full(times.shape, np.inf)
        if size <= limit:
            shifted[..., size:] = times[..., :limit + 1 - size]
        return shifted

    # time[a, b, m]: least recomputation seconds to reverse layers a..b-1 from a kept x_a with m
    # memory units; choice[a, b, m]: -1 to record layer a first, c to checkpoint a..c-1 first.
    time = np.full((n + 1, n + 1, limit + 1), np.inf)
    time[np.arange(n + 1), np.arange(n + 1)] = 0.0
    choice = np.full((n + 1, n + 1, limit + 1), -1, dtype=np.int32)
    for length in range(1, n + 1):
        for a in range(n - length + 1):
            b = a + length
            best = after_spending(time[a + 1, b], record_size[a])
            if length > 1:
                cuts = np.arange(a + 1, b)
                options = ((advanced_s[cuts] - advanced_s[a])[:, None]
                           + after_spending(time[cuts, b], checkpoint_size[a]) + time[a, cuts])
                fastest = options.argmin(axis=0)
                better = options[fastest, np.arange(limit + 1)] < best
                best = np.where(better, options[fastest, np.arange(limit + 1)], best)
                choice[a, b] = np.where(better, cuts[fastest], -1)
            time[a, b] = best
    if not np.isfinite(time[0, n, limit]):
        return None
    return _body_from_choices(lambda a, b, m: int(choice[a, b, m]), 0, n, limit, record_size,
                              checkpoint_size)
