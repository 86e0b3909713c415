"""MemoryDashboard without a browser: set the controls' values, run, read history, labels and
plot data."""

from __future__ import annotations

import html
import random
import re
import statistics
import struct
import threading

import matplotlib.pyplot as plt
import pytest
import torch

from ckptlib import checkpoint
from ckptlib.models import MLPChain, TinyTransformer
from ckptlib.widgets import MemoryDashboard
from ckptlib.widgets.dashboard import TIMED_STEPS
from tests._models import hf_gpt2

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
RECORD_KEYS = {
    "checkpointing",
    "schedule",
    "depth",
    "batch",
    "peak_bytes",
    "step_s",
    "step_s_range",
    "step_times_s",
    "off_times_s",
    "loss",
    "device",
}


def schedules(dashboard) -> list[str]:
    """The schedules of the menu (its options are (label, schedule) pairs: a label may add a
    note)."""
    return [value for _label, value in dashboard.schedule.options]


@pytest.fixture
def dashboard():
    dashboard = MemoryDashboard(depth=4, batch=4, device="cpu")
    yield dashboard
    dashboard.close()


def test_toggle_and_schedule_say_the_same_thing(dashboard):
    assert dashboard.schedule.value == "none" and not dashboard.checkpointing.value
    assert {"none", "per block", "per block (torch)"} <= set(schedules(dashboard))
    dashboard.checkpointing.value = True
    assert dashboard.schedule.value == "per block"
    dashboard.schedule.value = "per block (torch)"
    dashboard.checkpointing.value = False
    assert dashboard.schedule.value == "none"
    dashboard.checkpointing.value = (
        True  # back on: the schedule chosen last time, named on the toggle
    )
    assert dashboard.schedule.value == "per block (torch)"
    assert dashboard.checkpointing.description == "checkpointing: ON · per block (torch)"
    dashboard.schedule.value = "sqrt(n)"
    assert dashboard.checkpointing.description == "checkpointing: ON · sqrt(n)"
    dashboard.schedule.value = "none"
    assert not dashboard.checkpointing.value


def test_run_records_each_step_and_checkpointing_lowers_the_peak(dashboard):
    off = dashboard.run(steps=2)
    dashboard.checkpointing.value = True
    on = dashboard.run(steps=1)
    assert dashboard.history == off + on and len(dashboard.history) == 3
    for record in dashboard.history:
        assert set(record) == RECORD_KEYS
        assert (record["depth"], record["batch"], record["device"]) == (4, 4, "cpu")
        assert record["step_s"] > 0 and record["peak_bytes"] > 0
        low, high = record["step_s_range"]  # the median of the timed runs, and their spread
        assert 0 < low <= record["step_s"] <= high
    assert [r["schedule"] for r in dashboard.history] == ["none", "none", "per block"]
    assert [r["checkpointing"] for r in dashboard.history] == [False, False, True]
    # The live-tensor meter is exact, so identical steps have identical peaks ...
    assert off[0]["peak_bytes"] == off[1]["peak_bytes"]
    # ... and all three settings compute the same loss.
    assert off[0]["loss"] == off[1]["loss"] == on[0]["loss"]
    assert on[0]["peak_bytes"] <= 0.7 * off[0]["peak_bytes"]


def test_readout_plot_and_plot_data_describe_the_latest_step(dashboard):
    dashboard.run(steps=1)
    off_peak = dashboard.history[-1]["peak_bytes"]
    assert dashboard.readout_text.startswith(
        f"step 1 · checkpointing off, depth 4, batch 4: peak {off_peak / 2**20:.2f} MiB, "
    )
    assert "vs off" not in dashboard.readout_text
    dashboard.checkpointing.value = True
    dashboard.run(steps=1)
    on_peak = dashboard.history[-1]["peak_bytes"]
    saving = 1 - on_peak / off_peak
    assert f"vs off: {off_peak / 2**20:.2f} MiB, {saving:.0%} less memory" in dashboard.readout_text

    timeline = dashboard.timeline_data
    assert [entry.index for entry in timeline] == list(range(len(timeline)))
    assert {entry.phase for entry in timeline} == {"forward", "backward", "recompute"}
    assert max(entry.live_bytes for entry in timeline) == on_peak
    assert dashboard.peaks_data == {
        "checkpointing off, depth 4, batch 4": off_peak,
        "per block, depth 4, batch 4": on_peak,
    }
    assert bytes(dashboard.plot.value).startswith(PNG_SIGNATURE)
    assert dashboard.message_text == ""


def test_peaks_data_lists_the_most_recently_run_setting_last(dashboard):
    dashboard.batch.value = 1
    dashboard.run(steps=1)
    dashboard.checkpointing.value = True
    dashboard.run(steps=1)
    dashboard.checkpointing.value = False
    dashboard.run(steps=1)
    assert list(dashboard.peaks_data) == [
        "per block, depth 4, batch 1",
        "checkpointing off, depth 4, batch 1",
    ]


def test_a_settings_change_without_an_off_run_asks_for_one(dashboard):
    dashboard.checkpointing.value = True
    dashboard.run(steps=1)
    assert dashboard.readout_text.endswith("run once with checkpointing off to compare")


def test_depth_slider_rebuilds_the_default_model(dashboard):
    dashboard.depth.value = 2
    dashboard.run(steps=1)
    dashboard.depth.value = 3
    dashboard.run(steps=1)
    assert [r["depth"] for r in dashboard.history] == [2, 3]
    assert len(dashboard._model.blocks) == 3
    assert dashboard.history[1]["peak_bytes"] > dashboard.history[0]["peak_bytes"]


def test_a_model_passed_in_keeps_its_depth():
    model = MLPChain(depth=3, width=32)
    dashboard = MemoryDashboard(model, batch=2)
    assert dashboard.depth.value == 3 and dashboard.depth.disabled
    assert dashboard.device.type == "cpu"
    [record] = dashboard.run(steps=1)
    assert record["depth"] == 3 and dashboard._model is model
    dashboard.close()


def test_batch_zero_is_a_message_not_a_traceback(dashboard):
    dashboard.batch.value = 0
    assert dashboard.run() == []
    assert dashboard.message_text.startswith("Batch is 0")
    assert dashboard.history == [] and not dashboard.run_button.disabled


def test_a_step_above_the_memory_limit_stops_with_a_message_and_checkpointing_fits(dashboard):
    dashboard.run(steps=1)
    off_peak = dashboard.history[-1]["peak_bytes"]
    dashboard.checkpointing.value = True
    dashboard.run(steps=1)
    on_peak = dashboard.history[-1]["peak_bytes"]
    dashboard.memory_limit_bytes = (off_peak + on_peak) // 2

    dashboard.checkpointing.value = False
    assert dashboard.run(steps=2) == []
    assert dashboard.message_text.startswith("Does not fit (checkpointing off, depth 4, batch 4)")
    assert "Turn checkpointing on" in dashboard.message_text
    assert len(dashboard.history) == 2 and not dashboard.run_button.disabled

    dashboard.checkpointing.value = True
    assert len(dashboard.run(steps=1)) == 1
    assert dashboard.message_text == ""


def test_a_runtime_error_in_the_step_is_reported_and_the_next_run_works():
    model = TinyTransformer(depth=2, d_model=32, heads=2, seq=16, vocab=50)
    dashboard = MemoryDashboard(model, batch=2)
    step = model.training_step

    def failing_step(batch=None):
        raise RuntimeError("CUDA error: device-side assert triggered\n(more lines)")

    model.training_step = failing_step
    assert dashboard.run(steps=3) == []
    assert dashboard.message_text == (
        "The step failed (checkpointing off, depth 2, batch 2): "
        "RuntimeError: CUDA error: device-side assert triggered"
    )
    assert not dashboard.run_button.disabled
    model.training_step = step
    assert len(dashboard.run(steps=1)) == 1
    dashboard.close()


def test_clicks_and_toggles_during_a_run_neither_nest_nor_change_it():
    model = TinyTransformer(depth=2, d_model=32, heads=2, seq=16, vocab=50)
    dashboard = MemoryDashboard(model, batch=2)
    step = model.training_step
    seen_during_run = []

    def step_that_clicks(batch=None):
        # What a learner does mid-run: click Run again and flip the toggle.
        seen_during_run.append((dashboard.run_button.disabled, dashboard.run()))
        dashboard.run_button.click()
        dashboard.checkpointing.value = not dashboard.checkpointing.value
        return step(batch)

    model.training_step = step_that_clicks
    records = dashboard.run(steps=2)
    model.training_step = step
    # Two steps, each metered and timed, after one warm-up: none of the calls started a run.
    calls = 2 + 1 + 2 * TIMED_STEPS
    assert seen_during_run == [(True, [])] * calls
    assert dashboard.message_text.startswith("A run is in progress")
    assert [r["schedule"] for r in records] == ["none", "none"]
    assert dashboard.history == records
    # The flips changed nothing in the run; the next run uses whatever the controls say then.
    assert dashboard.checkpointing.value == bool(calls % 2)
    dashboard.checkpointing.value = True
    assert [r["schedule"] for r in dashboard.run(steps=1)] == ["per block"]
    dashboard.close()


def test_a_run_from_another_thread_is_not_interleaved():
    model = TinyTransformer(depth=2, d_model=32, heads=2, seq=16, vocab=50)
    dashboard = MemoryDashboard(model, batch=2)
    step = model.training_step
    started, release = threading.Event(), threading.Event()

    def slow_step(batch=None):
        started.set()
        assert release.wait(timeout=30)
        return step(batch)

    model.training_step = slow_step
    worker = threading.Thread(target=dashboard.run, kwargs={"steps": 2})
    worker.start()
    assert started.wait(timeout=30)
    assert dashboard.run(steps=1) == []
    assert dashboard.run_button.disabled
    release.set()
    worker.join(timeout=60)
    assert not worker.is_alive()
    assert len(dashboard.history) == 2 and not dashboard.run_button.disabled
    dashboard.close()


def test_fifty_rapid_toggles_leak_no_figures_or_threads(dashboard):
    figures, threads = plt.get_fignums(), threading.active_count()
    for flip in range(50):
        dashboard.checkpointing.value = not dashboard.checkpointing.value
        if flip % 10 == 0:
            dashboard.batch.value = 1 + flip % 3
            dashboard.run(steps=1)
    assert len(dashboard.history) == 5
    assert dashboard.checkpointing.value is False and dashboard.schedule.value == "none"
    assert plt.get_fignums() == figures
    assert threading.active_count() == threads
    assert not dashboard.run_button.disabled


def test_run_rejects_a_step_count_below_one(dashboard):
    with pytest.raises(
        ValueError, match=r"MemoryDashboard.run: steps must be an integer >= 1, got 0"
    ):
        dashboard.run(steps=0)


def test_display_gives_the_widget_view_and_a_stable_text(dashboard):
    bundle = dashboard._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["text/plain"] == "MemoryDashboard(checkpointing off, depth 4, batch 4, on cpu)"


def test_close_closes_every_widget():
    dashboard = MemoryDashboard(depth=2, batch=2)
    dashboard.close()
    assert dashboard.widget.comm is None and dashboard.run_button.comm is None


def test_every_schedule_runs_and_selective_sits_between_off_and_per_block(dashboard):
    assert set(schedules(dashboard)) == {
        "none",
        "per block",
        "per block (torch)",
        "sqrt(n)",
        "Revolve (2 slots)",
        "selective (save matmuls)",
    }
    peaks = {}
    for schedule in schedules(dashboard):
        dashboard.schedule.value = schedule
        (record,) = dashboard.run(steps=1)
        assert record["schedule"] == schedule and dashboard.message_text == ""
        peaks[schedule] = record["peak_bytes"]
    assert peaks["per block"] < peaks["selective (save matmuls)"] < peaks["none"]
    assert peaks["per block"] == peaks["per block (torch)"]


def test_before_the_first_run_the_plot_is_a_picture_not_a_broken_image(dashboard):
    assert (
        bytes(dashboard.plot.value).startswith(PNG_SIGNATURE) and len(dashboard.plot.value) > 1000
    )
    assert dashboard.readout_text == "Press Run to measure a training step."


def test_on_and_off_read_differently(dashboard):
    off = (
        dashboard.checkpointing.description,
        dashboard.checkpointing.icon,
        dashboard.checkpointing.button_style,
    )
    dashboard.checkpointing.value = True
    on = (
        dashboard.checkpointing.description,
        dashboard.checkpointing.icon,
        dashboard.checkpointing.button_style,
    )
    assert off == ("checkpointing: OFF", "times", "") and on == (
        "checkpointing: ON · per block",
        "check",
        "success",
    )


def test_bars_hold_the_schedules_of_the_current_depth_and_batch_only(dashboard):
    dashboard.run(steps=1)
    dashboard.schedule.value = "sqrt(n)"
    dashboard.run(steps=1)
    assert list(dashboard.bars_data(4, 4)) == ["none", "sqrt(n)"]
    dashboard.batch.value = 2
    dashboard.run(steps=1)
    # A new batch starts a new group: one bar, and the old group is still there to go back to.
    assert list(dashboard.bars_data(4, 2)) == ["sqrt(n)"]
    assert list(dashboard.bars_data(4, 4)) == ["none", "sqrt(n)"]
    assert dashboard.bars_data(4, 2)["sqrt(n)"] is dashboard.history[-1]


def test_a_setting_that_did_not_fit_is_kept_with_its_partial_timeline_and_off_still_compares(
    dashboard,
):
    dashboard.run(steps=1)
    off_peak = dashboard.history[-1]["peak_bytes"]
    full_ops = len(dashboard.timeline_data)
    dashboard.checkpointing.value = True
    dashboard.run(steps=1)
    limit = (off_peak + dashboard.history[-1]["peak_bytes"]) // 2
    dashboard.memory_limit_bytes = limit
    dashboard.checkpointing.value = False
    assert dashboard.run(steps=1) == []
    [failure] = dashboard.failures
    assert failure["schedule"] == "none" and failure["limit_bytes"] == limit
    assert failure["stopped_bytes"] > failure["limit_bytes"] and failure["op"].startswith("op #")
    assert (
        0 < len(failure["timeline"]) < full_ops and dashboard.timeline_data == failure["timeline"]
    )
    assert failure["timeline"][-1].live_bytes == failure["stopped_bytes"]
    assert "did not fit" in dashboard.readout_text
    assert "<div" in dashboard.message.value and "white-space:normal" in dashboard.message.value
    assert dashboard.bars_data(4, 4)["none"] is failure
    # Per block fits; its readout compares with the off run that did not.
    dashboard.checkpointing.value = True
    [record] = dashboard.run(steps=1)
    assert record["peak_bytes"] < dashboard.memory_limit_bytes
    assert "| vs off: off did not fit (stopped at" in dashboard.readout_text
    assert bytes(dashboard.plot.value).startswith(PNG_SIGNATURE)


def test_torchs_rerun_is_coloured_as_recompute(dashboard):
    dashboard.schedule.value = "per block (torch)"
    dashboard.run(steps=1)
    torch_recompute = [entry.op for entry in dashboard.timeline_data if entry.phase == "recompute"]
    dashboard.schedule.value = "per block"
    dashboard.run(steps=1)
    ours = [entry.op for entry in dashboard.timeline_data if entry.phase == "recompute"]
    # The same blocks rerun; torch also detaches what it recomputes.
    assert [op for op in torch_recompute if op != "detach"] == [op for op in ours if op != "detach"]


def test_a_model_without_what_the_dashboard_needs_is_a_type_error_at_construction():
    with pytest.raises(
        TypeError, match=r"Linear has no blocks, checkpointing, example_batch, training_step"
    ):
        MemoryDashboard(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="needs an nn.Module, got str"):
        MemoryDashboard("gpt2")


class ScriptedTimer:
    """A stand-in for ``dashboard.timer``: the seconds each setting takes, drawn from lists we
    choose.

    Keyed by ``checkpointing != 'none'``; it still runs nothing, so a run with it takes no time.
    It notes the order of the calls, to show that off and on are timed in turns.
    """

    def __init__(self, off: list[float], on: list[float]) -> None:
        self.times = {False: list(off), True: list(on)}
        self.calls: list[bool] = []

    def __call__(self, model, batch) -> float:
        on = model.checkpointing != "none"
        self.calls.append(on)
        queue = self.times[on]
        return queue.pop(0) if len(queue) > 1 else queue[0]


RATIO = re.compile(r"(\d+\.\d\d)x the time of off(: within noise)?")


def test_off_is_timed_in_turns_with_the_checkpointed_setting_in_the_same_click(dashboard):
    dashboard.run(steps=1)
    dashboard.timer = timer = ScriptedTimer(off=[0.010], on=[0.020])
    dashboard.checkpointing.value = True
    [record] = dashboard.run(steps=1)
    # A warm-up of each, then TIMED_STEPS rounds, each running both; the order flips every round.
    assert timer.calls == [True, False] + [True, False, False, True, True, False][: 2 * TIMED_STEPS]
    assert (
        record["step_times_s"] == [0.020] * TIMED_STEPS
        and record["off_times_s"] == [0.010] * TIMED_STEPS
    )
    assert (
        "2.00x the time of off (off timed in turns with it: 10 ms (10-10 ms, 3 runs))"
        in dashboard.readout_text
    )
    assert "within noise" not in dashboard.readout_text


@pytest.mark.parametrize("seed", range(12))
def test_checkpointing_never_reads_faster_than_off_without_a_noise_note(dashboard, seed):
    """Whatever the clock says (here: random draws, often with checkpointing 'faster'), a ratio
    below 1.0x never stands alone, and overlapping spreads are called noise too."""
    generator = random.Random(seed)
    def draw():
        return [generator.uniform(0.005, 0.05) for _ in range(2 * TIMED_STEPS)]

    dashboard.batch.value = 1
    dashboard.run(steps=1)
    dashboard.timer = ScriptedTimer(off=draw(), on=draw())
    dashboard.schedule.value = generator.choice(
        ["per block", "sqrt(n)", "selective (save matmuls)"]
    )
    [record] = dashboard.run(steps=1)
    match = RATIO.search(dashboard.readout_text)
    assert match, dashboard.readout_text
    on, off = record["step_times_s"], record["off_times_s"]
    overlap = min(on) <= max(off) and min(off) <= max(on)
    assert float(match[1]) == pytest.approx(
        statistics.median(on) / statistics.median(off), abs=0.006
    )
    if statistics.median(on) < statistics.median(off) or overlap:
        assert match[2] == ": within noise", dashboard.readout_text
    else:
        assert match[2] is None and float(match[1]) >= 1.0


def test_advice_when_checkpointing_is_already_on_and_the_step_still_does_not_fit(dashboard):
    dashboard.checkpointing.value = True
    dashboard.run(steps=1)
    dashboard.memory_limit_bytes = dashboard.history[-1]["peak_bytes"] // 2
    assert dashboard.run(steps=1) == []
    assert "Turn checkpointing on" not in dashboard.message_text
    assert (
        "Checkpointing is already on (per block): pick Revolve (2 slots)" in dashboard.message_text
    )
    dashboard.schedule.value = "Revolve (2 slots)"
    dashboard.memory_limit_bytes = 2**16
    assert dashboard.run(steps=1) == []
    assert (
        "already on (Revolve (2 slots)) and keeps the fewest block inputs of the menu: lower the "
        "batch or the depth" in dashboard.message_text
    )


def test_the_readout_is_html_that_wraps_and_the_plot_is_drawn_at_twice_its_size(dashboard):
    dashboard.run(steps=1)
    assert "white-space:normal" in dashboard.readout.value
    assert html.escape(dashboard.readout_text) in dashboard.readout.value
    width, height = struct.unpack(">II", bytes(dashboard.plot.value)[16:24])  # the PNG's IHDR chunk
    shown_px = int(dashboard.plot.layout.width.removesuffix("px"))
    assert width == 2 * shown_px and dashboard.plot.layout.height == "auto"
    # The plot comes before the readout and the message: text that wraps or appears never moves it.
    plot_cell, readout, message = dashboard.widget.children[2:5]
    assert (readout, message) == (dashboard.readout, dashboard.message)
    # The banner of a run in progress lies over the plot, in its grid cell: it moves nothing.
    assert list(plot_cell.children) == [dashboard.plot, dashboard.busy]
    assert dashboard.busy.layout.grid_area == dashboard.plot.layout.grid_area
    assert dashboard.readout.layout.min_height == "60px"


def test_a_run_in_progress_says_where_it_is_over_the_dimmed_plot(dashboard):
    """What the view shows while a run lasts, seen from inside the run (its timer), and after."""
    dashboard.memory_limit_bytes = 1
    dashboard.run(steps=1)   # does not fit: a message that must stay until the next result
    old_message = dashboard.message_text
    assert old_message.startswith("Does not fit")
    dashboard.memory_limit_bytes = float("inf")
    seen, timer = [], dashboard.timer

    def watching(model, batch):
        assert f"<b>{html.escape(dashboard.busy_text)}</b>" in dashboard.busy.value
        seen.append((dashboard.busy_text, "ckptlib-running" in dashboard.widget._dom_classes,
                     dashboard.run_button.disabled, dashboard.message_text))
        return timer(model, batch)

    dashboard.timer = watching
    dashboard.run(steps=2)
    texts = {text for text, *_ in seen}
    assert texts == {
        f"Running checkpointing off, depth 4, batch 4: step {k} of 2: timing 3 runs…"
        for k in (1, 2)
    }
    assert all(dimmed and disabled for _, dimmed, disabled, _ in seen)
    # The last run's message stays while step 1 runs; the new result replaces it.
    assert seen[0][3] == old_message and seen[-1][3] == ""
    assert dashboard.message_text == ""
    assert dashboard.busy_text == "" and dashboard.busy.value == ""
    assert "ckptlib-running" not in dashboard.widget._dom_classes
    assert not dashboard.run_button.disabled


class OwnModel(torch.nn.Module):
    """A learner's model: the dashboard's interface, but its switch knows only some values."""

    def __init__(self, refuse_unknown: bool) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(
            *[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(3)]
        )
        self.refuse_unknown = refuse_unknown
        self._checkpointing = "none"

    @property
    def checkpointing(self):
        return self._checkpointing

    @checkpointing.setter
    def checkpointing(self, value):
        if self.refuse_unknown and value not in ("none", "block"):
            raise ValueError(f"OwnModel runs 'none' or 'block', not {value!r}")
        self._checkpointing = value

    def example_batch(self, batch: int = 2):
        return torch.ones(batch, 16), torch.zeros(batch, 16)

    def training_step(self, batch):
        x, target = batch
        for block in self.blocks:  # only "block" is implemented; anything else runs plain
            x = checkpoint(block, x) if self.checkpointing == "block" else block(x)
        loss = torch.nn.functional.mse_loss(x, target)
        loss.backward()
        return loss.item()


def test_a_schedule_the_models_switch_refuses_is_marked_and_refused():
    dashboard = MemoryDashboard(OwnModel(refuse_unknown=True), batch=2)
    assert set(dashboard.unsupported) == {
        "per block (torch)",
        "sqrt(n)",
        "Revolve (2 slots)",
        "selective (save matmuls)",
    }
    labels = dict((value, label) for label, value in dashboard.schedule.options)
    assert labels["sqrt(n)"] == "sqrt(n) (not in OwnModel)" and labels["per block"] == "per block"
    dashboard.schedule.value = "sqrt(n)"
    assert dashboard.run(steps=1) == [] and dashboard.history == []
    assert dashboard.message_text.startswith(
        "OwnModel does not implement the schedule 'sqrt(n)': its "
        "checkpointing switch refuses it (ValueError: OwnModel runs"
    )
    assert "Pick a schedule it runs (per block)" in dashboard.message_text
    dashboard.schedule.value = "per block"
    assert len(dashboard.run(steps=1)) == 1 and dashboard.message_text == ""
    dashboard.close()


def test_a_schedule_the_model_accepts_but_runs_plain_is_not_reported_as_zero_saving():
    dashboard = MemoryDashboard(OwnModel(refuse_unknown=False), batch=2)
    assert dashboard.unsupported == {}
    dashboard.run(steps=1)
    dashboard.schedule.value = "sqrt(n)"
    assert dashboard.run(steps=1) == []
    assert len(dashboard.history) == 1, (
        "a plain step recorded as sqrt(n) would read '0% less memory'"
    )
    assert "0% less memory" not in dashboard.readout_text
    assert dashboard.message_text.startswith(
        "OwnModel does not implement the schedule 'sqrt(n)': its step "
        "recomputed nothing in backward"
    )
    # The menu now says so, and the value stayed where the learner put it.
    assert ("sqrt(n) (not in OwnModel)", "sqrt(n)") in dashboard.schedule.options
    assert dashboard.schedule.value == "sqrt(n)" and dashboard.checkpointing.value
    dashboard.schedule.value = "per block"
    [record] = dashboard.run(steps=1)
    assert record["schedule"] == "per block" and "less memory" in dashboard.readout_text
    dashboard.close()


def gpt2(**sizes):
    with torch.random.fork_rng(devices=[]):  # the test's own draws stay as they were
        return hf_gpt2(n_layer=2, **sizes)


def own_forward_everywhere(model) -> bool:
    """No module of ``model`` carries an instance ``forward`` (what apply_checkpointing sets)."""
    return all("forward" not in vars(module) for module in model.modules())


def test_a_hugging_face_model_runs_through_apply_checkpointing_and_gets_its_forward_back():
    model = gpt2(n_positions=32)
    ids = torch.randint(128, (4, 32), generator=torch.Generator().manual_seed(0))
    dashboard = MemoryDashboard(model, batch={"input_ids": ids, "labels": ids})
    assert schedules(dashboard) == [
        "none",
        "every layer",
        "every 2nd layer",
        "selective (save matmuls)",
        "offload",
    ]
    assert (dashboard.depth.value, dashboard.depth.disabled) == (2, True)
    assert (dashboard.batch.value, dashboard.batch.disabled) == (4, True)
    dashboard.steps.value = 1
    [off] = dashboard.run()
    dashboard.checkpointing.value = True
    assert dashboard.schedule.value == "every layer"
    [on] = dashboard.run()
    assert on["peak_bytes"] < off["peak_bytes"], (on["peak_bytes"], off["peak_bytes"])
    assert "recompute" in {entry.phase for entry in dashboard.timeline_data}
    assert "less memory" in dashboard.readout_text and dashboard.message_text == ""
    assert own_forward_everywhere(model)
    dashboard.timer = lambda _model, _batch: 0.01  # the other variants: metered, not timed
    for variant in ("every 2nd layer", "selective (save matmuls)", "offload"):
        dashboard.schedule.value = variant
        [record] = dashboard.run()
        assert record["schedule"] == variant and dashboard.message_text == ""
        assert own_forward_everywhere(model)
    assert list(dashboard.bars_data(2, 4)) == schedules(dashboard)
    dashboard.close()
    assert own_forward_everywhere(model)


def test_a_hugging_face_model_takes_a_batch_callable_and_the_slider_picks_its_size():
    model = gpt2(n_positions=16)
    ids = torch.randint(128, (8, 16), generator=torch.Generator().manual_seed(1))
    dashboard = MemoryDashboard(model, batch=lambda n: (ids[:n],), steps=1)
    assert not dashboard.batch.disabled and dashboard.batch.value == 8
    dashboard.batch.value = 2
    dashboard.schedule.value = "every layer"
    [record] = dashboard.run()
    assert (record["batch"], record["depth"]) == (2, 2) and own_forward_everywhere(model)
    dashboard.close()


def test_a_model_of_any_kind_is_told_what_its_inputs_must_be():
    model = gpt2()
    with pytest.raises(TypeError, match="a callable batch= is called with the batch size n"):
        MemoryDashboard(model, batch=lambda: None)
    with pytest.raises(TypeError, match="batch= must be the model's inputs"):
        MemoryDashboard(model, batch=b"ids")
    with pytest.raises(TypeError, match="has no ModuleList or Sequential of repeated layers"):
        MemoryDashboard(torch.nn.Linear(2, 2), batch=torch.ones(1, 2))


def test_the_placeholder_text_stays_inside_its_axes_clear_of_the_axis_label():
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from ckptlib.widgets._dashboard_plot import draw_placeholder, new_figure

    figure = new_figure()
    draw_placeholder(figure)
    renderer = FigureCanvasAgg(figure).get_renderer()
    for axes in figure.axes:
        inside = axes.get_window_extent(renderer)
        for text in axes.texts:
            box = text.get_window_extent(renderer)
            assert inside.x0 < box.x0 and box.x1 < inside.x1, text.get_text()
