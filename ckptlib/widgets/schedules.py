"""Explore checkpointing schedules for a chain of layers: each plan's picture, measured beside
its theory.

Design notes
============

The chain. An ``MLPChain`` of ``n`` blocks (Linear, then ReLU) with a batch large next
to its width (128 x 32 by default): one activation is 16 KiB, one layer's weights 4 KiB,
so what a schedule keeps shows in the step's peak instead of drowning in gradients.

What is measured. One training step with ``model.checkpointing = plan`` (so
``ckptlib.sequential.checkpoint_sequential`` runs the plan) under the live-tensor meter
(``ckptlib.measure``: the step's peak), with a forward *pre*-hook on every block: a
pre-hook sees a call that early stop cuts short, which is how ``Plan.forward_calls``
counts. The theory is the plan's own: ``forward_calls``, ``peak_slots`` (checkpoints),
``peak_activations`` and ``peak_bytes(costs)``, with the layer costs of
``ckptlib.sequential.measure_layer_costs``. The two peaks are different things and are
shown as such: the meter's is the whole step (activations, weight gradients, the tensors
in flight); the plan's counts only the activations it keeps (checkpoints and recorded
layers), an upper bound (``ckptlib.schedules``, "Memory model").

Deterministic plans. ``plan_for_budget`` trades memory for forward time; the layers of
the chain are alike, so each gets a forward time of 1 (a measured one, in microseconds,
would make the chosen plan change from run to run).

Fast updates. A step at n=64 under the meter takes up to 2.4 s (Revolve with one slot
runs 2080 layer forwards). So every measurement is cached by the plan's body (two
schedules that make the same plan, ``sqrt(16)`` and ``uniform k=4``, share it), and the
trade-off curve, a fixed family of plans measured once per n, is computed when n is
first shown, leaving out plans of more than ``CURVE_MAX_CALLS_PER_LAYER`` forward calls
per layer (Revolve with one slot at large n: the curve's far end, and most of its cost).
Moving the parameter slider then costs one measurement at most, and a redraw. While a
measurement runs, the controls are frozen, the readout and the pictures are dimmed and a
banner over the pictures says what is measured and how far the curve has got ("plan 7 of
19"; a new n takes from a few seconds to most of a minute on two CPU cores): a slider that
takes new values while the old plan is still on screen reads as if the new one had been
measured. The banner lies over the pictures, so nothing moves when it comes or goes.
"""
from __future__ import annotations

import io
from typing import Any

import ipywidgets as widgets

from ckptlib.memory import format_bytes, measure
from ckptlib.models import MLPChain
from ckptlib import palette
from ckptlib.schedules import LayerCost, Plan
from ckptlib.schedules.budget import least_memory_plan
from ckptlib.schedules.registry import Schedule, registered
from ckptlib.sequential import measure_layer_costs
from ckptlib.widgets._schedule_pictures import (
    PICTURE_PX, TRADEOFF_PX, ExplorerPictures, schedule_picture)
from ckptlib.widgets._view import BUSY_STYLE, WidgetView, over_each_other, show_busy

# SCHEDULES: served by __getattr__ below, from the schedule registry
__all__ = ["ScheduleExplorer", "SCHEDULES", "schedule_picture"]  # noqa: F822


def __getattr__(name: str) -> object:
    # SCHEDULES, the explorer's menu: schedule -> (what its parameter is, default value), None
    # for a schedule without one. Read from ckptlib.schedules.registry when asked for, so a
    # schedule registered there later is in it too.
    if name == "SCHEDULES":
        return {schedule.name: None if schedule.parameter is None else
                (schedule.parameter.name, schedule.parameter.default)
                for schedule in registered("explorer")}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


CURVE_MAX_CALLS_PER_LAYER = 8


def _calls_per_layer(plan: Plan) -> list[int]:
    """How often the plan calls each layer's forward in one training step (first forward
    included)."""
    calls = [0] * plan.n
    for action in plan.actions:
        if action.op == "forward":
            for layer in range(action.start, action.stop):
                calls[layer] += 1
    return calls


class ScheduleExplorer(WidgetView):
    """Pick a chain length and a schedule; see the plan, and its measured peak and forward calls.

    Args:
        n: initial chain length (blocks of an ``MLPChain``).
        schedule: initial schedule, one of :data:`SCHEDULES` (the schedules of
            ``ckptlib.schedules.registry`` that make a plan, read at construction).
        width, batch: the chain's width and batch (activations should outweigh weights).
        max_n: the n slider's range.

    Attributes:
        n, schedule, parameter: the controls (``IntSlider``, ``Dropdown``, ``IntSlider``).
            ``parameter`` is k for "uniform", s for "revolve", the budget in percent of
            the plain chain's activations for "budget", disabled for the others. A change of
            its range makes a new slider: read ``explorer.parameter`` afresh, not a saved one.
        result: what the current plan measured and what its theory says: ``"plan"``
            (its name), ``"n"``, ``"schedule"``, ``"parameter"`` (``None`` when unused),
            ``"peak_bytes"`` (the step's peak, measured), ``"forward_calls"`` (counted),
            ``"theory_forward_calls"``, ``"forward_calls_per_layer"`` and
            ``"theory_forward_calls_per_layer"`` (lists, layer 0 first), ``"forward_steps"``
            (forwards that keep nothing),
            ``"peak_checkpoints"``, ``"theory_peak_activations"`` and
            ``"theory_peak_bytes"`` (the activations the plan keeps at worst).
        curve: the trade-off curve at this n: one dict per plan of the family, with
            ``"schedule"``, ``"parameter"``, ``"plan"``, ``"peak_bytes"``, ``"forward_calls"``.
        message: a ``Label``: why a setting could not run (a budget below what any plan needs).
        plot: an ``Image``: the plan's picture and the trade-off curve.

    >>> explorer = ScheduleExplorer(n=8)
    >>> explorer.schedule.value = "revolve"
    >>> explorer.parameter.value = 2
    >>> result = explorer.result
    >>> result["plan"], result["forward_calls"], result["theory_forward_calls"]
    ('revolve(8, slots=2)', 22, 22)
    >>> explorer.schedule.value = "sqrt(n)"
    >>> explorer.parameter.disabled
    True
    """

    def __init__(self, n: int = 16, schedule: str = "revolve", *, width: int = 32, batch: int = 128,
                 max_n: int = 64) -> None:
        self._schedules: dict[str, Schedule] = {s.name: s for s in registered("explorer")}
        if schedule not in self._schedules:
            raise ValueError(f"schedule={schedule!r} is not one of "
                             f"{', '.join(map(repr, self._schedules))}.")
        if not (isinstance(n, int) and isinstance(max_n, int) and 2 <= n <= max_n):
            raise ValueError(f"need integers 2 <= n <= max_n, got n={n!r}, max_n={max_n!r}.")
        self.width, self.batch_size = width, batch
        self._measured: dict[tuple, tuple[int, int]] = {}
        self._plans: dict[tuple, Plan] = {}
        self._curves: dict[int, list[dict[str, Any]]] = {}
        self._chain: tuple[int, MLPChain, Any, list[int], list[LayerCost]] | None = None
        self.result: dict[str, Any] = {}
        self.curve: list[dict[str, Any]] = []

        self.schedule = widgets.Dropdown(options=list(self._schedules), value=schedule,
                                         description="schedule")
        self.n = widgets.IntSlider(value=n, min=2, max=max_n, description="n layers",
                                   continuous_update=False)
        self.parameter = self._slider(1, 2, 1, 1, "parameter")
        self.readout = widgets.HTML(layout=widgets.Layout(min_width="0"))
        self.message = widgets.HTML(layout=widgets.Layout(min_width="0"))
        # Two pictures side by side on a wide page, one above the other on a narrow one; each drawn
        # at twice the pixels it takes on screen.
        self.plot = widgets.Image(format="png", layout=widgets.Layout(
            width="100%", max_width=f"{PICTURE_PX[0]}px"))
        self.tradeoff_plot = widgets.Image(format="png", layout=widgets.Layout(
            width="100%", max_width=f"{TRADEOFF_PX[0]}px"))
        wrap = dict(flex_flow="row wrap")
        self.plots = widgets.HBox([self.plot, self.tradeoff_plot], layout=widgets.Layout(**wrap))
        # At the pictures' top: on a narrow page they are stacked, taller than the window.
        self.busy = widgets.HTML(layout=widgets.Layout(align_self="flex-start", width="100%",
                                                       margin="60px 0 0 0"))
        self.busy.add_class("ckptlib-busy-banner")
        for dimmed in (self.readout, self.plots):
            dimmed.add_class("ckptlib-dims-when-busy")
        for name, widget in (("schedule", self.schedule), ("n", self.n),
                             ("readout", self.readout), ("message", self.message),
                             ("plot", self.plot), ("tradeoff", self.tradeoff_plot)):
            widget.add_class(f"ckptlib-explorer-{name}")  # stable handles for the browser test
        self._adjusting = False
        self._fit_parameter(default=True)
        self.schedule.observe(lambda _change: self._changed(schedule_changed=True), names="value")
        self.n.observe(lambda _change: self._changed(), names="value")
        self.controls = widgets.HBox([self.schedule, self.n, self.parameter],
                                     layout=widgets.Layout(**wrap))
        self.widget = widgets.VBox([self.controls, self.message, self.readout,
                                    over_each_other(self.plots, self.busy),
                                    widgets.HTML(BUSY_STYLE)],
                                   layout=widgets.Layout(max_width="1000px"))
        self._pictures = ExplorerPictures()
        self.update()

    def _text(self) -> str:
        return f"ScheduleExplorer({self.result.get('plan') or 'no plan fits'})"

    def _static_png(self) -> bytes | None:
        """The plan's picture above the trade-off curve, for front ends without the widget:
        stacked, so that the picture (drawn at twice its pixels) is as narrow as the wider of
        the two, and a notebook page shrinks its text least."""
        if not self.result.get("plan"):
            return None
        from PIL import Image   # matplotlib depends on Pillow; imported when a picture is asked for
        left, right = (Image.open(io.BytesIO(bytes(image.value)))
                       for image in (self.plot, self.tradeoff_plot))
        both = Image.new("RGBA", (max(left.width, right.width), left.height + right.height),
                         "white")
        both.paste(left, ((both.width - left.width) // 2, 0))
        both.paste(right, ((both.width - right.width) // 2, left.height))
        buffer = io.BytesIO()
        both.save(buffer, format="png")
        return buffer.getvalue()

    # -- controls ---------------------------------------------------------------
    def _fit_parameter(self, default: bool) -> None:
        """Range, meaning and value of the parameter slider for the current schedule and n."""
        what = self._schedules[self.schedule.value].parameter
        n = self.n.value
        self._adjusting = True
        try:
            if what is None:
                # No number beside a disabled slider: a leftover "19" after Revolve reads as a
                # setting.
                self.parameter.disabled, self.parameter.description = True, "(no parameter)"
                self.parameter.readout = False
                return
            name, (low, high, step) = what.name, what.bounds(n)
            value = min(max(what.default if default else self.parameter.value, low), high)
            if (self.parameter.min, self.parameter.max, self.parameter.step) != (low, high, step):
                # A new range gets a new slider: the browser's slider keeps its first range for the
                # End and Home keys (End stopped at the old maximum), however the range is updated.
                self._replace_parameter(self._slider(low, high, step, value, name))
            self.parameter.value = value
            self.parameter.disabled, self.parameter.description = False, name
            self.parameter.readout = True
        finally:
            self._adjusting = False

    def _slider(self, low: int, high: int, step: int, value: int, name: str) -> widgets.IntSlider:
        slider = widgets.IntSlider(value=value, min=low, max=high, step=step, description=name,
                                   continuous_update=False, style={"description_width": "initial"})
        slider.add_class("ckptlib-explorer-parameter")   # a stable handle for the browser test
        slider.observe(lambda _change: self._changed(), names="value")
        return slider

    def _replace_parameter(self, slider: widgets.IntSlider) -> None:
        old, self.parameter = self.parameter, slider
        if hasattr(self, "controls"):
            self.controls.children = tuple(slider if child is old else child
                                           for child in self.controls.children)
        old.close()

    def _changed(self, schedule_changed: bool = False) -> None:
        if self._adjusting:
            return
        self._fit_parameter(default=schedule_changed)
        self.update()

    def _frozen(self) -> "_Frozen":
        return _Frozen(self)

    # -- the chain and its measurements -----------------------------------------------
    def _chain_for(self, n: int) -> tuple[MLPChain, Any, list[int], list[LayerCost]]:
        if self._chain is None or self._chain[0] != n:
            model = MLPChain(depth=n, width=self.width)
            batch = model.example_batch(batch=self.batch_size)
            calls = [0] * n      # forward calls per layer, counted by pre-hooks
            for layer, block in enumerate(model.blocks):
                block.register_forward_pre_hook(
                    lambda _module, _args, layer=layer: calls.__setitem__(layer, calls[layer] + 1))
            costs = [cost._replace(forward_s=1.0)
                     for cost in measure_layer_costs(model.blocks, batch[0])]
            self._chain = (n, model, batch, calls, costs)
        return self._chain[1:]

    def plan_for(self, schedule: str, n: int, parameter: int | None) -> Plan:
        """The plan a setting makes (``"none"``: every layer recorded, a plan without
        checkpoints)."""
        key = (schedule, n, parameter)
        if key not in self._plans:
            self._plans[key] = self._make_plan(schedule, n, parameter)
        return self._plans[key]

    def _make_plan(self, schedule: str, n: int, parameter: int | None) -> Plan:
        made = self._schedules[schedule]
        return made.make(n, parameter, self._chain_for(n)[3] if made.needs_costs else None)

    def measure_plan(self, plan: Plan) -> tuple[int, tuple[int, ...]]:
        """(peak bytes, forward calls of each layer) of one training step running ``plan``
        (cached)."""
        key = (plan.n, plan.body)
        if key not in self._measured:
            model, batch, calls, _ = self._chain_for(plan.n)
            model.checkpointing = plan
            calls[:] = [0] * plan.n
            report = measure(lambda: model.training_step(batch), timeline=False)
            self._measured[key] = (report.peak_bytes, tuple(calls))
        return self._measured[key]

    def _curve_for(self, n: int) -> list[dict[str, Any]]:
        if n not in self._curves:
            family = [(s.name, parameter) for s in self._schedules.values()
                      for parameter in s.curve_parameters(n)]
            points = []
            for number, (schedule, parameter) in enumerate(family, 1):
                show_busy(self.widget, self.busy, f"n = {n}: measuring the trade-off curve, "
                                                  f"plan {number} of {len(family)}…")
                try:
                    plan = self.plan_for(schedule, n, parameter)
                except ValueError:
                    continue  # a budget below what any plan needs at this n
                if plan.forward_calls > CURVE_MAX_CALLS_PER_LAYER * n:
                    # the curve's far end: seconds to measure, and off the plot's interesting part
                    continue
                peak, calls = self.measure_plan(plan)
                points.append({"schedule": schedule, "parameter": parameter, "plan": plan.name,
                               "peak_bytes": peak, "forward_calls": sum(calls)})
            self._curves[n] = points
        return self._curves[n]

    # -- one update ---------------------------------------------------------------
    def update(self) -> None:
        """Measure (or look up) the current setting and redraw; called on every control change."""
        schedule, n = self.schedule.value, self.n.value
        parameter = None if self._schedules[schedule].parameter is None else self.parameter.value
        with self._frozen():
            try:
                plan = self.plan_for(schedule, n, parameter)
            except ValueError:
                self._no_plan(schedule, n, parameter)
                return
            self.curve = self._curve_for(n)
            show_busy(self.widget, self.busy, f"Measuring {plan.name}…")
            peak, calls = self.measure_plan(plan)
        costs = self._chain_for(n)[3]
        self.result = {
            "plan": plan.name, "n": n, "schedule": schedule, "parameter": parameter,
            "peak_bytes": peak, "forward_calls": sum(calls),
            "theory_forward_calls": plan.forward_calls, "forward_calls_per_layer": list(calls),
            "theory_forward_calls_per_layer": _calls_per_layer(plan),
            "forward_steps": plan.forward_steps, "peak_checkpoints": plan.peak_slots,
            "theory_peak_activations": plan.peak_activations,
            "theory_peak_bytes": int(plan.peak_bytes(costs)),
        }
        self.message.value = ""   # a plan fits: no message of an earlier setting stays
        self.readout.value = self._readout()
        self.plot.value, self.tradeoff_plot.value = self._pictures.draw(
            plan, self.result, self.curve, self._schedules.values())
        self.plots.layout.display = None

    def _no_plan(self, schedule: str, n: int, percent: int) -> None:
        """A budget below what any plan keeps: say so in the widget's own terms, and clear the old
        plan's numbers and pictures (left on screen, they would read as this setting's)."""
        costs = self._chain_for(n)[3]
        plain = sum(cost.saved_bytes for cost in costs)
        least = least_memory_plan(costs)[0]
        low, high, step = self._schedules[schedule].parameter.bounds(n)
        least_percent = next((p for p in range(low, high + 1, step) if p * plain // 100 >= least),
                             high)
        self.result = {"plan": None, "n": n, "schedule": schedule, "parameter": percent}
        self.readout.value = ""
        self.plots.layout.display = "none"
        self.message.value = _note(
            f"No plan for {n} layers fits a budget of {percent}% = "
            f"{format_bytes(percent * plain // 100)} of the plain chain's {format_bytes(plain)}: "
            f"the least any plan keeps is {format_bytes(least)}. Move the <b>budget %</b> slider "
            f"to {least_percent}% or more, or pick another schedule.")

    def _readout(self) -> str:
        r = self.result
        same = ("equal, layer by layer"
                if r["forward_calls_per_layer"] == r["theory_forward_calls_per_layer"]
                else "<b>differ</b>")
        cell = "style='padding:2px 10px; text-align:left; vertical-align:top'"
        rows = [
            ("", "measured", "theory (the plan)"),
            ("layer forward calls", f"{r['forward_calls']}",
             f"{r['theory_forward_calls']} ({same}; {r['forward_steps']} of them recompute)"),
            ("peak memory", f"{format_bytes(r['peak_bytes'])}<br><small>the whole step: "
             "activations, weights' gradients, tensors in flight</small>",
             f"{format_bytes(r['theory_peak_bytes'])}<br><small>activations only: at worst "
             f"{r['theory_peak_activations']} kept, {r['peak_checkpoints']} of them checkpoints, "
             "by the layers' measured sizes; an upper bound on those, so it can exceed the "
             "step's measured peak</small>"),
        ]
        body = "".join("<tr>" + "".join(f"<td {cell}>{value}</td>" for value in row) + "</tr>"
                       for row in rows)
        return ("<div style='font-size:13px; line-height:1.4; overflow-wrap:anywhere'>"
                f"<b>{r['plan']}</b>"
                "<table style='border-collapse:collapse; width:100%; table-layout:fixed'>"
                "<colgroup><col style='width:22%'><col style='width:30%'><col></colgroup>"
                f"{body}</table></div>")

class _Frozen:
    """While a setting is measured: every control disabled and a note that says so; restored
    after."""

    def __init__(self, explorer: ScheduleExplorer) -> None:
        self.explorer = explorer

    def __enter__(self) -> None:
        e = self.explorer
        self.controls = [(c, c.disabled) for c in (e.schedule, e.n, e.parameter)]
        for control, _ in self.controls:
            control.disabled = True
        show_busy(e.widget, e.busy, "Measuring this setting; the controls come back when it is "
                                    "done.")

    def __exit__(self, *exc: object) -> None:
        for control, was_disabled in self.controls:
            control.disabled = was_disabled
        show_busy(self.explorer.widget, self.explorer.busy, "")


def _note(html_text: str) -> str:
    """A message box that wraps (never one clipped line)."""
    return ("<div style='font-size:13px; line-height:1.4; "
            f"padding:6px 10px; margin:4px 0; border-left:4px solid {palette.LIMIT}; "
            "background:#F6F6F6; "
            f"overflow-wrap:anywhere'>{html_text}</div>")

