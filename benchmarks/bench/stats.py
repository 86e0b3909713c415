"""Ratios, medians and intervals: the arithmetic of the bench, as pure functions.

A time *ratio* between two variants is the median of their per-round ratios
(the variants of one round ran back to back, so a slow spell of the machine
cancels out of it); a spread is the interquartile range (IQR). The scaling run's
fits (``peak ~ c * n**p`` and ``peak ~ a + b * log2(n)``) are the library's own,
:mod:`ckptlib.fits`, which notebook 05 uses too.
"""

from __future__ import annotations

import random
import statistics
from typing import Sequence


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, or ``None`` when either is missing or the denominator is 0.

    >>> ratio(3.0, 4.0), ratio(1.0, 0.0), ratio(None, 2.0)
    (0.75, None, None)
    """
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def median_and_iqr(values: Sequence[float]) -> tuple[float, float]:
    """Median and interquartile range (0 for fewer than two values).

    >>> median_and_iqr([1.0, 2.0, 3.0, 4.0, 100.0])
    (3.0, 2.0)
    """
    if not values:
        raise ValueError("median_and_iqr needs at least one value.")
    if len(values) < 2:
        return float(values[0]), 0.0
    quartiles = statistics.quantiles(values, n=4, method="inclusive")
    return statistics.median(values), quartiles[2] - quartiles[0]


def selective_tradeoff(
    plain: tuple[float, float], full: tuple[float, float], selective: tuple[float, float]
) -> dict[str, float | None]:
    """How much of full checkpointing's saving a selective policy keeps, and of its extra time it
    pays.

    Each argument is ``(peak_bytes, step_s)``. ``saving_kept`` is
    ``(plain - selective) / (plain - full)`` for memory, ``extra_time_paid`` the
    same for time with the signs of an overhead.

    >>> selective_tradeoff(plain=(100, 1.0), full=(40, 1.5), selective=(70, 1.125))
    {'saving_kept': 0.5, 'extra_time_paid': 0.25}
    """
    (plain_bytes, plain_s), (full_bytes, full_s), (sel_bytes, sel_s) = plain, full, selective
    return {
        "saving_kept": ratio(plain_bytes - sel_bytes, plain_bytes - full_bytes),
        "extra_time_paid": ratio(sel_s - plain_s, full_s - plain_s),
    }


def paid_interval(
    times: dict[str, list[float]],
    selective: str,
    full: str,
    *,
    resamples: int = 2000,
    seed: int = 0,
) -> list[float] | None:
    """A 95% bootstrap interval for ``extra_time_paid``: the rounds resampled with replacement
    (a round's variants together, as they ran), the trade-off recomputed from the medians of
    the per-round time ratios each time. ``None`` with fewer than 5 rounds.

    The share divides two small overheads, so it is far noisier than either step time: the
    interval says how far one run's value can be trusted.

    >>> times = {"plain": [1.0, 1.1, 0.9, 1.0, 1.05], "full": [1.5, 1.6, 1.4, 1.5, 1.55],
    ...          "sel": [1.2, 1.3, 1.1, 1.2, 1.25]}
    >>> low, high = paid_interval(times, "sel", "full")
    >>> 0.3 < low <= high < 0.5
    True
    """
    rounds = len(times["plain"])
    if rounds < 5:
        return None
    ratios = {
        name: [a / b for a, b in zip(times[name], times["plain"])] for name in (selective, full)
    }
    generator = random.Random(seed)
    values = []
    for _ in range(resamples):
        picks = [generator.randrange(rounds) for _ in range(rounds)]
        full_extra = statistics.median([ratios[full][i] for i in picks]) - 1
        if full_extra > 0:
            values.append(
                (statistics.median([ratios[selective][i] for i in picks]) - 1) / full_extra
            )
    if len(values) < resamples // 2:
        return None  # full checkpointing did not even cost time in most resamples
    values.sort()
    return [values[int(0.025 * len(values))], values[int(0.975 * len(values)) - 1]]
