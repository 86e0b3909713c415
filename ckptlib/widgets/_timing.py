"""Timing two settings so that noise cannot pass for a finding: interleaved runs, spreads,
"within noise".

A wall-clock time on a shared machine drifts: another process starts, the CPU clock changes.
Comparing a setting timed now with a reference timed a minute ago compares two moments, not
two settings, and can show checkpointing (which does *more* work) as faster. So the widgets
time every setting they compare in the same rounds, one run of each per round, in turns, and
report each median with its spread (lowest to highest run). When the spreads overlap, or a
setting that does more work comes out faster, the comparison says "within noise" instead of
pretending to a ratio.

>>> compare([0.010, 0.011, 0.012], [0.020, 0.021, 0.022])["within_noise"]
True
>>> result = compare([0.030, 0.031, 0.032], [0.020, 0.021, 0.022])
>>> round(result["ratio"], 3), result["within_noise"]
(1.476, False)
"""
from __future__ import annotations

import statistics
from typing import Callable, Sequence

__all__ = ["interleaved", "spread", "compare", "ratio_text", "times_text"]


def interleaved(
    runs: dict[str, Callable[[], float]], rounds: int, *, warm_up: bool = True
) -> dict[str, list[float]]:
    """Seconds of ``rounds`` runs of each setting, taken in turns (the order flips every round).

    ``runs`` maps a name to a function that runs the setting once and returns its seconds. With
    ``warm_up``, each setting runs once first, untimed (first runs allocate and fill caches).
    """
    names = list(runs)
    if warm_up:
        for name in names:
            runs[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_number in range(rounds):
        # Alternate the order, so that neither setting always runs right after the other.
        for name in (names if round_number % 2 == 0 else names[::-1]):
            times[name].append(runs[name]())
    return times


def spread(times: Sequence[float]) -> tuple[float, float]:
    """The lowest and the highest of the runs."""
    return min(times), max(times)


def compare(
    times: Sequence[float], reference: Sequence[float], *, does_more_work: bool = True
) -> dict:
    """``times`` against ``reference``: the ratio of the medians, and whether it is within noise.

    Within noise: the two spreads overlap, or (``does_more_work``: a setting that runs every op
    of the reference and more) the median came out below the reference's.
    """
    ratio = statistics.median(times) / statistics.median(reference)
    low, high = spread(times)
    reference_low, reference_high = spread(reference)
    overlap = low <= reference_high and reference_low <= high
    return {"ratio": ratio, "within_noise": overlap or (does_more_work and ratio < 1)}


def times_text(times: Sequence[float]) -> str:
    """``'80 ms (75-90 ms, 3 runs)'``: the median and the spread, in milliseconds."""
    low, high = spread(times)
    digits = 0 if statistics.median(times) >= 0.01 else 2
    return (f"{statistics.median(times) * 1e3:.{digits}f} ms "
            f"({low * 1e3:.{digits}f}-{high * 1e3:.{digits}f} ms, "
            f"{len(times)} runs)")


def ratio_text(times: Sequence[float], reference: Sequence[float], reference_name: str) -> str:
    """``'1.32x the time of off'``, or the same followed by why it is within noise.

    >>> text = ratio_text([0.010, 0.011, 0.012], [0.020, 0.021, 0.022], "off")
    >>> text == ("0.52x the time of off: within noise"
    ...          " (a setting that does more work cannot be faster; timing noise)")
    True
    >>> ratio_text([0.019, 0.021, 0.03], [0.020, 0.021, 0.022], "off")
    '1.00x the time of off: within noise (the spreads overlap)'
    """
    result = compare(times, reference)
    text = f"{result['ratio']:.2f}x the time of {reference_name}"
    if not result["within_noise"]:
        return text
    low, high = spread(times)
    reference_low, reference_high = spread(reference)
    if low <= reference_high and reference_low <= high:
        return text + ": within noise (the spreads overlap)"
    return text + ": within noise (a setting that does more work cannot be faster; timing noise)"
