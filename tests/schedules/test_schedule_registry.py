"""The schedule registry: one entry makes a schedule appear in the explorer, the dashboard and
the demo models' switch; none of the three keeps a table of its own."""

from __future__ import annotations

import pytest

import ckptlib.models
import ckptlib.widgets.schedules
from ckptlib.models import MLPChain
from ckptlib.schedules import Plan, Segment
from ckptlib.schedules.registry import (
    REGISTRY,
    Parameter,
    Schedule,
    register,
    registered,
    unregister,
)
from tests._grads import assert_bitwise_equal
from ckptlib.widgets import MemoryDashboard, ScheduleExplorer


def halves(n: int, _parameter: None) -> Plan:
    """Two checkpointed halves, the last layer recorded."""
    half = max(1, (n - 1) // 2)
    return Plan([Segment(0, half), Segment(half, n - 1), n - 1], name=f"halves({n})")


HALVES = Schedule("halves", "two halves", plan=halves, mode="halves", marker="X")


@pytest.fixture
def with_halves():
    register(HALVES)
    try:
        yield HALVES
    finally:
        unregister("halves")


def test_one_registry_entry_appears_in_the_explorer_the_dashboard_and_the_models(with_halves):
    # The demo models' switch.
    assert ckptlib.models.CHECKPOINTING_MODES[-1] == "halves"
    model = MLPChain(depth=5, width=8)
    batch = model.example_batch(batch=4)
    grads = {}
    for mode in ("none", "halves"):
        model.checkpointing = mode
        model.training_step(batch)
        grads[mode] = [p.grad.clone() for p in model.parameters()]
    assert_bitwise_equal(grads["halves"], grads["none"])

    # The explorer: in its menu, measured against its plan, on its trade-off curve.
    assert ckptlib.widgets.schedules.SCHEDULES["halves"] is None
    explorer = ScheduleExplorer(n=5, schedule="halves")
    assert "halves" in explorer.schedule.options
    assert explorer.result["plan"] == "halves(5)" and explorer.parameter.disabled
    assert (
        explorer.result["forward_calls"]
        == explorer.result["theory_forward_calls"]
        == halves(5, None).forward_calls
    )
    assert "halves" in {point["schedule"] for point in explorer.curve}
    explorer.close()

    # The dashboard: in its menu, run on the demo model as its mode.
    dashboard = MemoryDashboard(depth=5, batch=2, device="cpu", steps=1)
    assert [value for _, value in dashboard.schedule.options][-1] == "two halves"
    dashboard.schedule.value = "two halves"
    [record] = dashboard.run()
    assert record["schedule"] == "two halves" and dashboard.message_text == ""
    assert "recompute" in {entry.phase for entry in dashboard.timeline_data}
    dashboard.close()


def test_an_unregistered_schedule_is_gone_from_every_place():
    assert "halves" not in ckptlib.models.CHECKPOINTING_MODES
    assert "halves" not in ckptlib.widgets.schedules.SCHEDULES
    with pytest.raises(ValueError, match="checkpointing='halves' is not a valid choice"):
        MLPChain(depth=2, width=4, checkpointing="halves")
    assert "two halves" not in {schedule.label for schedule in registered("dashboard")}


def test_the_three_places_read_the_registry_in_its_order():
    assert [s.name for s in registered("explorer")] == list(ckptlib.widgets.schedules.SCHEDULES)
    assert tuple(s.mode for s in registered("models")) == ckptlib.models.CHECKPOINTING_MODES
    assert [s.label for s in registered("dashboard")] == [
        "none",
        "per block",
        "per block (torch)",
        "sqrt(n)",
        "Revolve (2 slots)",
        "selective (save matmuls)",
    ]


def test_a_taken_name_label_or_mode_and_an_unusable_entry_are_refused():
    with pytest.raises(ValueError, match="name='revolve' is taken"):
        register(Schedule("revolve", "another", plan=halves))
    with pytest.raises(ValueError, match="mode='sqrt' is taken by the schedule 'sqrt\\(n\\)'"):
        register(Schedule("sqrt2", "sqrt again", plan=halves, mode="sqrt"))
    with pytest.raises(ValueError, match="give plan="):
        Schedule("nothing", "nothing")
    with pytest.raises(ValueError, match="the explorer cannot show it"):
        Schedule("each", "each", run=lambda blocks, x: blocks(x), mode="each")
    with pytest.raises(KeyError, match="no schedule 'fast'"):
        unregister("fast")
    assert set(REGISTRY) == {
        "none",
        "block",
        "torch",
        "uniform",
        "sqrt(n)",
        "recursive",
        "revolve",
        "selective",
        "budget",
    }


def test_a_parameter_says_its_range_at_n_layers():
    assert REGISTRY["uniform"].parameter.bounds(10) == (1, 10, 1)
    assert REGISTRY["revolve"].parameter.bounds(4) == (1, 3, 1)
    assert REGISTRY["budget"].parameter == Parameter(
        "budget %", 50, low=5, high=REGISTRY["budget"].parameter.high, step=5
    )
    assert REGISTRY["revolve"].curve_parameters(3) == (1, 2)
