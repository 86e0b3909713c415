"""A JupyterLab dashboard: toggle checkpointing, pick a schedule, watch memory op by op.

Design notes
============

What one step is. A *step* is one ``model.training_step(batch)`` (forward, loss,
backward) of a ckptlib demo model, run twice: once under a
:class:`~ckptlib.memory.MemoryMeter` for the peak and the per-op timeline, once
bare for the wall time (the CPU meter does Python work after every op, which
would otherwise inflate ``step_s`` by a factor of two or so). On CUDA the meter
reads the caching allocator, elsewhere it counts live tensors.

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
pyplot, redrawn after each step and shown as PNG bytes in an ``Image`` widget.
Pyplot never learns about it, so nothing needs closing and no figure can leak,
however often the dashboard redraws.

Bad settings. A batch of 0, or a step whose live memory crosses
``memory_limit_bytes`` (the meter checks after every op and stops the step at
the first op above it), or any ``RuntimeError``/``MemoryError`` from the step
(a CUDA out-of-memory, a ``CheckpointError``) ends the run with a message in the
widget instead of a traceback. On CPU the default limit, 256 MiB, plays the
part of a small accelerator: the largest plain settings do not fit, and the
same settings with checkpointing on do.
"""
from __future__ import annotations

import io
import math
import threading
import time
from typing import Any, Callable

import ipywidgets as widgets
import torch
from matplotlib.figure import Figure

from ckptlib.memory import MemoryMeter, TimelineEntry
from ckptlib.models import Checkpointing, TinyTransformer
from ckptlib.schedules import revolve

__all__ = ["MemoryDashboard"]

MiB = 2**20
OFF = "none"
PHASE_COLOURS = {"forward": "#4C72B0", "backward": "#DD8452", "recompute": "#55A868"}
CPU_MEMORY_LIMIT_BYTES = 256 * MiB
MAX_BARS = 6
# Revolve keeps at most this many block inputs, however deep the model: flat memory, more recomputation.
REVOLVE_SLOTS = 2


class _OverLimit(MemoryError):
    """Raised from the meter's per-op callback: the step crossed ``memory_limit_bytes``."""


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


class MemoryDashboard:
    """Toggle checkpointing on a small Transformer and watch what one training step holds.

    Args:
        model: a ckptlib demo model (``TinyTransformer`` or ``MLPChain``: it needs
            ``checkpointing``, ``example_batch`` and ``training_step``). Its depth is
            fixed, so the depth slider is disabled. Default: a ``TinyTransformer``
            that a laptop CPU runs in a fraction of a second, rebuilt when the
            depth slider moves.
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
    ``run_button``, ``readout`` and ``message`` (``Label``s) and ``plot`` (an ``Image``).

    >>> dashboard = MemoryDashboard(depth=2, batch=2)
    >>> dashboard.checkpointing.value = True          # picks the "per block" schedule
    >>> dashboard.schedule.value
    'per block'
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
            self.device = next(model.parameters()).device
            depth = max_depth = len(model.blocks)
        if memory_limit_bytes is None:
            memory_limit_bytes = CPU_MEMORY_LIMIT_BYTES if self.device.type == "cpu" else math.inf
        self.memory_limit_bytes = memory_limit_bytes
        self._model, self._own_model = model, model is None
        self.history: list[dict[str, Any]] = []
        self.timeline_data: list[TimelineEntry] = []
        self._last_schedule = "per block"
        self._run_lock = threading.Lock()

        self.checkpointing = widgets.ToggleButton(value=False, description="checkpointing", icon="recycle",
                                                  tooltip="Recompute activations in backward instead of keeping them")
        self.schedule = widgets.Dropdown(options=list(self._schedules), value=OFF, description="schedule")
        self.depth = widgets.IntSlider(value=depth, min=1, max=max_depth, description="depth",
                                       disabled=model is not None)
        # min=0 on purpose: a learner may slide to an empty batch, and is told why it cannot run.
        self.batch = widgets.IntSlider(value=batch, min=0, max=max_batch, description="batch")
        self.steps = widgets.IntSlider(value=steps, min=1, max=10, description="steps")
        self.run_button = widgets.Button(description="Run", button_style="primary", icon="play")
        self.readout = widgets.Label(value="Press Run to measure a training step.")
        self.message = widgets.Label(value="")
        self.plot = widgets.Image(format="png")
        for name, widget in (("checkpointing", self.checkpointing), ("run", self.run_button),
                             ("readout", self.readout), ("message", self.message), ("plot", self.plot)):
            widget.add_class(f"ckptlib-{name}")  # stable handles for the browser test
        self.checkpointing.observe(self._on_toggle, names="value")
        self.schedule.observe(self._on_schedule, names="value")
        self.run_button.on_click(lambda _button: self.run())
        self.widget = widgets.VBox([
            widgets.HBox([self.checkpointing, self.schedule, self.run_button]),
            widgets.HBox([self.depth, self.batch, self.steps]),
            self.readout, self.message, self.plot,
        ])
        self._figure = Figure(figsize=(10, 3.4), dpi=80)

    # -- display ------------------------------------------------------------
    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        # The widget view for JupyterLab; a short, stable text for everything else.
        bundle = self.widget._repr_mimebundle_(**kwargs)
        bundle["text/plain"] = f"MemoryDashboard({self._settings_label(self._settings())}, on {self.device.type})"
        return bundle

    def close(self) -> None:
        """Close every widget of the dashboard (their views go blank) and clear the figure."""
        def close_tree(widget: widgets.Widget) -> None:
            for child in getattr(widget, "children", ()):
                close_tree(child)
            widget.close()

        close_tree(self.widget)
        self._figure.clear()

    # -- controls -------------------------------------------------------------
    def _on_toggle(self, change: dict[str, Any]) -> None:
        # Keep the toggle and the dropdown saying the same thing; traitlets only
        # notify on a real change, so the two observers cannot ping-pong.
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

    def _say(self, text: str) -> None:
        self.message.value = text

    # -- running --------------------------------------------------------------
    def run(self, steps: int | None = None) -> list[dict[str, Any]]:
        """Run ``steps`` training steps (default: the steps slider) with the current settings.

        Returns the new ``history`` records, one dict per step with the settings
        (``checkpointing``, ``schedule``, ``depth``, ``batch``), ``peak_bytes``,
        ``step_s``, ``loss`` and ``device``. The plot and readout update after each
        step. A problem with the settings ends the run with a message in
        ``self.message`` (the records of the steps that did run are kept); so does
        a call while another run is in progress, which returns ``[]``.
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
        for _ in range(steps):
            try:
                record, timeline = self._step(model, batch, settings)
            except (RuntimeError, MemoryError) as error:
                self._say(self._explain(error, settings))
                break
            self.history.append(record)
            self.timeline_data = timeline
            records.append(record)
            self._show(record)
        return records

    def _model_for(self, depth: int) -> torch.nn.Module:
        if self._model is None or (self._own_model and len(self._model.blocks) != depth):
            self._model = None  # let the old model go before building the next one
            self._model = TinyTransformer(depth=depth).to(self.device)
        return self._model

    def _step(self, model: torch.nn.Module, batch: Any,
              settings: dict[str, Any]) -> tuple[dict[str, Any], list[TimelineEntry]]:
        limit = self.memory_limit_bytes

        def stop_above_limit(entry: TimelineEntry) -> None:
            if entry.live_bytes > limit:
                raise _OverLimit(f"{entry.live_bytes / MiB:.1f} MiB live after op #{entry.index} "
                                 f"({entry.op}, {entry.phase})")

        with MemoryMeter(self.device, on_op=stop_above_limit) as meter:
            loss = model.training_step(batch)
        report = meter.report()
        step_s = self._time_step(model, batch)
        record = {**settings, "peak_bytes": report.peak_bytes, "step_s": step_s, "loss": loss,
                  "device": self.device.type}
        return record, report.timeline

    def _time_step(self, model: torch.nn.Module, batch: Any) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        model.training_step(batch)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

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

    def _reference(self, record: dict[str, Any]) -> dict[str, Any] | None:
        """The latest step with checkpointing off at the same depth and batch."""
        for earlier in reversed(self.history):
            if not earlier["checkpointing"] and (earlier["depth"], earlier["batch"]) == (
                    record["depth"], record["batch"]):
                return earlier
        return None

    def _readout_text(self, record: dict[str, Any]) -> str:
        text = (f"step {len(self.history)} · {self._settings_label(record)}: "
                f"peak {record['peak_bytes'] / MiB:.2f} MiB, {record['step_s'] * 1000:.0f} ms")
        reference = self._reference(record)
        if record["checkpointing"] and reference is not None:
            saving = 1 - record["peak_bytes"] / reference["peak_bytes"]
            text += (f" | vs off: {reference['peak_bytes'] / MiB:.2f} MiB, {saving:.0%} less memory, "
                     f"{record['step_s'] / reference['step_s']:.2f}x the time")
        elif record["checkpointing"]:
            text += " | run once with checkpointing off to compare"
        return text

    def _show(self, record: dict[str, Any]) -> None:
        self.readout.value = self._readout_text(record)
        self._draw(record)
        buffer = io.BytesIO()
        self._figure.savefig(buffer, format="png")
        self.plot.value = buffer.getvalue()

    def _draw(self, record: dict[str, Any]) -> None:
        self._figure.clear()
        # Fixed margins: a layout engine would cost as much as the drawing itself.
        timeline_axes, peaks_axes = self._figure.subplots(
            1, 2, sharey=True, gridspec_kw=dict(width_ratios=(3, 2), left=0.07, right=0.99, bottom=0.25,
                                                top=0.9, wspace=0.05))
        index = [entry.index for entry in self.timeline_data]
        live_mib = [entry.live_bytes / MiB for entry in self.timeline_data]
        for phase, colour in PHASE_COLOURS.items():
            in_phase = [entry.phase == phase for entry in self.timeline_data]
            if any(in_phase):
                timeline_axes.fill_between(index, live_mib, where=in_phase, step="post", color=colour,
                                           linewidth=0, label=phase)
        timeline_axes.set(xlabel="op index in the step", ylabel="live memory (MiB)",
                          title=f"One step, {self._settings_label(record)}: peak "
                                f"{record['peak_bytes'] / MiB:.2f} MiB")
        timeline_axes.legend(loc="upper left", fontsize="small")
        # The settings run most recently, this one last, as bars on the timeline's MiB
        # axis: a drop in the timeline and a shorter bar are the same distance on screen.
        shown = list(self.peaks_data.items())[-MAX_BARS:]
        current = self._settings_label(record)
        peaks_axes.bar(range(len(shown)), [peak / MiB for _, peak in shown],
                       color=["#C44E52" if label == current else "#8C8C8C" for label, _ in shown])
        peaks_axes.set_xticks(range(len(shown)), [label.replace(", ", "\n") for label, _ in shown],
                              fontsize="x-small")
        peaks_axes.set(title="Peak per setting (red: this one)")
