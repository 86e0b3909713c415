"""ScheduleExplorer without a browser: set n, the schedule and its parameter; read the result."""

from __future__ import annotations

import base64
import re
import struct

import numpy as np
import pytest

from ckptlib.schedules import Plan, Segment, revolve, sqrt_n
from ckptlib.widgets import ScheduleExplorer
from ckptlib.widgets.schedules import SCHEDULES, schedule_picture

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
RESULT_KEYS = {
    "plan",
    "n",
    "schedule",
    "parameter",
    "peak_bytes",
    "forward_calls",
    "theory_forward_calls",
    "forward_calls_per_layer",
    "theory_forward_calls_per_layer",
    "forward_steps",
    "peak_checkpoints",
    "theory_peak_activations",
    "theory_peak_bytes",
}


@pytest.fixture(scope="module")
def explorer():
    explorer = ScheduleExplorer(n=16)
    yield explorer
    explorer.close()


def test_revolve_20_layers_3_slots_calls_the_layers_as_often_as_theory_says(explorer):
    explorer.n.value = 20
    explorer.schedule.value = "revolve"
    explorer.parameter.value = 3
    result = explorer.result
    assert set(result) == RESULT_KEYS
    assert result["plan"] == "revolve(20, slots=3)"
    assert (
        result["forward_calls"]
        == result["theory_forward_calls"]
        == revolve(20, 3).forward_calls
        == 65
    )
    assert result["peak_checkpoints"] <= 3
    # Layer by layer too: the last layer runs once, the first layers are advanced over most.
    assert result["forward_calls_per_layer"] == result["theory_forward_calls_per_layer"]
    assert (
        result["forward_calls_per_layer"][-1] == 1 and len(result["forward_calls_per_layer"]) == 20
    )
    assert bytes(explorer.plot.value).startswith(PNG_SIGNATURE)


def test_sqrt_n_keeps_less_than_no_checkpointing(explorer):
    explorer.n.value = 16
    explorer.schedule.value = "none"
    none = dict(explorer.result)
    explorer.schedule.value = "sqrt(n)"
    sqrt = dict(explorer.result)
    assert sqrt["plan"] == "sqrt_n(16)" and none["plan"] == "none"
    assert sqrt["peak_bytes"] < none["peak_bytes"]
    assert none["forward_calls"] == 16 and sqrt["forward_calls"] == sqrt_n(16).forward_calls == 28
    assert sqrt["theory_peak_activations"] < none["theory_peak_activations"] == 16


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_every_schedule_measures_what_its_plan_predicts(explorer, schedule):
    explorer.n.value = 12
    explorer.schedule.value = schedule
    result = explorer.result
    assert result["schedule"] == schedule and result["n"] == 12
    assert result["forward_calls_per_layer"] == result["theory_forward_calls_per_layer"]
    assert explorer.parameter.disabled == (SCHEDULES[schedule] is None)
    assert (result["parameter"] is None) == (SCHEDULES[schedule] is None)


def test_the_parameter_slider_follows_the_schedule_and_n(explorer):
    explorer.n.value = 10
    explorer.schedule.value = "uniform"
    assert (explorer.parameter.description, explorer.parameter.min, explorer.parameter.max) == (
        "k segments",
        1,
        10,
    )
    explorer.parameter.value = 5
    assert explorer.result["plan"] == "uniform(10, 5)"
    explorer.n.value = 4  # k = 5 no longer fits: clamped to n
    assert explorer.parameter.value == 4 and explorer.result["plan"] == "uniform(4, 4)"
    explorer.schedule.value = "revolve"
    assert (explorer.parameter.description, explorer.parameter.max) == ("s slots", 3)
    explorer.schedule.value = "budget"
    assert (
        explorer.parameter.description,
        explorer.parameter.min,
        explorer.parameter.max,
        explorer.parameter.step,
    ) == ("budget %", 5, 100, 5)
    # A schedule without a parameter shows no leftover number beside the disabled slider.
    explorer.schedule.value = "sqrt(n)"
    assert explorer.parameter.disabled and not explorer.parameter.readout
    explorer.schedule.value = "revolve"
    assert not explorer.parameter.disabled and explorer.parameter.readout


def test_a_budget_the_least_plan_cannot_meet_is_a_message(explorer):
    explorer.n.value = 16
    explorer.schedule.value = "budget"
    explorer.parameter.value = 100
    assert explorer.result["forward_calls"] == 16 and explorer.message.value == ""
    fitting = dict(explorer.result)
    explorer.parameter.value = 5
    # In the widget's own terms (its "budget %" slider, KiB), and the old plan is cleared, not left
    # on screen under the new setting.
    assert (
        "No plan for 16 layers fits a budget of 5% = 25.60 KiB of the plain chain's 512.00 KiB"
        in explorer.message.value
    )
    assert (
        "Move the <b>budget %</b> slider to " in explorer.message.value
        and "memory_budget" not in explorer.message.value
    )
    assert explorer.result["plan"] is None and explorer.readout.value == ""
    assert (
        explorer.plots.layout.display == "none" and "image/png" not in explorer._repr_mimebundle_()
    )
    least = int(re.search(r"slider to (\d+)%", explorer.message.value)[1])
    explorer.parameter.value = least
    assert (
        explorer.message.value == ""
        and explorer.result["plan"]
        and explorer.plots.layout.display is None
    )
    explorer.parameter.value = least - 5
    assert explorer.result["plan"] is None
    explorer.parameter.value = 50
    assert explorer.message.value == "" and explorer.result["peak_bytes"] < fitting["peak_bytes"]


def test_measuring_freezes_the_controls_and_says_so(explorer):
    seen = []
    explorer.n.value = 16
    original = explorer.measure_plan

    def watching(plan):
        seen.append(
            (
                explorer.schedule.disabled,
                explorer.n.disabled,
                explorer.parameter.disabled,
                # A banner over the dimmed pictures says so; the message box above stays empty,
                # so nothing moves.
                "measuring" in explorer.busy.value.lower()
                and "ckptlib-running" in explorer.widget._dom_classes
                and explorer.message.value == "",
            )
        )
        return original(plan)

    explorer.measure_plan = watching
    try:
        explorer.n.value = 17
    finally:
        del explorer.measure_plan
    assert seen and all(state == (True, True, True, True) for state in seen)
    assert (
        not explorer.n.disabled and not explorer.schedule.disabled and explorer.message.value == ""
    )
    assert explorer.busy.value == "" and "ckptlib-running" not in explorer.widget._dom_classes
    # The curve of a new n says how far it has got.
    banners = []
    original_curve = explorer._curve_for

    def curve_watching(n):
        original_plan = explorer.measure_plan

        def plan_watching(plan):
            banners.append(explorer.busy.value)
            return original_plan(plan)

        explorer.measure_plan = plan_watching
        try:
            return original_curve(n)
        finally:
            del explorer.measure_plan

    explorer._curve_for = curve_watching
    try:
        explorer.n.value = 18
    finally:
        del explorer._curve_for
    progress = [re.search(r"n = 18: measuring the trade-off curve, plan (\d+) of (\d+)", b)
                for b in banners]
    assert progress and all(progress), banners
    assert int(progress[-1][1]) <= int(progress[-1][2])


def test_the_output_carries_a_picture_of_both_plots(explorer):
    bundle = explorer._repr_mimebundle_()
    png = base64.b64decode(bundle["image/png"])
    assert png.startswith(PNG_SIGNATURE)
    # Stacked, not side by side: no wider than the wider picture (drawn at twice its pixels),
    # so a page 1100 px wide shows its text at least at its size on screen.
    from ckptlib.widgets._schedule_pictures import PICTURE_PX, TRADEOFF_PX

    width, height = struct.unpack(">II", png[16:24])
    assert width == 2 * max(PICTURE_PX[0], TRADEOFF_PX[0]) <= 2 * 550
    assert height >= 2 * (PICTURE_PX[1] + TRADEOFF_PX[1]) - 4


def test_the_readout_says_what_each_peak_counts(explorer):
    text = explorer.readout.value
    assert "the whole step: activations, weights' gradients, tensors in flight" in text
    assert "activations only" in text and "can exceed the step's measured peak" in text


def test_the_trade_off_curve_holds_every_schedule_and_the_current_plan_sits_on_it(explorer):
    explorer.n.value = 16
    explorer.schedule.value = "recursive"
    schedules = {point["schedule"] for point in explorer.curve}
    assert schedules == set(SCHEDULES)
    point = next(p for p in explorer.curve if p["schedule"] == "recursive")
    assert (point["peak_bytes"], point["forward_calls"]) == (
        explorer.result["peak_bytes"],
        explorer.result["forward_calls"],
    )
    # More recomputation never needs more memory along the revolve family.
    revolves = sorted(
        (p["parameter"], p["forward_calls"], p["peak_bytes"])
        for p in explorer.curve
        if p["schedule"] == "revolve"
    )
    assert [calls for _, calls, _ in revolves] == sorted(
        (calls for _, calls, _ in revolves), reverse=True
    )
    assert [peak for _, _, peak in revolves] == sorted(peak for _, _, peak in revolves)


def test_the_picture_shows_every_layer_step_of_the_plan():
    plan = revolve(8, 2)
    picture = schedule_picture(plan)
    assert picture.shape == (8, plan.forward_calls + 8)
    assert (picture == 5).sum() == 8 and (
        picture == 4
    ).sum() == 8  # backward, record: once per layer
    assert (picture == 3).sum() == plan.forward_steps  # forwards keeping nothing
    assert (picture == 1).sum(axis=0).max() <= plan.peak_slots  # checkpoints held
    np.testing.assert_array_equal(
        schedule_picture(Plan([Segment(0, 2), 2])),
        [[3, 1, 1, 1, 4, 2, 2, 5], [0, 3, 0, 0, 0, 4, 5, 0], [0, 0, 4, 5, 0, 0, 0, 0]],
    )


@pytest.mark.slow
def test_a_parameter_change_at_64_layers_measures_one_step_and_redraws_nothing_else(monkeypatch):
    """What keeps the slider quick at n=64 (a third of a second here, most of it two PNGs): a
    new parameter measures one training step at most, its plan's (none where the plan is on
    the curve already); a parameter seen before measures nothing; the curve and the figures'
    frames are built once per n, never on a parameter change. Counted, not timed: a shared
    machine's clock says more about its neighbours."""
    import ckptlib.widgets.schedules as module
    from ckptlib.widgets._schedule_pictures import ExplorerPictures

    steps, frames = [], []
    measure, build = module.measure, ExplorerPictures._build_figure
    monkeypatch.setattr(module, "measure", lambda *a, **k: steps.append(1) or measure(*a, **k))
    monkeypatch.setattr(ExplorerPictures, "_build_figure",
                        lambda self, *a: frames.append(1) or build(self, *a))
    explorer = ScheduleExplorer(n=64, schedule="revolve")
    curve_steps = len(steps)
    assert curve_steps > 1 and len(frames) == 1  # the curve: every plan of it, measured once
    seen, measured = set(), []
    for slots in (2, 5, 3, 7, 2, 5, 3, 7):
        before = len(steps)
        explorer.parameter.value = slots
        measured.append(len(steps) - before)
        # at most one step (none where the plan is one of the curve's), none for a setting seen
        assert measured[-1] <= (0 if slots in seen else 1), (slots, measured)
        assert explorer.result["forward_calls"] == explorer.result["theory_forward_calls"]
        seen.add(slots)
    assert sum(measured) >= 1, measured  # a plan off the curve was measured, and counted
    assert len(frames) == 1, "a parameter change rebuilt the figures' frames"
    explorer.close()


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="schedule='fast' is not one of 'none', 'uniform'"):
        ScheduleExplorer(schedule="fast")
    with pytest.raises(ValueError, match="need integers 2 <= n <= max_n, got n=100, max_n=64"):
        ScheduleExplorer(n=100)


def test_display_gives_the_widget_view_and_a_stable_text(explorer):
    explorer.n.value, explorer.schedule.value = 16, "sqrt(n)"
    bundle = explorer._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["text/plain"] == "ScheduleExplorer(sqrt_n(16))"


def test_a_budget_of_100_percent_is_the_plain_chain(explorer):
    # A float budget made plan_for_budget round the layers' sizes up and miss the plain plan
    # (21 calls, a recomputation, at "100 % of what the plain chain keeps").
    explorer.n.value = 20
    explorer.schedule.value = "budget"
    explorer.parameter.value = 100
    assert explorer.result["forward_calls"] == explorer.result["theory_forward_calls"] == 20
    assert explorer.result["forward_steps"] == 0
    explorer.parameter.value = 50
    assert explorer.result["plan"] == "plan_for_budget(50% = 320.00 KiB)"
