"""The classic schedules for a chain of n layers: uniform segments, sqrt(n), recursive halving,
Revolve.

Each returns a :class:`~ckptlib.schedules.plan.Plan` (whose notes say how a plan
runs); here is only how each one cuts the chain:

* ``uniform(n, k)``: k-1 flat segments, then the last segment's layers recorded
  (what ``torch.utils.checkpoint.checkpoint_sequential`` does); ``sqrt_n(n)`` is
  the same with segments of ``ceil(sqrt(n))`` layers (Chen et al. 2016).
* ``recursive(n)``: checkpoint the first half, recurse into both halves: about
  ``log2 n`` checkpoints (Chen et al. 2016).
* ``revolve(n, s)``: Griewank and Walther's binomial schedule, the fewest
  recomputations with ``s`` checkpoints, found by dynamic programming.
"""
from __future__ import annotations

import math
from typing import Sequence

from ckptlib._arguments import integer
from ckptlib.schedules.plan import Plan, Segment, Step

__all__ = ["uniform", "sqrt_n", "recursive", "revolve"]


def _segments_then_tail(sizes: Sequence[int]) -> tuple[Step, ...]:
    """All segments but the last checkpointed (flat); the last one's layers recorded."""
    body: list[Step] = []
    start = 0
    for size in sizes[:-1]:
        body.append(Segment(start, start + size))
        start += size
    return (*body, *range(start, start + sizes[-1]))


def uniform(n: int, k: int) -> Plan:
    """``k`` segments as ``torch.utils.checkpoint.checkpoint_sequential`` makes them.

    The first ``k-1`` segments have ``n // k`` layers each and are checkpointed;
    the last holds the rest and is recorded. ``checkpoint_sequential(modules, k, x)``
    runs exactly this plan.

    >>> plan = uniform(16, 4)
    >>> plan.body[:2]
    (Segment(start=0, stop=4, body=(0, 1, 2, 3)), Segment(start=4, stop=8, body=(4, 5, 6, 7)))
    >>> plan.forward_steps, plan.peak_slots, plan.peak_activations
    (12, 3, 7)
    """
    n = integer(n, "n (the number of layers)", least=1, where="uniform")
    k = integer(k, "k (the number of segments)", least=1, where="uniform")
    if k > n:
        raise ValueError(f"uniform({n}, {k}): cannot cut {n} layers into {k} segments; use "
                         f"k <= {n}.")
    size = n // k
    return Plan(_segments_then_tail([size] * (k - 1) + [n - size * (k - 1)]),
                name=f"uniform({n}, {k})")


def sqrt_n(n: int) -> Plan:
    """Segments of ``ceil(sqrt(n))`` layers, all but the last checkpointed (Chen et al. 2016).

    About ``sqrt(n)`` checkpoints plus one segment of ``sqrt(n)`` recorded
    layers: ``peak_activations <= 2*ceil(sqrt(n)) - 1``, for ``n - ceil(sqrt(n))``
    recomputed layer forwards. For a perfect square it is ``uniform(n, sqrt(n))``.

    >>> plan = sqrt_n(64)
    >>> plan.peak_slots, plan.peak_activations, plan.forward_steps
    (7, 15, 56)
    """
    n = integer(n, "n (the number of layers)", least=1, where="sqrt_n")
    size = math.isqrt(n - 1) + 1  # ceil(sqrt(n))
    count, rest = divmod(n, size)
    sizes = [size] * count + ([rest] if rest else [])
    return Plan(_segments_then_tail(sizes), name=f"sqrt_n({n})")


def recursive(n: int) -> Plan:
    """Chen et al. (2016)'s log n plan: checkpoint the first half, recurse into both halves.

    Body of ``[a, b)``: ``(Segment(a, m, body of [a, m)), *body of [m, b))``
    with ``m`` the middle. About ``log2 n`` checkpoints and ``(n/2) log2 n``
    recomputed layer forwards.

    >>> plan = recursive(16)
    >>> plan.peak_slots, plan.peak_activations, plan.forward_steps
    (4, 5, 32)
    """
    n = integer(n, "n (the number of layers)", least=1, where="recursive")

    def body(start: int, stop: int) -> tuple[Step, ...]:
        if stop - start == 1:
            return (start,)
        middle = start + (stop - start + 1) // 2
        return (Segment(start, middle, body(start, middle)), *body(middle, stop))

    return Plan(body(0, n), name=f"recursive({n})")


def revolve(n: int, slots: int) -> Plan:
    """Griewank and Walther's binomial checkpointing: fewest recomputations with ``slots``
    checkpoints.

    ``slots`` counts checkpoints, the one holding the input ``x0`` included
    (Griewank-Walther's ``s``). The plan is found by dynamic programming over
    "advance from ``x_a`` by ``j`` layers, store ``x_{a+j}``, reverse the rest
    with one slot fewer, then reverse the first ``j`` layers"; its
    ``forward_steps`` is the optimum ``r*n - C(slots+r, slots+1)``, ``r`` the
    least integer with ``C(slots+r, slots) >= n``. ``peak_slots <= slots``.

    >>> plan = revolve(10, 2)
    >>> plan.forward_steps, plan.peak_slots
    (20, 2)
    >>> 3 * 10 - math.comb(2 + 3, 2 + 1)       # r = 3: C(5, 2) = 10 >= 10 > C(4, 2)
    20
    >>> revolve(10, 3).forward_steps           # r = 2: 2*10 - C(5, 4)
    15
    """
    n = integer(n, "n (the number of layers)", least=1, where="revolve")
    slots = integer(slots, "slots (checkpoints, x0 included)", least=1, where="revolve")
    usable = max(1, min(slots, n - 1))  # with n-1 slots no layer is advanced over twice
    # steps[s][l]: least advances to reverse l layers from a stored input with s slots;
    # split[s][l]: the first advance j of such a schedule. With no slot left, only a
    # single layer (reversed from the current state) can be handled.
    steps = [[0, 0] + [math.inf] * (n - 1)] + [[0] * (n + 1) for _ in range(usable)]
    split = [[0] * (n + 1) for _ in range(usable + 1)]
    for s in range(1, usable + 1):
        for length in range(2, n + 1):
            steps[s][length], split[s][length] = min(
                (j + steps[s - 1][length - j] + steps[s][j], j) for j in range(1, length))

    def body(start: int, length: int, s: int) -> tuple[Step, ...]:
        if length == 1:
            return (start,)
        j = split[s][length]
        return (Segment(start, start + j, body(start, j, s)), *body(start + j, length - j, s - 1))

    return Plan(body(0, n, usable), name=f"revolve({n}, slots={slots})")
