"""A JupyterLab dashboard: toggle checkpointing, pick a schedule, watch memory op by op.

Design notes
============

What one step is. A *step* is one ``model.training_step(batch)`` (forward, loss,
backward) of a ckptlib demo model. It runs once under a
:class:`~ckptlib.memory.MemoryMeter` for the peak and the per-op timeline, then bare
for the wall time (the CPU meter does Python work after every op, which would inflate the
time by a factor of two or so). On CUDA the meter reads the caching allocator, elsewhere it
counts live tensors.

Timing that noise cannot fake. A time measured now against one measured a minute ago
compares two moments of a shared machine, not two settings: that is how checkpointing, which
does more work, once read "0.24x the time". So with checkpointing on, each step times the
current setting *and* checkpointing off in the same click, in turns (see
:mod:`ckptlib.widgets._timing`), :data:`TIMED_STEPS` runs each after a warm-up, and the
readout gives both medians with their spreads. When the spreads overlap, or checkpointing
comes out faster, it says "within noise" instead of a bare ratio. The bare step is timed by
``dashboard.timer(model, batch) -> seconds``; a test replaces it with a clock it controls.

Phases. The meter colours the ops of a ckptlib checkpoint's rerun as "recompute";
``torch.utils.checkpoint`` has no public flag for its rerun, so the dashboard looks at
the saved-tensor hooks in force: while torch reruns a region its own recomputation hook
is on top (a torch internal; where a torch version moves it, the rerun stays in the
backward colour and the legend says why).

A model of the learner's own. Its ``checkpointing`` switch may not implement every schedule
of the menu. A value the switch refuses (it raises) is marked in the menu at construction; a
value it accepts but ignores shows on the first run: a checkpointing schedule whose step
recomputes nothing ran as plain, and would read "0% less memory". Such a step is not
recorded: the widget says so, and the menu marks the schedule "not in <model>".

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
pyplot, drawn at twice its on-screen size (sharp on any screen, text at least 11 px),
redrawn after each step and shown as PNG bytes in an ``Image`` widget; before the first
run it shows what will appear there. The plot sits above the readout and the message, so
text that appears or wraps below it never moves it.

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
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from ckptlib import palette
from ckptlib._arguments import integer, number
from ckptlib.memory import MemoryMeter, TimelineEntry
from ckptlib.models import Checkpointing, MLPChain, TinyTransformer
from ckptlib.schedules import Plan, revolve
from ckptlib.widgets._timing import interleaved, ratio_text, times_text
from ckptlib.widgets._view import WidgetView, png_bytes

__all__ = ["MemoryDashboard"]

MiB = 2**20
OFF = "none"
CPU_MEMORY_LIMIT_BYTES = 256 * MiB
TIMED_STEPS = 3
LIMIT_SHOWN = 2.5   # the memory limit is drawn when it is at most this many times the plot's top
# Revolve keeps at most this many block inputs, however deep the model: flat memory, more recomputation.
REVOLVE_SLOTS = 2
REVOLVE = f"Revolve ({REVOLVE_SLOTS} slots)"
# The plot: its size on screen (CSS pixels at 80 per inch) and the scale it is drawn at.
FIGURE_INCHES, SCREEN_DPI, DRAW_SCALE = (8.2, 3.4), 80, 2   # 656 px: fits 1100 px with the side panel open
FIGURE_PX = round(FIGURE_INCHES[0] * SCREEN_DPI)             # its width on screen, in CSS pixels
FONT_PT = 10        # 10 pt at 80 px per inch: 11 px on screen
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


class _RanAsPlain(Exception):
    """A checkpointing schedule's step recomputed nothing: the model does not implement it."""


def _schedules() -> dict[str, Callable[[int], Checkpointing]]:
    """Schedule label -> the model's ``checkpointing`` value for ``depth`` blocks."""
    return {
        OFF: lambda depth: "none",
        "per block": lambda depth: "block",
        "per block (torch)": lambda depth: "torch",
        "sqrt(n)": lambda depth: "sqrt",
        REVOLVE: lambda depth: revolve(depth, REVOLVE_SLOTS),
        "selective (save matmuls)": lambda depth: "selective",
    }


def _recomputes(value: Checkpointing, depth: int) -> bool:
    """Does a ckptlib demo model, run with ``value``, recompute anything in backward?

    A plan for a single block keeps everything (nothing to recompute), so "nothing was
    recomputed" only tells that a model ignored the value when the demo models would not.
    """
    if isinstance(value, Plan):
        return value.forward_steps > 0
    if value == "sqrt":
        return depth > 1
    return value != "none"


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


def _checked_limit(memory_limit_bytes: Any) -> float | None:
    """``memory_limit_bytes`` when it is ``None``, ``math.inf`` (no limit) or a number of bytes >= 1."""
    if isinstance(memory_limit_bytes, float) and memory_limit_bytes == math.inf:
        return memory_limit_bytes
    if memory_limit_bytes is None:
        return None
    return number(memory_limit_bytes, "memory_limit_bytes", least=1, unit="number of bytes",
                  note="or None for the default, math.inf for no limit", where="MemoryDashboard")


def _time_one_step(model: torch.nn.Module, batch: Any) -> float:
    """Seconds of one bare ``model.training_step(batch)`` (on CUDA, until the device is done)."""
    cuda = next(model.parameters()).device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    model.training_step(batch)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


class MemoryDashboard(WidgetView):
    """Toggle checkpointing on a small Transformer and watch what one training step holds.

    Args:
        model: a model with ``blocks``, a ``checkpointing`` switch, ``example_batch`` and
            ``training_step`` (see :data:`MODEL_NEEDS`; ckptlib's ``TinyTransformer`` and
            ``MLPChain`` have them; anything else is a ``TypeError`` here, saying what is
            missing). Its depth is fixed, so the depth slider is disabled; the schedules its
            switch does not implement are marked in the menu and refused. Default: a
            ``TinyTransformer`` that a laptop CPU runs in a fraction of a second,
            rebuilt when the depth slider moves.
        device: where the default model lives (default: CUDA if available, else
            CPU); ignored when ``model`` is given (its parameters say where).
        depth, batch, steps: initial slider values (integers: ``1 <= depth <= max_depth``,
            ``0 <= batch <= max_batch``, ``steps >= 1``; anything else is an error, not a clamp).
        max_depth, max_batch: slider ranges.
        memory_limit_bytes: a step whose live memory crosses it is stopped with a
            message (default: 256 MiB on CPU, none on CUDA where the real limit
            raises an out-of-memory error that is reported the same way).

    ``display(dashboard)`` shows the controls, the plot, the readout and the message. The
    same things are attributes for code and tests: ``checkpointing`` (a ``ToggleButton``
    that names the schedule it turns on), ``schedule`` (a ``Dropdown``), ``depth``,
    ``batch``, ``steps`` (sliders), ``run_button``, ``readout`` (an ``HTML`` that wraps; its
    text is ``readout_text``), ``message`` (an ``HTML``: a styled box, its text is
    ``message_text``) and ``plot`` (an ``Image``). What ran is in ``history`` (steps that
    fit: settings, ``peak_bytes``, ``step_s`` the median time, ``step_s_range`` its lowest
    and highest, ``step_times_s`` every timed run, ``off_times_s`` the runs of checkpointing
    off timed in turns with them (``None`` when off was not timed), ``loss``, ``device``) and
    ``failures`` (steps that did not fit: settings, ``stopped_bytes``, ``limit_bytes``,
    ``op``, ``timeline``). ``unsupported`` maps a schedule the model does not implement to why.

    >>> dashboard = MemoryDashboard(depth=2, batch=2)
    >>> dashboard.checkpointing.value = True          # picks the "per block" schedule
    >>> dashboard.schedule.value, dashboard.checkpointing.description
    ('per block', 'checkpointing: ON · per block')
    >>> [record["schedule"] for record in dashboard.run(steps=1)]
    ['per block']
    >>> sorted({entry.phase for entry in dashboard.timeline_data})
    ['backward', 'forward', 'recompute']
    >>> dashboard.readout_text.startswith("step 1 · per block, depth 2, batch 2: peak ")
    True
    """

    def __init__(self, model: torch.nn.Module | None = None, device: torch.device | str | None = None, *,
                 depth: int = 4, batch: int = 8, steps: int = 2, max_depth: int = 16, max_batch: int = 32,
                 memory_limit_bytes: float | None = None) -> None:
        where = "MemoryDashboard"
        max_depth = integer(max_depth, "max_depth", least=1, where=where)
        max_batch = integer(max_batch, "max_batch", least=1, where=where)
        depth = integer(depth, "depth", least=1, where=where)
        batch = integer(batch, "batch", least=0, where=where)
        steps = integer(steps, "steps", least=1, where=where)
        memory_limit_bytes = _checked_limit(memory_limit_bytes)
        self._schedules = _schedules()
        if model is None:
            if depth > max_depth:
                raise ValueError(f"{where}: depth must be at most max_depth={max_depth}, got {depth}; "
                                 f"raise max_depth or lower depth.")
            self.device = torch.device(device if device is not None else
                                       "cuda" if torch.cuda.is_available() else "cpu")
        else:
            check_model(model)
            self.device = next(model.parameters()).device
            depth = max_depth = len(model.blocks)
        if batch > max_batch:
            raise ValueError(f"{where}: batch must be at most max_batch={max_batch}, got {batch}; "
                             "raise max_batch or lower batch.")
        if memory_limit_bytes is None:
            memory_limit_bytes = CPU_MEMORY_LIMIT_BYTES if self.device.type == "cpu" else math.inf
        self.memory_limit_bytes = memory_limit_bytes
        self._model, self._own_model = model, model is None
        self.history: list[dict[str, Any]] = []
        self.failures: list[dict[str, Any]] = []
        self._outcomes: list[dict[str, Any]] = []   # history and failures, in the order they happened
        self.timeline_data: list[TimelineEntry] = []
        self.unsupported: dict[str, str] = {} if model is None else self._refused_by(model)
        self.timer: Callable[[torch.nn.Module, Any], float] = _time_one_step
        self._last_schedule = "per block"
        self._message_text = self._readout_text = ""
        self._syncing = False   # the toggle and the menu are being set together: observers stand by
        self._run_lock = threading.Lock()

        self.checkpointing = widgets.ToggleButton(
            value=False, tooltip="Recompute activations in backward instead of keeping them",
            layout=widgets.Layout(width="auto", min_width="210px"))
        self.schedule = widgets.Dropdown(options=self._menu(), value=OFF, description="schedule",
                                         layout=widgets.Layout(width="auto"))
        self.depth = widgets.IntSlider(value=depth, min=1, max=max_depth, description="depth",
                                       disabled=model is not None)
        # min=0 on purpose: a learner may slide to an empty batch, and is told why it cannot run.
        self.batch = widgets.IntSlider(value=batch, min=0, max=max_batch, description="batch")
        self.steps = widgets.IntSlider(value=steps, min=1, max=max(10, steps), description="steps")
        self.run_button = widgets.Button(description="Run", button_style="primary", icon="play")
        # Two lines' room for the readout: a longer one wraps below the plot and moves nothing.
        self.readout = widgets.HTML(layout=widgets.Layout(min_height="44px"))
        self.message = widgets.HTML(value="")
        self.plot = widgets.Image(format="png", layout=widgets.Layout(width=f"{FIGURE_PX}px", max_width="100%",
                                                                       height="auto"))
        for name, widget in (("checkpointing", self.checkpointing), ("run", self.run_button),
                             ("readout", self.readout), ("message", self.message), ("plot", self.plot)):
            widget.add_class(f"ckptlib-{name}")  # stable handles for the browser test
        self._style_toggle(False)
        self.checkpointing.observe(self._on_toggle, names="value")
        self.schedule.observe(self._on_schedule, names="value")
        self.run_button.on_click(lambda _button: self.run())
        controls = dict(flex_flow="row wrap", align_items="center")
        self.widget = widgets.VBox([
            widgets.HBox([self.checkpointing, self.schedule, self.run_button], layout=widgets.Layout(**controls)),
            widgets.HBox([self.depth, self.batch, self.steps], layout=widgets.Layout(**controls)),
            self.plot, self.readout, self.message,
        ], layout=widgets.Layout(max_width="100%"))
        self.widget.add_class("ckptlib-dashboard")
        self._figure = Figure(figsize=FIGURE_INCHES, dpi=SCREEN_DPI * DRAW_SCALE)
        self._say_readout("Press Run to measure a training step.")
        self._draw_placeholder()

    def _text(self) -> str:
        return f"MemoryDashboard({self._settings_label(self._settings())}, on {self.device.type})"

    def close(self) -> None:
        """Close every widget of the dashboard (their views go blank) and clear the figure."""
        super().close()
        self._figure.clear()

    # -- what a model of the learner's own can run ----------------------------------
    def _refused_by(self, model: torch.nn.Module) -> dict[str, str]:
        """The schedules whose value ``model.checkpointing`` refuses, each with the error it raised."""
        if isinstance(model, (TinyTransformer, MLPChain)):
            return {}
        refused, original = {}, model.checkpointing
        for label, value_for in self._schedules.items():
            try:
                model.checkpointing = value_for(len(model.blocks))
            except (TypeError, ValueError) as error:
                refused[label] = f"its checkpointing switch refuses it ({type(error).__name__}: {error})"
        model.checkpointing = original
        return refused

    def _menu(self) -> list[tuple[str, str]]:
        owner = type(self._model).__name__
        return [(f"{label} (not in {owner})" if label in self.unsupported else label, label)
                for label in self._schedules]

    def _mark_unsupported(self, schedule: str, why: str) -> None:
        self.unsupported[schedule] = why
        value, self._syncing = self.schedule.value, True
        try:
            self.schedule.options = self._menu()   # resets the value: put it back, observers standing by
            self.schedule.value = value
        finally:
            self._syncing = False

    # -- controls -------------------------------------------------------------
    def _style_toggle(self, on: bool) -> None:
        # On and off must read differently at a glance: words, icon and colour all change; and
        # "on" names the schedule it runs, so a schedule picked earlier never comes back unseen.
        self.checkpointing.description = (f"checkpointing: ON · {self.schedule.value}" if on
                                          else "checkpointing: OFF")
        self.checkpointing.icon = "check" if on else "times"
        self.checkpointing.button_style = "success" if on else ""

    def _on_toggle(self, change: dict[str, Any]) -> None:
        # Keep the toggle and the dropdown saying the same thing; traitlets only
        # notify on a real change, so the two observers cannot ping-pong.
        if self._syncing:
            return
        self.schedule.value = self._last_schedule if change["new"] else OFF
        self._style_toggle(change["new"])

    def _on_schedule(self, change: dict[str, Any]) -> None:
        if self._syncing:
            return
        if change["new"] != OFF:
            self._last_schedule = change["new"]
        self.checkpointing.value = change["new"] != OFF
        self._style_toggle(change["new"] != OFF)

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

    @property
    def readout_text(self) -> str:
        """What ``readout`` says, as plain text."""
        return self._readout_text

    def _say(self, text: str) -> None:
        self._message_text = text
        self.message.value = "" if not text else (
            "<div style='white-space:normal; max-width:780px; padding:6px 10px; line-height:1.35; "
            f"border-left:4px solid {palette.LIMIT}; background:#FDECEA; color:#611A15'>{html.escape(text)}</div>")

    def _say_readout(self, text: str) -> None:
        self._readout_text = text
        self.readout.value = (f"<div style='white-space:normal; overflow-wrap:anywhere; line-height:1.35; "
                              f"max-width:{FIGURE_PX}px'>{html.escape(text)}</div>")

    # -- running --------------------------------------------------------------
    def run(self, steps: int | None = None) -> list[dict[str, Any]]:
        """Run ``steps`` training steps (default: the steps slider) with the current settings.

        Returns the new ``history`` records, one dict per step (see the class docstring).
        The plot and readout update after each step. A problem with the settings ends the
        run with a message in ``self.message`` (the records of the steps that did run are
        kept; a step over the memory limit goes to ``failures``); so does a call while
        another run is in progress, which returns ``[]``.
        """
        steps = self.steps.value if steps is None else integer(steps, "steps", least=1,
                                                                 where="MemoryDashboard.run")
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
        if settings["schedule"] in self.unsupported:
            self._say(self._not_implemented(settings["schedule"]))
            return []
        self._say("")
        model = self._model_for(settings["depth"])
        batch = model.example_batch(batch=settings["batch"])
        # Off is timed beside the current setting when it is known to fit at this depth and batch.
        reference = self.bars_data(settings["depth"], settings["batch"]).get(OFF)
        time_off = settings["checkpointing"] and reference is not None and "peak_bytes" in reference
        records = []
        warm = False
        for _ in range(steps):
            try:
                record, timeline = self._step(model, batch, settings, warm, time_off)
            except _OverLimit as error:
                self._record_failure(error, settings)
                break
            except _RanAsPlain:
                self._say(self._not_implemented(settings["schedule"]))
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

    def _step(self, model: torch.nn.Module, batch: Any, settings: dict[str, Any], warm: bool,
              time_off: bool) -> tuple[dict[str, Any], list[TimelineEntry]]:
        limit = self.memory_limit_bytes
        timeline: list[TimelineEntry] = []
        watch_torch = settings["schedule"] == "per block (torch)"
        value = self._schedules[settings["schedule"]](settings["depth"])

        def on_op(entry: TimelineEntry) -> None:
            if watch_torch and entry.phase == "backward" and _torch_recomputing():
                entry = entry._replace(phase="recompute")
            timeline.append(entry)
            if entry.live_bytes > limit:
                raise _OverLimit(entry)

        model.checkpointing = value
        try:
            with MemoryMeter(self.device, on_op=on_op) as meter:
                loss = model.training_step(batch)
        except _OverLimit as error:
            error.timeline = timeline
            raise
        if self._ran_as_plain(value, settings, timeline):
            raise _RanAsPlain(settings["schedule"])
        report = meter.report()
        times = self._time(model, batch, value, time_off, warm)
        step_times = times["current"]
        record = {**settings, "peak_bytes": report.peak_bytes, "step_s": statistics.median(step_times),
                  "step_s_range": (min(step_times), max(step_times)), "step_times_s": step_times,
                  "off_times_s": times.get(OFF), "loss": loss, "device": self.device.type}
        return record, timeline

    def _time(self, model: torch.nn.Module, batch: Any, value: Checkpointing, time_off: bool,
              warm: bool) -> dict[str, list[float]]:
        """:data:`TIMED_STEPS` bare steps of the current setting and, with ``time_off``, as many of
        checkpointing off, in turns; after a warm-up of each unless this run had it."""
        def run_with(checkpointing: Checkpointing) -> Callable[[], float]:
            def timed() -> float:
                model.checkpointing = checkpointing
                return self.timer(model, batch)
            return timed

        runs = {"current": run_with(value)}
        if time_off:
            runs[OFF] = run_with("none")
        try:
            return interleaved(runs, TIMED_STEPS, warm_up=not warm)
        finally:
            model.checkpointing = value

    def _ran_as_plain(self, value: Checkpointing, settings: dict[str, Any], timeline: list[TimelineEntry]) -> bool:
        """A model of the learner's own that recomputed nothing where a demo model would have."""
        if self._own_model or isinstance(self._model, (TinyTransformer, MLPChain)):
            return False
        if settings["schedule"] == "per block (torch)" and _top_hooks is None:
            return False   # this torch hides its rerun: nothing to conclude
        if not _recomputes(value, settings["depth"]) or any(entry.phase == "recompute" for entry in timeline):
            return False
        self._mark_unsupported(settings["schedule"], "its step recomputed nothing in backward: the model's "
                                                     "checkpointing switch accepts the value but runs plain")
        return True

    def _not_implemented(self, schedule: str) -> str:
        runs = ", ".join(label for label in self._schedules if label not in self.unsupported and label != OFF)
        return (f"{type(self._model).__name__} does not implement the schedule {schedule!r}: "
                f"{self.unsupported[schedule]}. Its step would be plain autograd and read as \"0% less "
                f"memory\", so nothing was recorded. Pick a schedule it runs ({runs or 'none'}), or make its "
                "checkpointing switch implement this one (ckptlib.models.run_blocks shows how).")

    def _record_failure(self, error: _OverLimit, settings: dict[str, Any]) -> None:
        failure = {**settings, "stopped_bytes": error.entry.live_bytes, "limit_bytes": self.memory_limit_bytes,
                   "op": f"op #{error.entry.index} ({error.entry.op}, {error.entry.phase})",
                   "timeline": error.timeline}
        self.failures.append(failure)
        self._outcomes.append(failure)
        self.timeline_data = error.timeline
        self._say(self._explain(error, settings))
        self._say_readout(f"{self._settings_label(settings)}: did not fit, stopped at "
                          f"{failure['stopped_bytes'] / MiB:.2f} MiB, above the "
                          f"{self.memory_limit_bytes / MiB:.0f} MiB limit")
        self._draw(failure)
        self.plot.value = png_bytes(self._figure)

    def _advice(self, settings: dict[str, Any]) -> str:
        """What to change when a step does not fit: depends on what is already on."""
        if not settings["checkpointing"]:
            return "Turn checkpointing on, or lower the batch or the depth."
        fewest = REVOLVE if REVOLVE not in self.unsupported else None
        if settings["schedule"] == REVOLVE or fewest is None:
            return (f"Checkpointing is already on ({settings['schedule']}) and keeps the fewest block inputs "
                    "of the menu: lower the batch or the depth.")
        return (f"Checkpointing is already on ({settings['schedule']}): pick {fewest}, which keeps at most "
                f"{REVOLVE_SLOTS} block inputs and recomputes more, or lower the batch or the depth.")

    def _explain(self, error: BaseException, settings: dict[str, Any]) -> str:
        where = self._settings_label(settings)
        if isinstance(error, _OverLimit):
            return (f"Does not fit ({where}): {error}, above the {self.memory_limit_bytes / MiB:.0f} MiB "
                    f"limit. {self._advice(settings)}")
        if isinstance(error, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
            return f"Out of device memory ({where}). {self._advice(settings)}"
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

    def _readout_for(self, record: dict[str, Any]) -> str:
        text = (f"step {len(self.history)} · {self._settings_label(record)}: "
                f"peak {record['peak_bytes'] / MiB:.2f} MiB, {times_text(record['step_times_s'])}")
        reference = self._reference(record)
        if record["checkpointing"] and reference is not None and "peak_bytes" in reference:
            saving = 1 - record["peak_bytes"] / reference["peak_bytes"]
            text += f" | vs off: {reference['peak_bytes'] / MiB:.2f} MiB, {saving:.0%} less memory"
            if record["off_times_s"] is not None:
                text += (f", {ratio_text(record['step_times_s'], record['off_times_s'], 'off')} "
                         f"(off timed in turns with it: {times_text(record['off_times_s'])})")
        elif record["checkpointing"] and reference is not None:
            text += (f" | vs off: off did not fit (stopped at {reference['stopped_bytes'] / MiB:.2f} MiB, "
                     f"limit {reference['limit_bytes'] / MiB:.0f} MiB); this fits")
        elif record["checkpointing"]:
            text += " | run once with checkpointing off to compare"
        return text

    def _show(self, record: dict[str, Any]) -> None:
        self._say_readout(self._readout_for(record))
        self._draw(record)
        self.plot.value = png_bytes(self._figure)

    def _axes(self) -> tuple[Any, Any]:
        self._figure.clear()
        # Fixed rectangles: a layout engine would cost as much as the drawing itself. The bars
        # are horizontal so that their names, one per line, can never overlap; the left edge of
        # the bars leaves room for the longest schedule name at FONT_PT.
        return (self._figure.add_axes((0.085, 0.15, 0.42, 0.67)),
                self._figure.add_axes((0.76, 0.15, 0.215, 0.67)))

    @staticmethod
    def _style(axes: Any) -> None:
        axes.tick_params(labelsize=FONT_PT)
        axes.xaxis.label.set_fontsize(FONT_PT)
        axes.yaxis.label.set_fontsize(FONT_PT)
        axes.title.set_fontsize(FONT_PT + 1)
        for text in axes.texts:
            text.set_fontsize(FONT_PT)

    def _draw_placeholder(self) -> None:
        timeline_axes, peaks_axes = self._axes()
        timeline_axes.set(xlabel="op index in the step", ylabel="live memory (MiB)",
                          title="One training step, op by op")
        timeline_axes.text(0.5, 0.5, "Press Run: the live memory of one step appears here,\n"
                           "coloured by phase (forward, backward, recompute).", ha="center", va="center",
                           transform=timeline_axes.transAxes, color=palette.MUTED, family=palette.FONT_FAMILY)
        timeline_axes.set(xticks=[], yticks=[])
        peaks_axes.set(title="Peak per schedule", xlabel="peak (MiB)", xticks=[], yticks=[])
        peaks_axes.text(0.5, 0.5, "one bar\nper schedule", ha="center", va="center",
                        transform=peaks_axes.transAxes, color=palette.MUTED, family=palette.FONT_FAMILY)
        for axes in (timeline_axes, peaks_axes):
            self._style(axes)
        self.plot.value = png_bytes(self._figure)

    def _draw(self, outcome: dict[str, Any]) -> None:
        timeline_axes, peaks_axes = self._axes()
        fits = "peak_bytes" in outcome
        entries = self.timeline_data
        index = [entry.index for entry in entries]
        live_mib = [entry.live_bytes / MiB for entry in entries]
        for phase, colour in palette.PHASES.items():
            in_phase = [entry.phase == phase for entry in entries]
            if any(in_phase):
                timeline_axes.fill_between(index, live_mib, where=in_phase, step="post", color=colour,
                                           linewidth=0, label=phase)
        limit_mib = self.memory_limit_bytes / MiB
        top = max(live_mib, default=0)
        limit_off_chart = math.isfinite(limit_mib) and limit_mib > LIMIT_SHOWN * top
        limit_label = f"limit {limit_mib:.0f} MiB"
        if math.isfinite(limit_mib) and not limit_off_chart:
            timeline_axes.axhline(limit_mib, color=palette.LIMIT, linestyle="--", linewidth=1.5, label=limit_label)
            top = max(top, limit_mib)
        if not fits:
            timeline_axes.plot(index[-1:], live_mib[-1:], "x", color=palette.LIMIT, markersize=10, mew=2.5,
                               label="stopped: did not fit")
        timeline_axes.set_ylim(0, top * 1.5 or 1)   # headroom for the legend above the curve
        title = (f"peak {outcome['peak_bytes'] / MiB:.2f} MiB" if fits else
                 f"did not fit, stopped at op #{index[-1]}")
        timeline_axes.set(xlabel="op index in the step", ylabel="live memory (MiB)",
                          title=f"One step: {title}\n{self._settings_label(outcome)}")
        handles, labels = timeline_axes.get_legend_handles_labels()
        if limit_off_chart:
            # The limit is far above the curve: not drawn, but its legend entry keeps its colour sample.
            handles.append(Line2D([], [], color=palette.LIMIT, linestyle="--", linewidth=1.5,
                                  label=f"{limit_label} (off scale)"))
        if outcome["schedule"] == "per block (torch)" and _top_hooks is None:
            handles.append(Patch(color="none", label="torch's rerun: not told apart from backward"))
        timeline_axes.legend(handles=handles, loc="upper left", fontsize=FONT_PT, ncols=2, frameon=False,
                             handlelength=1.5, columnspacing=1.0, borderaxespad=0.3)
        self._draw_bars(peaks_axes, outcome)
        for axes in (timeline_axes, peaks_axes):
            self._style(axes)

    def _draw_bars(self, axes: Any, outcome: dict[str, Any]) -> None:
        bars = self.bars_data(outcome["depth"], outcome["batch"])
        names = list(bars)
        values = [(o["peak_bytes"] if "peak_bytes" in o else o["stopped_bytes"]) / MiB for o in bars.values()]
        colours = [palette.HIGHLIGHT if name == outcome["schedule"] else palette.MUTED for name in names]
        drawn = axes.barh(range(len(names)), values, color=colours, height=0.7)
        for bar, result in zip(drawn, bars.values()):
            if "peak_bytes" not in result:
                bar.set_hatch("///")
                bar.set_facecolor("white")
                bar.set_edgecolor(palette.HIGHLIGHT if result is outcome else palette.MUTED)
        limit_mib = self.memory_limit_bytes / MiB
        limit_drawn = math.isfinite(limit_mib) and limit_mib <= LIMIT_SHOWN * max(values, default=0)
        # The numbers stand in one column right of every bar and of the limit line, so that no
        # label ("did not fit" least of all) can sit on the line.
        column = max(values + ([limit_mib] if limit_drawn else []), default=1) * 1.07
        for row, (value, result) in enumerate(zip(values, bars.values())):
            axes.text(column, row, f"{value:.1f}" if "peak_bytes" in result else "did not fit",
                      va="center", ha="left", color=palette.LIMIT if "peak_bytes" not in result else "black")
        # Room right of the column for its widest entry: "did not fit" is longer than a number.
        axes.set_xlim(0, column * (1.95 if any("peak_bytes" not in o for o in bars.values()) else 1.45))
        if limit_drawn:
            axes.axvline(limit_mib, color=palette.LIMIT, linestyle="--", linewidth=1.5)
            axes.text(limit_mib, -0.8, "limit", color=palette.LIMIT, ha="center", va="center",
                      bbox=dict(facecolor="white", edgecolor="none", pad=0.5))
        axes.set_yticks(range(len(names)), names)
        axes.set_ylim(len(names) - 0.5, -1.15)   # top to bottom, in menu order, room for "limit" above
        axes.set(xlabel="peak (MiB)")
        axes.set_title(f"Peak per schedule\ndepth {outcome['depth']}, batch {outcome['batch']}")
