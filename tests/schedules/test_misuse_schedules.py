"""Misuse of ckptlib.schedules: each bad argument is a TypeError or ValueError at the call, naming
it.

Before these checks: ``Plan(None)`` failed with "'NoneType' object is not iterable", a set was
taken in iteration order, a number as ``name`` was kept; ``Segment(True, 2)`` was a segment of
layer 1 and a segment whose body missed a layer was only refused later, by the Plan holding
it; a wrong type of size was a ValueError; bools and infinities passed as layer costs;
``plan_for_budget(costs, nan)`` failed deep inside with "cannot convert float NaN to integer";
``plot(ax="a")`` failed with an AttributeError. A NumPy integer budget was refused.
"""
from __future__ import annotations

import matplotlib
import numpy as np
import pytest

from ckptlib.schedules import (
    LayerCost,
    Plan,
    Segment,
    plan_for_budget,
    recursive,
    revolve,
    sqrt_n,
    uniform,
)
from tests._misuse import Misuse, assert_refused, rows

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PLAN = Plan([Segment(0, 2), 2])
COSTS = [LayerCost(input_bytes=100, saved_bytes=200, forward_s=1.0)] * 6

TABLE = [
    Misuse(
        "Plan(None)",
        lambda: Plan(None),
        TypeError,
        ("Plan: body must be a list or tuple of steps", "Plan([Segment(0, 2), 2])", "got None"),
    ),
    Misuse("Plan(3)", lambda: Plan(3), TypeError, ("body must be a list or tuple", "got 3 (int)")),
    Misuse(
        "Plan('012')",
        lambda: Plan("012"),
        TypeError,
        ("body must be a list or tuple", "'012' (str)"),
    ),
    Misuse(
        "Plan({0, 1})", lambda: Plan({0, 1}), TypeError, ("body must be a list or tuple", "(set)")
    ),
    Misuse(
        "Plan(name=3)",
        lambda: Plan([0, 1], name=3),
        TypeError,
        ("Plan: name must be a string", "got 3"),
    ),
    Misuse(
        "Segment(True, 2)",
        lambda: Segment(True, 2),
        TypeError,
        ("Segment(True, 2): start must be an integer", "True (bool)"),
    ),
    Misuse(
        "Segment(0.0, 2)",
        lambda: Segment(0.0, 2),
        TypeError,
        ("start must be an integer", "0.0 (float)"),
    ),
    Misuse(
        "Segment(0, '2')",
        lambda: Segment(0, "2"),
        TypeError,
        ("stop must be an integer", "'2' (str)"),
    ),
    Misuse(
        "Segment(body=3)",
        lambda: Segment(0, 2, body=3),
        TypeError,
        ("Segment(0, 2): body must be a list or tuple of steps", "got 3 (int)"),
    ),
    Misuse("Segment(body=None)", lambda: Segment(0, 2, body=None), TypeError, ("body", "got None")),
    Misuse(
        "Segment(body missing a layer)",
        lambda: Segment(0, 3, body=(0, 1)),
        ValueError,
        ("Segment(0, 3): steps cover layers 0..1", "ends at layer 2"),
    ),
    Misuse(
        "uniform(4.0, 2)",
        lambda: uniform(4.0, 2),
        TypeError,
        ("uniform: n (the number of layers) must be an integer >= 1", "4.0 (float)"),
    ),
    Misuse(
        "uniform(4, True)",
        lambda: uniform(4, True),
        TypeError,
        ("uniform: k (the number of segments)", "True (bool)"),
    ),
    Misuse("sqrt_n('16')", lambda: sqrt_n("16"), TypeError, ("sqrt_n: n", "'16' (str)")),
    Misuse("recursive(None)", lambda: recursive(None), TypeError, ("recursive: n", "got None")),
    Misuse(
        "revolve(8, 2.0)",
        lambda: revolve(8, 2.0),
        TypeError,
        ("revolve: slots (checkpoints, x0 included) must be an integer", "2.0 (float)"),
    ),
    Misuse(
        "peak_bytes(bool size)",
        lambda: PLAN.peak_bytes([(True, 1, 1.0)] * 3),
        TypeError,
        ("layer_costs[0]", "input_bytes must be a finite number >= 0", "True (bool)"),
    ),
    Misuse(
        "peak_bytes(infinite size)",
        lambda: PLAN.peak_bytes([(float("inf"), 1, 1.0)] * 3),
        ValueError,
        ("input_bytes must be a finite number", "got inf"),
    ),
    Misuse(
        "forward_s(infinite time)",
        lambda: PLAN.forward_s([(1, 1, float("inf"))] * 3),
        ValueError,
        ("layer_costs[0]", "forward_s must be a finite number", "got inf"),
    ),
    Misuse(
        "plot(ax='a')",
        lambda: PLAN.plot(ax="a"),
        TypeError,
        ("Plan.plot: ax must be a matplotlib Axes", "'a' (str)"),
    ),
    Misuse(
        "plan_for_budget(nan)",
        lambda: plan_for_budget(COSTS, float("nan")),
        ValueError,
        ("plan_for_budget: memory_budget must be a finite number of bytes >= 0", "got nan"),
    ),
    Misuse(
        "plan_for_budget(inf)",
        lambda: plan_for_budget(COSTS, float("inf")),
        ValueError,
        ("memory_budget must be a finite number of bytes", "got inf"),
    ),
    Misuse(
        "plan_for_budget('1000')",
        lambda: plan_for_budget(COSTS, "1000"),
        TypeError,
        ("memory_budget", "'1000' (str)"),
    ),
    Misuse(
        "plan_for_budget(True)",
        lambda: plan_for_budget(COSTS, True),
        TypeError,
        ("memory_budget", "True (bool)"),
    ),
]


@pytest.mark.parametrize("row", rows(TABLE))
def test_misuse_is_refused_at_the_call(row):
    figures = plt.get_fignums()
    assert_refused(row)
    assert plt.get_fignums() == figures, "a refused call left a figure open"


def test_numpy_numbers_are_numbers():
    """Sizes from NumPy (a measured array, np.int64) are what they look like: before, the budget
    and the costs were refused as "not a number"."""
    plan = plan_for_budget(
        [LayerCost(np.int64(100), np.int64(200), np.float64(1.0))] * 6, np.int64(700)
    )
    assert plan.body == plan_for_budget(COSTS, 700).body
    assert Segment(np.int64(0), np.int64(2)) == Segment(0, 2)
    assert uniform(np.int64(8), np.int64(2)).body == uniform(8, 2).body
