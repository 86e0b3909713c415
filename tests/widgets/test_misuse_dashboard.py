"""Misuse of MemoryDashboard: each bad argument is a TypeError or ValueError at the call, naming it.

Before these checks: ``run(steps="3")`` failed comparing str with int, ``run(steps=True)`` ran
one step; ``memory_limit_bytes="100"`` failed at the first op and ``-1`` or ``True`` stopped
every step at once; ``depth=2.5`` failed inside the slider, ``-1`` and ``40`` were quietly
clamped by it to 1 and 16, so the dashboard ran a model other than the one asked for.
"""
from __future__ import annotations

import math

import pytest

from ckptlib.widgets import MemoryDashboard
from tests._misuse import Misuse, assert_refused, rows

DASHBOARD = MemoryDashboard(depth=1, batch=1, device="cpu")

TABLE = [
    Misuse(
        "run(steps='3')",
        lambda: DASHBOARD.run(steps="3"),
        TypeError,
        ("MemoryDashboard.run: steps must be an integer >= 1", "'3' (str)"),
    ),
    Misuse(
        "run(steps=True)",
        lambda: DASHBOARD.run(steps=True),
        TypeError,
        ("steps must be an integer", "True (bool)"),
    ),
    Misuse(
        "run(steps=0)",
        lambda: DASHBOARD.run(steps=0),
        ValueError,
        ("steps must be an integer >= 1", "got 0"),
    ),
    Misuse(
        "memory_limit_bytes='100'",
        lambda: MemoryDashboard(memory_limit_bytes="100"),
        TypeError,
        (
            "MemoryDashboard: memory_limit_bytes must be a finite number of bytes >= 1",
            "'100' (str)",
            "math.inf for no limit",
        ),
    ),
    Misuse(
        "memory_limit_bytes=-1",
        lambda: MemoryDashboard(memory_limit_bytes=-1),
        ValueError,
        ("memory_limit_bytes must be a finite number of bytes >= 1", "got -1 (int)"),
    ),
    Misuse(
        "memory_limit_bytes=True",
        lambda: MemoryDashboard(memory_limit_bytes=True),
        TypeError,
        ("memory_limit_bytes", "True (bool)"),
    ),
    Misuse(
        "memory_limit_bytes=nan",
        lambda: MemoryDashboard(memory_limit_bytes=float("nan")),
        ValueError,
        ("memory_limit_bytes", "got nan"),
    ),
    Misuse(
        "depth=2.5",
        lambda: MemoryDashboard(depth=2.5),
        TypeError,
        ("MemoryDashboard: depth must be an integer >= 1", "2.5 (float)"),
    ),
    Misuse(
        "depth=-1",
        lambda: MemoryDashboard(depth=-1),
        ValueError,
        ("MemoryDashboard: depth must be an integer >= 1", "got -1 (int)"),
    ),
    Misuse(
        "depth=40",
        lambda: MemoryDashboard(depth=40),
        ValueError,
        ("MemoryDashboard: depth must be at most max_depth=16, got 40", "raise max_depth"),
    ),
    Misuse(
        "batch=-1",
        lambda: MemoryDashboard(batch=-1),
        ValueError,
        ("MemoryDashboard: batch must be an integer >= 0", "got -1"),
    ),
    Misuse(
        "batch=64",
        lambda: MemoryDashboard(batch=64),
        ValueError,
        ("batch must be at most max_batch=32, got 64",),
    ),
    Misuse(
        "steps=1.5",
        lambda: MemoryDashboard(steps=1.5),
        TypeError,
        ("steps must be an integer >= 1", "(float)"),
    ),
    Misuse(
        "max_depth='8'",
        lambda: MemoryDashboard(max_depth="8"),
        TypeError,
        ("max_depth must be an integer >= 1", "'8' (str)"),
    ),
]


@pytest.mark.parametrize("row", rows(TABLE))
def test_misuse_is_refused_at_the_call(row):
    assert_refused(row)
    assert DASHBOARD.history == [] and not DASHBOARD.run_button.disabled


def test_what_the_checks_accept_still_builds_and_runs():
    dashboard = MemoryDashboard(
        depth=16, batch=0, steps=20, memory_limit_bytes=math.inf, device="cpu"
    )
    assert (dashboard.depth.value, dashboard.batch.value, dashboard.steps.value) == (16, 0, 20)
    assert dashboard.memory_limit_bytes == math.inf
    dashboard.close()
