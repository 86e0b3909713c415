"""A JupyterLab dashboard: toggle checkpointing, pick a schedule, watch memory op by op.

Design notes
============

What one step is. A *step* is one ``model.training_step(batch)`` (forward, loss,
backward) of a ckptlib demo model. It runs once under a
:class:`~ckptlib.memory.MemoryMeter` for the peak and the per-op timeline, then bare
for the wall time: one warm-up run per Run click, then :data:`TIMED_STEPS` timed runs
per step, of which the record keeps the median and the range (the CPU meter does Python
work after every op, which would inflate the time by a factor of two or so). On CUDA
the meter reads the caching allocator, elsewhere it counts live tensors.

Phases. The meter colours the ops of a ckptlib checkpoint's rerun as "recompute";
``torch.utils.checkpoint`` has no public flag for its rerun, so the dashboard looks at
the saved-tensor hooks in force: while torch reruns a region its own recomputation hook
is on top (a torch internal; where a torch version moves it, the rerun stays in the
backward colour and the legend says why).

Where runs happen. In the thread that calls :meth:`MemoryDashboard.run`; for the
Run button that is the kernel's main thread, inside the click handler. The
kernel handles one message at a time, so a click or a toggle that arrives while
a run is in progress waits in the kernel's queue and is handled after it: runs
never interleave, and the button is disabled meanwhile so the browser shows it.
Settings are read once when a run starts, so a toggle applies to the next run.
A second ``run`` from another thread (or from inside a step) does not wait: it
finds the run lock taken, says so in the widget and returns ``[]``. No thread is
ever started here.

One figure. The plot is a single ``matplotlib.figure.Figure`` made without
pyplot, redrawn after each step and shown as PNG bytes in an ``Image`` widget;
before the first run it shows what will appear there.

Bad settings. A batch of 0, or a step whose live memory crosses
``memory_limit_bytes`` (the meter checks after every op and stops the step at
the first op above it), or any ``RuntimeError``/``MemoryError`` from the step
(a CUDA out-of-memory, a ``CheckpointError``) ends the run with a message in the
widget instead of a traceback. A step that did not fit is kept in ``failures``
with the part of its timeline that ran, and drawn as such: a hatched bar, the limit
as a line. On CPU the default limit, 256 MiB, plays the part of a small
accelerator: the largest plain settings do not fit, and the same settings with
checkpointing on do.
"""
from __future__ import annotations

import html
import math
import statistics
import threading
import time
from typing import Any, Callable

import ipywidgets as widgets
import torch
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from ckptlib.memory import MemoryMeter, TimelineEntry
from ckptlib.models import Checkpointing, TinyTransformer
from ckptlib.schedules import revolve
from ckptlib.widgets._view import HIGHLIGHT, MUTED, PHASE_COLOURS, WidgetView, png_bytes

__all__ = ["MemoryDashboard"]

MiB = 2**20
OFF = "none"
CPU_MEMORY_LIMIT_BYTES = 256 * MiB
TIMED_STEPS = 3
LIMIT_SHOWN = 2.5   # the memory limit is drawn when it is at most this many times the plot's top
# Revolve keeps at most this many block inputs, however deep the model: flat memory, more recomputation.
REVOLVE_SLOTS = 2
# What a model passed to the dashboard must have, and why.
MODEL_NEEDS = {
    "blocks": "its repeated layers, in order (an nn.Sequential or nn.ModuleList): the schedules "
              "checkpoint them, and their number is the depth",
    "checkpointing": "a settable switch taking 'none', 'block', 'torch', 'sqrt', 'selective' or a "
                     "ckptlib.schedules.Plan",
    "example_batch": "example_batch(batch=n): a batch of n examples on the model's device",
    "training_step": "training_step(batch): forward, loss and backward on that batch",
}


class _OverLimit(MemoryError):
    """Raised from the meter's per-op callback: the step crossed ``memory_limit_bytes``."""

    def __init__(self, entry: TimelineEntry) -> None:
        super().__init__(f"{entry.live_bytes / MiB:.2f} MiB live after op #{entry.index} "
                         f"({entry.op}, {entry.phase})")
        self.entry = entry
        self.timeline: list[TimelineEntry] = []


def _schedules() -> dict[str, Callable[[int], Checkpointing]]:
    """Schedule label -> the model's ``checkpointing`` value for ``depth`` blocks."""
    return {
        OFF: lambda depth: "none",
        "per block": lambda depth: "block",
        "per block (torch)": lambda depth: "torch",
        "sqrt(n)": lambda depth: "sqrt",
        f"Revolve ({REVOLVE_SLOTS} slots)": lambda depth: revolve(depth, REVOLVE_SLOTS),
        "selective (save matmuls)": lambda depth: "selective",
    }


_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _torch_recomputing() -> bool | None:
    """Is ``torch.utils.checkpoint`` rerunning a region now? ``None``: this torch does not say."""
    if _top_hooks is None:
        return None
    top = _top_hooks(False)
    pack = top[0] if top else None
    return (getattr(pack, "__module__", None) == "torch.utils.checkpoint"
            and getattr(pack, "__qualname__", "").startswith("_recomputation_hook"))


def check_model(model: Any) -> None:
    """Raise a ``TypeError`` naming what ``model`` lacks to be run by the dashboard (see :data:`MODEL_NEEDS`)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"MemoryDashboard(model=...) needs an nn.Module, got {type(model).__name__}.")
    missing = [name for name in MODEL_NEEDS if not hasattr(model, name)]
    if not missing and not hasattr(model.blocks, "__len__"):
        missing = ["blocks"]
    if missing:
        needs = "; ".join(f"{name}: {MODEL_NEEDS[name]}" for name in missing)
        raise TypeError(
            f"MemoryDashboard(model=...): {type(model).__name__} has no {', '.join(missing)}. The dashboard "
            f"needs {needs}. ckptlib's demo models (TinyTransformer, MLPChain) have all of these; give your "
            "model the same, or run it with ckptlib.measure instead.")
    if next(model.parameters(), None) is None:
        raise TypeError(f"MemoryDashboard(model=...): {type(model).__name__} has no parameters, so there is "
                        "no device to run on and no gradient to compute.")


class MemoryDashboard(WidgetView):
    """Toggle checkpointing on a small Transformer and watch what one training step holds.

    Args:
        model: a model with ``blocks``, a ``checkpointing`` switch, ``example_batch`` and
            ``training_step`` (see :data:`MODEL_NEEDS`; ckptlib's ``TinyTransformer`` and
            ``MLPChain`` have them; anything else is a ``TypeError`` here, saying what is
            missing). Its depth is fixed, so the depth slider is disabled. Default: a
            ``TinyTransformer`` that a laptop CPU runs in a fraction of a second,
            rebuilt when the depth slider moves.
        device: where the default model lives (default: CUDA if available, else
            CPU); ignored when ``model`` is given (its parameters say where).
        depth, batch, steps: initial slider values.
        max_depth, max_batch: slider ranges.
        memory_limit_bytes: a step whose live memory crosses it is stopped with a
            message (default: 256 MiB on CPU, none on CUDA where the real limit
            raises an out-of-memory error that is reported the same way).

    ``display(dashboard)`` shows the controls, the readout and the plot. The same
    things are attributes for code and tests: ``checkpointing`` (a ``ToggleButton``),
    ``schedule`` (a ``Dropdown``), ``depth``, ``batch``, ``steps`` (sliders),
    ``run_button``, ``readout`` (a ``Label``), ``message`` (an ``HTML``: a styled box,
    its text is ``message_text``) and ``plot`` (an ``Image``). What ran is in
    ``history`` (steps that fit: settings, ``peak_bytes``, ``step_s`` the median time,
    ``step_s_range`` its lowest and highest, ``loss``, ``device``) and ``failures`` (steps
    that did not fit: settings, ``stopped_bytes``, ``limit_bytes``, ``op``, ``timeline``).

    >>> dashboard = MemoryDashboard(depth=2, batch=2)
    >>> dashboard.checkpointing.value = True          # picks the "per block" schedule
    >>> dashboard.schedule.value, dashboard.checkpointing.description
    ('per block', 'checkpointing: ON')
    >>> [record["schedule"] for record in dashboard.run(steps=1)]
    ['per block']
    >>> sorted({entry.phase for entry in dashboard.timeline_data})
    ['backward', 'forward', 'recompute']
    >>> dashboard.readout.value.startswith("step 1 · per block, depth 2, batch 2: peak ")
    True
    """

    def __init__(self, model: torch.nn.Module | None = None, device: torch.device | str | None = None, *,
                 depth: int = 4, batch: int = 8, steps: int = 2, max_depth: int = 16, max_batch: int = 32,
                 memory_limit_bytes: float | None = None) -> None:
        self._schedules = _schedules()
        if model is None:
            self.device = torch.device(device if device is not None else
                                       "cuda" if torch.cuda.is_available() else "cpu")
        else:
            check_model(model)
            self.device = next(model.parameters()).device
            depth = max_depth = len(model.blocks)
        if memory_limit_bytes is None:
            memory_limit_bytes = CPU_MEMORY_LIMIT_BYTES if self.device.type == "cpu" else math.inf
        self.memory_limit_bytes = memory_limit_bytes
        self._model, self._own_model = model, model is None
        self.history: list[dict[str, Any]] = []
        self.failures: list[dict[str, Any]] = []
        self._outcomes: list[dict[str, Any]] = []   # history and failures, in the order they happened
        self.timeline_data: list[TimelineEntry] = []
        self._last_schedule = "per block"
        self._message_text = ""
        self._run_lock = threading.Lock()

        self.checkpointing = widgets.ToggleButton(value=False, tooltip="Recompute activations in backward "
                                                  "instead of keeping them", layout=widgets.Layout(width="190px"))
        self.schedule = widgets.Dropdown(options=list(self._schedules), value=OFF, description="schedule")
        self.depth = widgets.IntSlider(value=depth, min=1, max=max_depth, description="depth",
                                       disabled=model is not None)
        # min=0 on purpose: a learner may slide to an empty batch, and is told why it cannot run.
        self.batch = widgets.IntSlider(value=batch, min=0, max=max_batch, description="batch")
        self.steps = widgets.IntSlider(value=steps, min=1, max=10, description="steps")
        self.run_button = widgets.Button(description="Run", button_style="primary", icon="play")
        self.readout = widgets.Label(value="Press Run to measure a training step.")
        self.message = widgets.HTML(value="")
        self.plot = widgets.Image(format="png")
        for name, widget in (("checkpointing", self.checkpointing), ("run", self.run_button),
                             ("readout", self.readout), ("message", self.message), ("plot", self.plot)):
            widget.add_class(f"ckptlib-{name}")  # stable handles for the browser test
        self._style_toggle(False)
        self.checkpointing.observe(self._on_toggle, names="value")
        self.schedule.observe(self._on_schedule, names="value")
        self.run_button.on_click(lambda _button: self.run())
        self.widget = widgets.VBox([
            widgets.HBox([self.checkpointing, self.schedule, self.run_button]),
            widgets.HBox([self.depth, self.batch, self.steps]),
            self.readout, self.message, self.plot,
        ])
        self._figure = Figure(figsize=(10, 3.4), dpi=80)
        self._draw_placeholder()

    def _text(self) -> str:
        return f"MemoryDashboard({self._settings_label(self._settings())}, on {self.device.type})"

    def close(self) -> None:
        """Close every widget of the dashboard (their views go blank) and clear the figure."""
        super().close()
        self._figure.clear()

    # -- controls -------------------------------------------------------------
    def _style_toggle(self, on: bool) -> None:
        # On and off must read differently at a glance: words, icon and colour all change.
        self.checkpointing.description = f"checkpointing: {'ON' if on else 'OFF'}"
        self.checkpointing.icon = "check" if on else "times"
        self.checkpointing.button_style = "success" if on else ""

    def _on_toggle(self, change: dict[str, Any]) -> None:
        # Keep the toggle and the dropdown saying the same thing; traitlets only
        # notify on a real change, so the two observers cannot ping-pong.
        self._style_toggle(change["new"])
        self.schedule.value = self._last_schedule if change["new"] else OFF

    def _on_schedule(self, change: dict[str, Any]) -> None:
        if change["new"] != OFF:
            self._last_schedule = change["new"]
        self.checkpointing.value = change["new"] != OFF

    def _settings(self) -> dict[str, Any]:
        return {"checkpointing": self.schedule.value != OFF, "schedule": self.schedule.value,
                "depth": self.depth.value, "batch": self.batch.value}

    @staticmethod
    def _settings_label(settings: dict[str, Any]) -> str:
        schedule = "checkpointing off" if settings["schedule"] == OFF else settings["schedule"]
        return f"{schedule}, depth {settings['depth']}, batch {settings['batch']}"

    @property
    def message_text(self) -> str:
        """What ``message`` says, as plain text (``""`` when all is well)."""
        return self._message_text

    def _say(self, text: str) -> None:
        self._message_text = text
        self.message.value = "" if not text else (
            "<div style='white-space:normal; max-width:780px; padding:6px 10px; border-left:4px solid "
            f"{HIGHLIGHT}; background:#FDECEA; color:#611A15'>{html.escape(text)}</div>")

    # -- running --------------------------------------------------------------
    def run(self, steps: int | None = None) -> list[dict[str, Any]]:
        """Run ``steps`` training steps (default: the steps slider) with the current settings.

        Returns the new ``history`` records, one dict per step with the settings
        (``checkpointing``, ``schedule``, ``depth``, ``batch``), ``peak_bytes``,
        ``step_s`` (median of the timed runs), ``step_s_range`` (lowest, highest),
        ``loss`` and ``device``. The plot and readout update after each step. A
        problem with the settings ends the run with a message in ``self.message``
        (the records of the steps that did run are kept; a step over the memory
        limit goes to ``failures``); so does a call while another run is in
        progress, which returns ``[]``.
        """
        steps = self.steps.value if steps is None else steps
        if steps < 1:
            raise ValueError(f"run(steps={steps}): steps must be at least 1.")
        if not self._run_lock.acquire(blocking=False):
            self._say("A run is in progress; this request was ignored. Press Run again when it ends.")
            return []
        self.run_button.disabled = True
        try:
            return self._run_locked(steps)
        finally:
            self.run_button.disabled = False
            self._run_lock.release()

    def _run_locked(self, steps: int) -> list[dict[str, Any]]:
        settings = self._settings()
        if settings["batch"] < 1:
            self._say("Batch is 0: a training step needs at least one sequence. Move the batch slider up.")
            return []
        self._say("")
        model = self._model_for(settings["depth"])
        model.checkpointing = self._schedules[settings["schedule"]](settings["depth"])
        batch = model.example_batch(batch=settings["batch"])
        records = []
        warm = False
        for _ in range(steps):
            try:
                record, timeline = self._step(model, batch, settings, warm)
            except _OverLimit as error:
                self._record_failure(error, settings)
                break
            except (RuntimeError, MemoryError) as error:
                self._say(self._explain(error, settings))
                break
            warm = True
            self.history.append(record)
            self._outcomes.append(record)
            self.timeline_data = timeline
            records.append(record)
            self._show(record)
        return records

    def _model_for(self, depth: int) -> torch.nn.Module:
        if self._model is None or (self._own_model and len(self._model.blocks) != depth):
            self._model = None  # let the old model go before building the next one
            self._model = TinyTransformer(depth=depth).to(self.device)
        return self._model

    def _step(self, model: torch.nn.Module, batch: Any, settings: dict[str, Any],
              warm: bool) -> tuple[dict[str, Any], list[TimelineEntry]]:
        limit = self.memory_limit_bytes
        timeline: list[TimelineEntry] = []
        watch_torch = settings["schedule"] == "per block (torch)"

        def on_op(entry: TimelineEntry) -> None:
            if watch_torch and entry.phase == "backward" and _torch_recomputing():
                entry = entry._replace(phase="recompute")
            timeline.append(entry)
            if entry.live_bytes > limit:
                raise _OverLimit(entry)

        try:
            with MemoryMeter(self.device, on_op=on_op) as meter:
                loss = model.training_step(batch)
        except _OverLimit as error:
            error.timeline = timeline
            raise
        report = meter.report()
        times = self._time_step(model, batch, warm)
        record = {**settings, "peak_bytes": report.peak_bytes, "step_s": statistics.median(times),
                  "step_s_range": (min(times), max(times)), "loss": loss, "device": self.device.type}
        return record, timeline

    def _time_step(self, model: torch.nn.Module, batch: Any, warm: bool) -> list[float]:
        """Seconds of :data:`TIMED_STEPS` bare steps, after a warm-up one unless this run had it."""
        times = []
        for run in range(TIMED_STEPS + (0 if warm else 1)):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            start = time.perf_counter()
            model.training_step(batch)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            if warm or run > 0:
                times.append(time.perf_counter() - start)
        return times

    def _record_failure(self, error: _OverLimit, settings: dict[str, Any]) -> None:
        failure = {**settings, "stopped_bytes": error.entry.live_bytes, "limit_bytes": self.memory_limit_bytes,
                   "op": f"op #{error.entry.index} ({error.entry.op}, {error.entry.phase})",
                   "timeline": error.timeline}
        self.failures.append(failure)
        self._outcomes.append(failure)
        self.timeline_data = error.timeline
        self._say(self._explain(error, settings))
        self.readout.value = (f"{self._settings_label(settings)}: did not fit, stopped at "
                              f"{failure['stopped_bytes'] / MiB:.2f} MiB, above the "
                              f"{self.memory_limit_bytes / MiB:.0f} MiB limit")
        self._draw(failure)
        self.plot.value = png_bytes(self._figure)

    def _explain(self, error: BaseException, settings: dict[str, Any]) -> str:
        where = self._settings_label(settings)
        if isinstance(error, _OverLimit):
            return (f"Does not fit ({where}): {error}, above the {self.memory_limit_bytes / MiB:.0f} MiB "
                    "limit. Turn checkpointing on, or lower the batch or the depth.")
        if isinstance(error, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
            return (f"Out of device memory ({where}). Turn checkpointing on, or lower the batch or "
                    "the depth.")
        lines = str(error).strip().splitlines()
        return f"The step failed ({where}): {type(error).__name__}: {lines[0] if lines else ''}"

    # -- what the plot shows ------------------------------------------------------
    @property
    def peaks_data(self) -> dict[str, int]:
        """Settings label -> peak bytes of its latest step, the most recently run setting last."""
        peaks: dict[str, int] = {}
        for record in self.history:
            label = self._settings_label(record)
            peaks.pop(label, None)
            peaks[label] = record["peak_bytes"]
        return peaks

    def bars_data(self, depth: int, batch: int) -> dict[str, dict[str, Any]]:
        """Schedule -> its latest outcome at this depth and batch (a ``history`` record, or a
        ``failures`` entry for a step that did not fit), in the order of the schedule menu."""
        latest = {o["schedule"]: o for o in self._outcomes if (o["depth"], o["batch"]) == (depth, batch)}
        return {schedule: latest[schedule] for schedule in self._schedules if schedule in latest}

    def _reference(self, record: dict[str, Any]) -> dict[str, Any] | None:
        """The latest outcome with checkpointing off at the same depth and batch (it may not have fit)."""
        return self.bars_data(record["depth"], record["batch"]).get(OFF)

    def _readout_text(self, record: dict[str, Any]) -> str:
        low, high = record["step_s_range"]
        text = (f"step {len(self.history)} · {self._settings_label(record)}: "
                f"peak {record['peak_bytes'] / MiB:.2f} MiB, {record['step_s'] * 1000:.0f} ms "
                f"(median of {TIMED_STEPS}, {low * 1000:.0f}-{high * 1000:.0f})")
        reference = self._reference(record)
        if record["checkpointing"] and reference is not None and "peak_bytes" in reference:
            saving = 1 - record["peak_bytes"] / reference["peak_bytes"]
            text += (f" | vs off: {reference['peak_bytes'] / MiB:.2f} MiB, {saving:.0%} less memory, "
                     f"{record['step_s'] / reference['step_s']:.2f}x the time")
        elif record["checkpointing"] and reference is not None:
            text += (f" | vs off: off did not fit (stopped at {reference['stopped_bytes'] / MiB:.2f} MiB, "
                     f"limit {reference['limit_bytes'] / MiB:.0f} MiB); this fits")
        elif record["checkpointing"]:
            text += " | run once with checkpointing off to compare"
        return text

    def _show(self, record: dict[str, Any]) -> None:
        self.readout.value = self._readout_text(record)
        self._draw(record)
        self.plot.value = png_bytes(self._figure)

    def _axes(self) -> tuple[Any, Any]:
        self._figure.clear()
        # Fixed rectangles: a layout engine would cost as much as the drawing itself. The bars
        # are horizontal so that their names, one per line, can never overlap.
        return (self._figure.add_axes((0.065, 0.22, 0.52, 0.66)),
                self._figure.add_axes((0.78, 0.22, 0.2, 0.66)))

    def _draw_placeholder(self) -> None:
        timeline_axes, peaks_axes = self._axes()
        timeline_axes.set(xlabel="op index in the step", ylabel="live memory (MiB)",
                          title="One training step, op by op")
        timeline_axes.text(0.5, 0.5, "Press Run: the live memory of one step appears here,\n"
                           "coloured by phase (forward, backward, recompute).", ha="center", va="center",
                           transform=timeline_axes.transAxes, color=MUTED)
        timeline_axes.set(xticks=[], yticks=[])
        peaks_axes.set(title="Peak per schedule", xlabel="peak (MiB)", xticks=[], yticks=[])
        peaks_axes.text(0.5, 0.5, "one bar\nper schedule", ha="center", va="center",
                        transform=peaks_axes.transAxes, color=MUTED)
        self.plot.value = png_bytes(self._figure)

    def _draw(self, outcome: dict[str, Any]) -> None:
        timeline_axes, peaks_axes = self._axes()
        fits = "peak_bytes" in outcome
        entries = self.timeline_data
        index = [entry.index for entry in entries]
        live_mib = [entry.live_bytes / MiB for entry in entries]
        for phase, colour in PHASE_COLOURS.items():
            in_phase = [entry.phase == phase for entry in entries]
            if any(in_phase):
                timeline_axes.fill_between(index, live_mib, where=in_phase, step="post", color=colour,
                                           linewidth=0, label=phase)
        limit_mib = self.memory_limit_bytes / MiB
        top = max(live_mib, default=0)
        limit_off_chart = math.isfinite(limit_mib) and limit_mib > LIMIT_SHOWN * top
        if math.isfinite(limit_mib) and not limit_off_chart:
            timeline_axes.axhline(limit_mib, color=HIGHLIGHT, linestyle="--", linewidth=1.5,
                                  label=f"limit {limit_mib:.0f} MiB")
            top = max(top, limit_mib)
        if not fits:
            timeline_axes.plot(index[-1:], live_mib[-1:], "x", color=HIGHLIGHT, markersize=12, mew=3,
                               label="stopped: did not fit")
        timeline_axes.set_ylim(0, top * 1.12 or 1)
        title = (f"peak {outcome['peak_bytes'] / MiB:.2f} MiB" if fits else
                 f"did not fit, stopped at op #{index[-1]}")
        timeline_axes.set(xlabel="op index in the step", ylabel="live memory (MiB)",
                          title=f"One step, {self._settings_label(outcome)}: {title}")
        handles, labels = timeline_axes.get_legend_handles_labels()
        if limit_off_chart:
            handles.append(Patch(color="none", label=f"limit {limit_mib:.0f} MiB: far above"))
        if outcome["schedule"] == "per block (torch)" and _top_hooks is None:
            handles.append(Patch(color="none", label="torch's rerun: not told apart from backward"))
        timeline_axes.legend(handles=handles, loc="upper left", fontsize="x-small", ncols=2)
        self._draw_bars(peaks_axes, outcome)

    def _draw_bars(self, axes: Any, outcome: dict[str, Any]) -> None:
        bars = self.bars_data(outcome["depth"], outcome["batch"])
        names = list(bars)
        values = [(o["peak_bytes"] if "peak_bytes" in o else o["stopped_bytes"]) / MiB for o in bars.values()]
        colours = [HIGHLIGHT if name == outcome["schedule"] else MUTED for name in names]
        drawn = axes.barh(range(len(names)), values, color=colours)
        for bar, result in zip(drawn, bars.values()):
            if "peak_bytes" not in result:
                bar.set_hatch("///")
                bar.set_facecolor("white")
                bar.set_edgecolor(HIGHLIGHT if result is outcome else MUTED)
        axes.bar_label(drawn, labels=[f"{value:.1f}" if "peak_bytes" in o else "did not fit"
                                      for value, o in zip(values, bars.values())],
                       fontsize="x-small", padding=2, bbox=dict(facecolor="white", edgecolor="none", pad=0.5))
        axes.set_yticks(range(len(names)), names, fontsize="x-small")
        axes.invert_yaxis()
        limit_mib = self.memory_limit_bytes / MiB
        right = max(values, default=1) * 1.45
        if math.isfinite(limit_mib) and limit_mib <= LIMIT_SHOWN * max(values, default=0):
            axes.axvline(limit_mib, color=HIGHLIGHT, linestyle="--", linewidth=1.5)
            right = max(right, limit_mib * 1.45)
        axes.set_xlim(0, right)
        axes.set(xlabel="peak (MiB)")
        axes.set_title(f"Peak per schedule\ndepth {outcome['depth']}, batch {outcome['batch']}", fontsize="medium")
