"""A JupyterLab dashboard: toggle checkpointing, pick a schedule, watch memory op by op.

Design notes
============

The pieces. What a step runs, and how it is measured and timed (one metered step, then
bare steps in turns with checkpointing off; torch's rerun told apart), is
:mod:`ckptlib.widgets._dashboard_models`: the demo models' menu from the schedule registry,
:class:`~ckptlib.widgets._dashboard_models.AppliedModel` for a model of any kind. The one
figure is :mod:`ckptlib.widgets._dashboard_plot`, the words of the readout and the
messages :mod:`ckptlib.widgets._dashboard_text`. This module is the widget: its controls,
its runs and what they recorded.

A model of any kind. A module without the demo interface (a Hugging Face model) is run
with the inputs given as ``batch=``: its menu is ``ckptlib.apply_checkpointing``'s variants
on its repeated layers (every layer, every 2nd, a selective policy, offload), applied for
the length of a run and removed after it, so the model leaves a run with its own ``forward``.

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

A run a learner cannot mistake for a finished one. A step takes from a second to half a
minute (depth 16, batch 32 on two cores), and the picture of the last step stays until
the next one is drawn. So while a run lasts, the plot is dimmed and a banner over it
says what is running and where the run is ("step 1 of 2: timing 3 runs, in turns with
off"); a widget update is sent as it is made, so the banner moves on during the run. The
banner lies over the plot, the readout and message boxes below keep their height: nothing
moves when a run starts or ends. The message of the last run stays until the next run's
own result replaces it.
Settings are read once when a run starts, so a toggle applies to the next run.
A second ``run`` from another thread (or from inside a step) does not wait: it
finds the run lock taken, says so in the widget and returns ``[]``. No thread is
ever started here.

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

import math
import statistics
import threading
from typing import Any, Callable

import ipywidgets as widgets
import torch

from ckptlib._arguments import integer, number
from ckptlib.memory import TimelineEntry
from ckptlib.models import Checkpointing, TinyTransformer
from ckptlib.schedules.registry import REGISTRY
from ckptlib.widgets._dashboard_models import MODEL_NEEDS as MODEL_NEEDS
from ckptlib.widgets._dashboard_models import TIMED_STEPS as TIMED_STEPS
from ckptlib.widgets._dashboard_models import (
    OFF, TOP_HOOKS, TORCH, AppliedModel, MiB, OverLimit, RanAsPlain, applied_schedules,
    check_model, demo_schedules, knows_its_schedules, measure_step, recomputes, time_one_step,
    time_steps)
from ckptlib.widgets._dashboard_plot import FIGURE_PX, draw, draw_placeholder, new_figure
from ckptlib.widgets._dashboard_text import (
    READOUT_HEIGHT, advice, did_not_fit, explanation, message_html, not_implemented, readout,
    readout_html, settings_label)
from ckptlib.widgets._view import BUSY_STYLE, WidgetView, over_each_other, png_bytes, show_busy

__all__ = ["MemoryDashboard"]

CPU_MEMORY_LIMIT_BYTES = 256 * MiB
# Revolve keeps at most this many block inputs, however deep the model: flat memory, more
# recomputation (the registry's Revolve, as the dashboard runs it).
REVOLVE_SLOTS = REGISTRY["revolve"].dashboard_parameter
REVOLVE = REGISTRY["revolve"].label


def _checked_limit(memory_limit_bytes: Any) -> float | None:
    """``memory_limit_bytes`` when it is ``None``, ``math.inf`` (no limit) or a number of
    bytes >= 1."""
    if isinstance(memory_limit_bytes, float) and memory_limit_bytes == math.inf:
        return memory_limit_bytes
    if memory_limit_bytes is None:
        return None
    return number(memory_limit_bytes, "memory_limit_bytes", least=1, unit="number of bytes",
                  note="or None for the default, math.inf for no limit", where="MemoryDashboard")


class MemoryDashboard(WidgetView):
    """Toggle checkpointing on a small Transformer, or a model of yours, and watch what one
    training step holds.

    Args:
        model: a model with ``blocks``, a ``checkpointing`` switch, ``example_batch`` and
            ``training_step`` (see :data:`MODEL_NEEDS`; ckptlib's ``TinyTransformer`` and
            ``MLPChain`` have them): the menu is the schedule registry's
            (``ckptlib.schedules.registry``), and the schedules its switch does not
            implement are marked in the menu and refused. Or any ``nn.Module`` with repeated
            layers (a Hugging Face model) together with its inputs as ``batch``: the menu is
            then ``ckptlib.apply_checkpointing``'s variants ("every layer", "every 2nd
            layer", "selective (save matmuls)", "offload"), applied for the length of a run
            and removed after it. A module with neither is a ``TypeError`` here, saying what
            is missing. A given model's depth is fixed, so the depth slider is disabled.
            Default: a ``TinyTransformer`` that a laptop CPU runs in a fraction of a second,
            rebuilt when the depth slider moves.
        device: where the default model lives (default: CUDA if available, else
            CPU); ignored when ``model`` is given (its parameters say where).
        depth, batch, steps: initial slider values (integers: ``1 <= depth <= max_depth``,
            ``0 <= batch <= max_batch``, ``steps >= 1``; anything else is an error, not a clamp).
            With a model of any kind, ``batch`` is its inputs instead: a dict of keyword
            arguments (``{"input_ids": ..., "labels": ...}``; a Hugging Face model given
            ``labels`` returns its loss, else the mean of its first output is differentiated),
            a tensor or a tuple of them, all fixed (the batch slider shows their size,
            disabled); or a callable ``n -> inputs`` for n examples (the slider picks n,
            starting at 8).
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

    A Hugging Face model (any module with repeated layers) comes with its inputs::

        dashboard = MemoryDashboard(gpt2, batch={"input_ids": ids, "labels": ids})
        dashboard.schedule.value = "every layer"     # apply_checkpointing(gpt2), for each run
    """


    def __init__(self, model: Any = None, device: torch.device | str | None = None, *,
                 depth: int = 4, batch: Any = 8, steps: int = 2, max_depth: int = 16,
                 max_batch: int = 32, memory_limit_bytes: float | None = None) -> None:
        where = "MemoryDashboard"
        max_depth = integer(max_depth, "max_depth", least=1, where=where)
        max_batch = integer(max_batch, "max_batch", least=1, where=where)
        depth = integer(depth, "depth", least=1, where=where)
        # A model of any kind comes with its inputs: anything but a number of examples.
        inputs_given = model is not None and not isinstance(batch, (int, float, str))
        self._applied = AppliedModel(model, batch) if inputs_given else None
        if self._applied is None:
            batch = integer(batch, "batch", least=0, where=where)
            self._schedules = demo_schedules()
        else:
            model, self._schedules = self._applied, applied_schedules()
            batch = self._applied.fixed_batch_size or min(8, max_batch)
            max_batch = max(max_batch, batch)
        steps = integer(steps, "steps", least=1, where=where)
        memory_limit_bytes = _checked_limit(memory_limit_bytes)
        if model is None:
            if depth > max_depth:
                raise ValueError(f"{where}: depth must be at most max_depth={max_depth}, got "
                                 f"{depth}; raise max_depth or lower depth.")
            self.device = torch.device(device if device is not None else
                                       "cuda" if torch.cuda.is_available() else "cpu")
        else:
            if self._applied is None:
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
        self._outcomes: list[dict[str, Any]] = []   # history and failures, in the order they ran
        self.timeline_data: list[TimelineEntry] = []
        self.unsupported: dict[str, str] = {} if model is None else self._refused_by(model)
        self.timer: Callable[[Any, Any], float] = time_one_step
        self._last_schedule = next(label for label in self._schedules if label != OFF)
        self._message_text = self._readout_text = self._busy_text = ""
        self._syncing = False   # the toggle and the menu are being set together: observers wait
        self._run_lock = threading.Lock()
        fixed_batch = self._applied is not None and self._applied.fixed_batch_size is not None
        self._build_controls(depth, max_depth, batch, max_batch, steps, fixed_batch)
        self._figure = new_figure()
        self._say_readout("Press Run to measure a training step.")
        draw_placeholder(self._figure)
        self.plot.value = png_bytes(self._figure)

    def _build_controls(self, depth: int, max_depth: int, batch: int, max_batch: int, steps: int,
                        fixed_batch: bool) -> None:
        # Fixed widths: the toggle's words change with its state and the schedule, and a row that
        # grew with them would wrap at 1100 px and move the plot. A longer label ends in "...",
        # and the tooltip says it whole.
        self.checkpointing = widgets.ToggleButton(
            value=False, tooltip="Recompute activations in backward instead of keeping them",
            layout=widgets.Layout(width="235px"))
        # The label takes its own width, the menu the rest: "selective (save matmuls)" fits.
        self.schedule = widgets.Dropdown(options=self._menu(), value=OFF, description="schedule",
                                         style={"description_width": "initial"},
                                         layout=widgets.Layout(width="270px"))
        self.depth = widgets.IntSlider(value=depth, min=1, max=max_depth, description="depth",
                                       disabled=not self._own_model)
        # min=0 on purpose: a learner may slide to an empty batch, and is told why it cannot run.
        self.batch = widgets.IntSlider(value=batch, min=0, max=max_batch, description="batch",
                                       disabled=fixed_batch)
        self.steps = widgets.IntSlider(value=steps, min=1, max=max(10, steps), description="steps")
        self.run_button = widgets.Button(description="Run", button_style="primary", icon="play",
                                         layout=widgets.Layout(width="90px"))
        # Room for the readout's longest text (three lines), so its height never changes.
        self.readout = widgets.HTML(layout=widgets.Layout(min_height=READOUT_HEIGHT))
        self.message = widgets.HTML(value="")
        self.plot = widgets.Image(format="png", layout=widgets.Layout(
            width=f"{FIGURE_PX}px", max_width="100%", height="auto"))
        self.plot.add_class("ckptlib-dims-when-busy")
        # The banner of a run in progress, laid over the plot (see ckptlib.widgets._view).
        self.busy = widgets.HTML(value="", layout=widgets.Layout(align_self="center",
                                                                 width="100%"))
        for name, widget in (("checkpointing", self.checkpointing), ("run", self.run_button),
                             ("readout", self.readout), ("message", self.message),
                             ("plot", self.plot), ("busy", self.busy)):
            widget.add_class(f"ckptlib-{name}")  # stable handles for the browser test
        self._style_toggle(False)
        self.checkpointing.observe(self._on_toggle, names="value")
        self.schedule.observe(self._on_schedule, names="value")
        self.run_button.on_click(lambda _button: self.run())
        controls = dict(flex_flow="row wrap", align_items="center")
        self.widget = widgets.VBox([
            widgets.HBox([self.checkpointing, self.schedule, self.run_button],
                         layout=widgets.Layout(**controls)),
            widgets.HBox([self.depth, self.batch, self.steps], layout=widgets.Layout(**controls)),
            over_each_other(self.plot, self.busy),
            self.readout, self.message, widgets.HTML(BUSY_STYLE),
        ], layout=widgets.Layout(max_width="100%"))
        self.widget.add_class("ckptlib-dashboard")

    def _text(self) -> str:
        return f"MemoryDashboard({settings_label(self._settings())}, on {self.device.type})"

    def close(self) -> None:
        """Close every widget of the dashboard (their views go blank) and clear the figure; a
        model run through ``apply_checkpointing`` has its own ``forward`` back."""
        if self._applied is not None:
            self._applied.checkpointing = OFF
        super().close()
        self._figure.clear()

    # -- what a model of the learner's own can run ----------------------------------
    def _refused_by(self, model: Any) -> dict[str, str]:
        """The schedules whose value ``model.checkpointing`` refuses, each with its error."""
        if knows_its_schedules(model):
            return {}
        refused, original = {}, model.checkpointing
        for label, value_for in self._schedules.items():
            try:
                model.checkpointing = value_for(len(model.blocks))
            except (TypeError, ValueError) as error:
                refused[label] = (f"its checkpointing switch refuses it "
                                  f"({type(error).__name__}: {error})")
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
            self.schedule.options = self._menu()   # resets the value: put it back, observers wait
            self.schedule.value = value
        finally:
            self._syncing = False

    # -- controls -------------------------------------------------------------
    def _style_toggle(self, on: bool) -> None:
        # On and off must read differently at a glance: words, icon and colour all change; and
        # "on" names the schedule it runs, so a schedule picked earlier never comes back unseen.
        self.checkpointing.description = (f"checkpointing: ON · {self.schedule.value}" if on
                                          else "checkpointing: OFF")
        self.checkpointing.tooltip = (f"{self.checkpointing.description}: recompute activations "
                                      "in backward instead of keeping them" if on else
                                      "Recompute activations in backward instead of keeping them")
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
        self.message.value = message_html(text)

    def _say_busy(self, text: str) -> None:
        """Show ``text`` in the banner over the dimmed plot ("" ends the busy state)."""
        self._busy_text = text
        show_busy(self.widget, self.busy, text)

    @property
    def busy_text(self) -> str:
        """What the banner of a run in progress says (``""`` when no run is in progress)."""
        return self._busy_text

    def _say_readout(self, text: str) -> None:
        self._readout_text = text
        self.readout.value = readout_html(text)

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
            self._say("A run is in progress; this request was ignored. Press Run again when it "
                      "ends.")
            return []
        self.run_button.disabled = True
        self._say_busy(f"Running {settings_label(self._settings())}: starting…")
        try:
            return self._run_locked(steps)
        finally:
            if self._applied is not None:
                self._applied.checkpointing = OFF   # the model leaves a run as it came
            self._say_busy("")
            self.run_button.disabled = False
            self._run_lock.release()

    def _run_locked(self, steps: int) -> list[dict[str, Any]]:
        settings = self._settings()
        if settings["batch"] < 1:
            self._say("Batch is 0: a training step needs at least one sequence. Move the batch "
                      "slider up.")
            return []
        if settings["schedule"] in self.unsupported:
            self._say(self._not_implemented(settings["schedule"]))
            return []
        model = self._model_for(settings["depth"])
        try:
            batch = model.example_batch(batch=settings["batch"])
        except (RuntimeError, MemoryError) as error:
            self._say(self._explain(error, settings))
            return []
        # Off is timed beside the current setting when it is known to fit at this depth and batch.
        reference = self.bars_data(settings["depth"], settings["batch"]).get(OFF)
        time_off = settings["checkpointing"] and reference is not None and "peak_bytes" in reference
        records = []
        warm = False
        for step in range(1, steps + 1):
            progress = f"Running {settings_label(settings)}: step {step} of {steps}"
            try:
                record, timeline = self._step(model, batch, settings, warm, time_off, progress)
            except OverLimit as error:
                self._record_failure(error, settings)
                break
            except RanAsPlain:
                self._say(self._not_implemented(settings["schedule"]))
                break
            except (RuntimeError, MemoryError) as error:
                self._say(self._explain(error, settings))
                break
            warm = True
            if step == 1:
                self._say("")   # this run's own result replaces the last run's message
            self.history.append(record)
            self._outcomes.append(record)
            self.timeline_data = timeline
            records.append(record)
            self._show(record)
        return records

    def _model_for(self, depth: int) -> Any:
        if self._model is None or (self._own_model and len(self._model.blocks) != depth):
            self._model = None  # let the old model go before building the next one
            self._model = TinyTransformer(depth=depth).to(self.device)
        return self._model

    def _step(self, model: Any, batch: Any, settings: dict[str, Any], warm: bool,
              time_off: bool, progress: str) -> tuple[dict[str, Any], list[TimelineEntry]]:
        value = self._schedules[settings["schedule"]](settings["depth"])
        self._say_busy(f"{progress}: measuring memory op by op…")
        report, timeline, loss = measure_step(model, batch, value, self.device,
                                              self.memory_limit_bytes,
                                              watch_torch=settings["schedule"] == TORCH)
        if self._ran_as_plain(value, settings, timeline):
            raise RanAsPlain(settings["schedule"])
        rounds = f"{TIMED_STEPS} runs" + (", in turns with off" if time_off else "")
        self._say_busy(f"{progress}: timing {rounds}…")
        times = time_steps(model, batch, value, self.timer, time_off, warm)
        step_times = times["current"]
        record = {**settings, "peak_bytes": report.peak_bytes,
                  "step_s": statistics.median(step_times),
                  "step_s_range": (min(step_times), max(step_times)), "step_times_s": step_times,
                  "off_times_s": times.get(OFF), "loss": loss, "device": self.device.type}
        return record, timeline

    def _ran_as_plain(self, value: Checkpointing, settings: dict[str, Any],
                      timeline: list[TimelineEntry]) -> bool:
        """A model of the learner's own that recomputed nothing where a demo model would have."""
        if self._own_model or knows_its_schedules(self._model):
            return False
        if settings["schedule"] == TORCH and TOP_HOOKS is None:
            return False   # this torch hides its rerun: nothing to conclude
        if (not recomputes(value, settings["depth"])
                or any(entry.phase == "recompute" for entry in timeline)):
            return False
        self._mark_unsupported(settings["schedule"], "its step recomputed nothing in backward: "
                                                     "the model's checkpointing switch accepts the "
                                                     "value but runs plain")
        return True

    def _not_implemented(self, schedule: str) -> str:
        runs = [label for label in self._schedules
                if label not in self.unsupported and label != OFF]
        return not_implemented(type(self._model).__name__, schedule, self.unsupported[schedule],
                               runs)

    def _record_failure(self, error: OverLimit, settings: dict[str, Any]) -> None:
        failure = {**settings, "stopped_bytes": error.entry.live_bytes,
                   "limit_bytes": self.memory_limit_bytes,
                   "op": f"op #{error.entry.index} ({error.entry.op}, {error.entry.phase})",
                   "timeline": error.timeline}
        self.failures.append(failure)
        self._outcomes.append(failure)
        self.timeline_data = error.timeline
        self._say(self._explain(error, settings))
        self._say_readout(did_not_fit(failure))
        self._draw(failure)

    def _explain(self, error: BaseException, settings: dict[str, Any]) -> str:
        if isinstance(error, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
        offered = REVOLVE in self._schedules and REVOLVE not in self.unsupported
        what_to_do = advice(settings, REVOLVE if offered else None, REVOLVE_SLOTS)
        return explanation(error, settings, self.memory_limit_bytes, what_to_do)

    # -- what the plot shows ------------------------------------------------------
    @property
    def peaks_data(self) -> dict[str, int]:
        """Settings label -> peak bytes of its latest step, the most recently run setting last."""
        peaks: dict[str, int] = {}
        for record in self.history:
            label = settings_label(record)
            peaks.pop(label, None)
            peaks[label] = record["peak_bytes"]
        return peaks

    def bars_data(self, depth: int, batch: int) -> dict[str, dict[str, Any]]:
        """Schedule -> its latest outcome at this depth and batch (a ``history`` record, or a
        ``failures`` entry for a step that did not fit), in the order of the schedule menu."""
        latest = {o["schedule"]: o for o in self._outcomes
                  if (o["depth"], o["batch"]) == (depth, batch)}
        return {schedule: latest[schedule] for schedule in self._schedules if schedule in latest}

    def _reference(self, record: dict[str, Any]) -> dict[str, Any] | None:
        """The latest outcome with checkpointing off at the same depth and batch (it may not
        have fit)."""
        return self.bars_data(record["depth"], record["batch"]).get(OFF)

    def _show(self, record: dict[str, Any]) -> None:
        self._say_readout(readout(len(self.history), record, self._reference(record)))
        self._draw(record)

    def _draw(self, outcome: dict[str, Any]) -> None:
        draw(self._figure, outcome, self.timeline_data,
             self.bars_data(outcome["depth"], outcome["batch"]), self.memory_limit_bytes,
             settings_label(outcome))
        self.plot.value = png_bytes(self._figure)
