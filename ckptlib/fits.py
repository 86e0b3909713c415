"""Two least-squares fits of peak memory against chain length ``n``: a power law and a log.

A schedule's memory is judged by how it grows with ``n``: ``peak ~ c * n**p`` (the
exponent ``p`` from a straight line on log-log axes; sqrt(n) segments give ``p`` near
0.5) and ``peak ~ a + b * log2(n)`` (``b`` per doubling of n; the recursive plan).
Notebook 05 fits its measurements with these, and the benchmark (``make figures``)
draws its scaling figure from them.
"""
from __future__ import annotations

import math
import statistics
from typing import Sequence


def _least_squares(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """Slope, intercept and R^2 of the straight line through ``(xs, ys)``."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"a fit needs two or more (x, y) pairs of equal count, got {len(xs)} and "
                         f"{len(ys)}.")
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("a fit needs at least two different x values.")
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sxx
    intercept = mean_y - slope * mean_x
    total = sum((y - mean_y) ** 2 for y in ys)
    residual = sum((y - (intercept + slope * x)) ** 2 for x, y in zip(xs, ys))
    r2 = 1.0 - residual / total if total > 0 else 1.0
    return slope, intercept, r2


def fit_power_law(ns: Sequence[float], values: Sequence[float]) -> dict[str, float]:
    """Fit ``value = coefficient * n ** exponent`` by least squares on log-log axes.

    >>> fit = fit_power_law([16, 64, 256], [4 * n ** 0.5 for n in [16, 64, 256]])
    >>> round(fit["exponent"], 6), round(fit["coefficient"], 6), round(fit["r2"], 6)
    (0.5, 4.0, 1.0)
    """
    if min(ns) <= 0 or min(values) <= 0:
        raise ValueError("a power-law fit needs positive n and values (it takes logarithms).")
    slope, intercept, r2 = _least_squares([math.log(n) for n in ns], [math.log(v) for v in values])
    return {"exponent": slope, "coefficient": math.exp(intercept), "r2": r2}


def fit_log(ns: Sequence[float], values: Sequence[float]) -> dict[str, float]:
    """Fit ``value = intercept + per_doubling * log2(n)`` by least squares.

    ``per_doubling`` is what one doubling of n adds.

    >>> fit = fit_log([16, 32, 64, 128], [100 + 7 * math.log2(n) for n in [16, 32, 64, 128]])
    >>> round(fit["per_doubling"], 6), round(fit["intercept"], 6), round(fit["r2"], 6)
    (7.0, 100.0, 1.0)
    """
    if min(ns) <= 0:
        raise ValueError("a log fit needs positive n.")
    slope, intercept, r2 = _least_squares([math.log2(n) for n in ns], list(values))
    return {"per_doubling": slope, "intercept": intercept, "r2": r2}
