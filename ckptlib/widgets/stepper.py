"""Step through one training step on the autograd graph: each saved tensor packed, dropped, rerun, released.

Design notes
============

What it shows. ``ckptlib.widgets._replay`` observes the step (exact live bytes, the
checkpoint trace, every saved tensor; see its notes) and hands over one frame per event.
This module only shows a frame: its words, the live bytes so far as a timeline with a
cursor, and the autograd graph with every saved tensor in its state at that moment.

One graph, many pictures. The graph is built once, after forward. A frame's picture is that
graph with each saved tensor's status replaced (``dataclasses.replace``: saved is drawn as
kept, released as freed; tensors not packed yet are left out), rendered by Graphviz once
per distinct set of states and cached, so stepping back and forth costs nothing new.

A cursor without redrawing. The timeline is one PNG, drawn once; the cursor and the dot on
it are HTML laid over the picture at the frame's place, so a step only moves two HTML elements.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import ipywidgets as widgets
import torch
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from ckptlib.graph import AutogradGraph, render_svg, to_dot
from ckptlib.memory import format_bytes
from ckptlib.widgets._replay import STATES, StepReplay, describe, make_step
from ckptlib.widgets._view import HIGHLIGHT, PHASE_COLOURS, WidgetView, png_bytes, png_data_uri

__all__ = ["BackwardStepper", "STATES"]

# A saved tensor's state -> the status ckptlib.graph draws it with.
_GRAPH_STATUS = {"saved": "kept", "dropped": "dropped", "recomputed": "recomputed", "released": "freed"}
TIMELINE_PX = (368, 208)   # the timeline picture's size on screen
# How a state looks in the legend beside the timeline: as ckptlib.graph draws that status.
_CHIP = {"saved": "background:orange", "dropped": "border:1px dashed darkorange; background:white",
         "recomputed": "border:1px dashed darkorange; background:plum",
         "released": "border:1px dotted grey; background:white"}


class BackwardStepper(WidgetView):
    """One training step replayed event by event, on the autograd graph and the memory timeline.

    ``BackwardStepper(model)`` for a ckptlib demo model (``MLPChain``, ``TinyTransformer``:
    anything with ``loss``, ``example_batch`` and a ``checkpointing`` switch): the step is
    ``model.training_step(model.example_batch(batch))``. ``BackwardStepper(fn, *inputs)``
    for a function that calls ``ckptlib.checkpoint`` inside: the step is
    ``fn(*inputs).sum().backward()`` (no ``.sum()`` for a scalar), after the ``.grad`` of
    the inputs is reset to ``None``.

    Args:
        batch: the demo model's batch size (``example_batch(batch)``).
        collapse: passed to :func:`ckptlib.graph.to_dot` (``"module"``: one box per
            submodule, for a big model).
        all_ops: a frame for every aten op; by default an op that leaves the live bytes as
            they were (a view, a transpose) gets none. The curve and its peak are the same.

    Attributes:
        frames: one dict per event, in order, with ``"event"`` (``"forward_op"``,
            ``"recompute_op"``, ``"backward_op"``, or a ``record_trace`` kind: ``"pack"``,
            ``"forward_done"``, ``"recompute"``, ``"early_stop"``, ``"unpack"``,
            ``"release"``), ``"phase"`` (``"forward"``, ``"recompute"``, ``"backward"``),
            ``"text"`` (the event in words), ``"live_bytes"`` (the exact live-tensor
            meter, right after the event), ``"tensor"`` (the label of the saved tensor the
            event is about, or ``None``), ``"region"`` (the checkpoint's name, or ``None``),
            ``"op"`` (an op's name, or ``None``) and ``"states"`` (label -> ``"saved"``,
            ``"dropped"``, ``"recomputed"`` or ``"released"`` for every tensor packed so far).
        tensors: label -> what that saved tensor is (``shape``, ``dtype``, ``nbytes``,
            ``node``, ``attribute``, ``region``).
        peak_bytes: the meter's peak for the step (the largest ``live_bytes``).
        position: the ``IntSlider`` that picks the frame; ``position.value = k`` shows frame k.
        prev_button, next_button, play: the other controls (``play`` drives the slider).

    Labels: ``"saved #k"`` for the k-th tensor plain autograd keeps, ``"<region> #i"`` for
    tensor #i of a checkpoint (``"block 1 #2"``), ``"<region> input"`` for what a
    checkpoint keeps to rerun from.

    >>> from ckptlib.models import MLPChain
    >>> stepper = BackwardStepper(MLPChain(depth=2, width=4, checkpointing="block"), batch=2)
    >>> for frame in stepper.frames[22:26]:
    ...     print(frame["event"], frame["live_bytes"], frame["text"])
    recompute 100 backward needs block 1's tensor #2, which was dropped: block 1 reruns for 3 of 3 saved tensors
    unpack 100 block 1 rerun: loads its kept input
    pack 100 block 1 rerun: packs tensor #0, 2x4 float32, 32 B
    pack 100 block 1 rerun: packs tensor #1, 4x4 float32, 64 B
    >>> stepper.frames[24]["states"]["block 1 #0"], stepper.frames[-1]["states"]["block 1 #0"]
    ('recomputed', 'released')
    >>> stepper.position.value = 24        # the view shows that moment
    """

    def __init__(self, model_or_fn: torch.nn.Module | Callable[..., torch.Tensor], *inputs: Any,
                 batch: int = 2, collapse: str | None = None, all_ops: bool = False) -> None:
        replay = StepReplay(make_step(model_or_fn, inputs, batch), all_ops)
        self._collapse = collapse
        self.frames, self.tensors, self.peak_bytes = replay.frames, replay.tensors, replay.peak_bytes
        self._graph, self._slot_of_label = replay.graph, replay.slot_of_label
        self._region_of_raw = replay.region_of_raw
        self._svg_cache: dict[tuple, str] = {}
        self._timeline_png, self._axes_box, self._y_limits = self._draw_timeline()

        last = len(self.frames) - 1
        # No readout: the slider counts from 0 (frames[k]), the caption from 1 ("28/53"); one
        # number on screen, not two that differ by one.
        self.position = widgets.IntSlider(value=0, min=0, max=last, description="event", readout=False,
                                          continuous_update=False, layout=widgets.Layout(width="420px"))
        self.play = widgets.Play(value=0, min=0, max=last, interval=500, description="Play")
        widgets.jslink((self.play, "value"), (self.position, "value"))
        self.prev_button = widgets.Button(description="Prev", icon="step-backward",
                                          layout=widgets.Layout(width="80px"))
        self.next_button = widgets.Button(description="Next", icon="step-forward",
                                          layout=widgets.Layout(width="80px"))
        self.prev_button.on_click(lambda _button: self._move(-1))
        self.next_button.on_click(lambda _button: self._move(+1))
        self.caption = widgets.HTML()
        # The graph gets the whole width (it is wide: every saved tensor is a box of its own).
        self.graph_view = widgets.HTML(layout=widgets.Layout(max_height="640px", overflow="auto"))
        self.timeline_view = widgets.HTML(layout=widgets.Layout(flex="0 0 auto"))
        self.states_view = widgets.HTML(layout=widgets.Layout(flex="1 1 auto", margin="0 0 0 16px"))
        for name, widget in (("stepper-prev", self.prev_button), ("stepper-next", self.next_button),
                             ("stepper-position", self.position), ("stepper-caption", self.caption),
                             ("stepper-graph", self.graph_view), ("stepper-timeline", self.timeline_view),
                             ("stepper-states", self.states_view)):
            widget.add_class(f"ckptlib-{name}")  # stable handles for the browser test
        self.position.observe(lambda change: self._show(change["new"]), names="value")
        self.widget = widgets.VBox([
            widgets.HBox([self.prev_button, self.next_button, self.play, self.position]),
            self.caption,
            widgets.HBox([self.timeline_view, self.states_view]),
            self.graph_view,
        ])
        self._show(0)

    def _text(self) -> str:
        return f"BackwardStepper({len(self.frames)} events, peak {format_bytes(self.peak_bytes)})"

    # -- the view -------------------------------------------------------------------
    def _move(self, delta: int) -> None:
        self.position.value = min(max(self.position.value + delta, 0), self.position.max)

    def _show(self, index: int) -> None:
        frame = self.frames[index]
        self.caption.value = (f"<div style='font-size:14px; padding:4px 0'><b>{index + 1}/{len(self.frames)}"
                              f"</b> · {_escape(frame['text'])} · live {format_bytes(frame['live_bytes'])}</div>")
        self.graph_view.value = self.svg(index)
        self.timeline_view.value = self._timeline_html(index)
        self.states_view.value = self._states_html(index)
        self.prev_button.disabled = index == 0
        self.next_button.disabled = index == len(self.frames) - 1

    def _states_html(self, index: int) -> str:
        frame = self.frames[index]
        counts = {state: 0 for state in STATES}
        for state in frame["states"].values():
            counts[state] += 1
        chips = "".join(f"<div style='margin:3px 0'><span style='display:inline-block; width:14px; height:10px; "
                        f"margin-right:6px; {_CHIP[state]}'></span>{state}: <b>{count}</b></div>"
                        for state, count in counts.items())
        lines = [f"<div style='font-weight:bold; margin-bottom:4px'>saved tensors now</div>{chips}"]
        label = frame["tensor"]
        if label is not None and label in self.tensors:
            info = self.tensors[label]
            where = f" · {info['node']}.{info['attribute']}" if info.get("node") else ""
            lines.append(f"<div style='margin-top:8px'>this event: <b>{_escape(label)}</b>{_escape(where)} · "
                         f"{describe(info['shape'], info['dtype'], info['nbytes'])} · now "
                         f"<b>{frame['states'].get(label, '-')}</b></div>")
        return "<div style='font-size:13px'>" + "".join(lines) + "</div>"

    def graph_at(self, index: int) -> AutogradGraph:
        """The autograd graph with every saved tensor drawn in its state at frame ``index``
        (tensors not packed yet are left out)."""
        states = self.frames[index]["states"]
        status = {(slot.node_id, slot.name): _GRAPH_STATUS[states[label]]
                  for label, slot in self._slot_of_label.items() if label in states}
        nodes = []
        for node in self._graph.nodes:
            saved = tuple(dataclasses.replace(s, status=status[node.id, s.name],
                                              region=self._region_of_raw.get(s.region, s.region))
                          for s in node.saved if (node.id, s.name) in status)
            nodes.append(dataclasses.replace(node, saved=saved) if saved != node.saved else node)
        return dataclasses.replace(self._graph, nodes=nodes)

    def svg(self, index: int) -> str:
        """The SVG of :meth:`graph_at` (rendered once per distinct set of states)."""
        states = self.frames[index]["states"]
        key = tuple(sorted((label, states[label]) for label in self._slot_of_label if label in states))
        if key not in self._svg_cache:
            svg = render_svg(to_dot(self.graph_at(index), collapse=self._collapse))
            # No XML prologue inside HTML; scaled down to the view's width, never up.
            svg = svg[svg.index("<svg"):].replace("<svg", "<svg style='max-width:100%; height:auto'", 1)
            self._svg_cache[key] = svg
        return self._svg_cache[key]

    def _draw_timeline(self) -> tuple[bytes, tuple[float, float, float, float], tuple[float, float]]:
        figure = Figure(figsize=(TIMELINE_PX[0] / 80, TIMELINE_PX[1] / 80), dpi=80)
        axes = figure.add_axes((0.17, 0.2, 0.78, 0.66))
        unit, scale = _unit(self.peak_bytes)
        live = [frame["live_bytes"] / scale for frame in self.frames]
        axes.bar(range(len(live)), live, width=1.0, linewidth=0,
                 color=[PHASE_COLOURS[frame["phase"]] for frame in self.frames])
        axes.set_xlim(-0.5, len(live) - 0.5)
        axes.set_ylim(0, max(live) * 1.15 or 1)
        axes.set(xlabel="event", ylabel=f"live memory ({unit})",
                 title=f"Live memory per event: peak {format_bytes(self.peak_bytes)}")
        phases = {frame["phase"] for frame in self.frames}
        axes.legend(handles=[Patch(color=colour, label=phase) for phase, colour in PHASE_COLOURS.items()
                             if phase in phases], loc="upper left", fontsize="x-small", ncols=3, frameon=False)
        box = axes.get_position()
        return png_bytes(figure), (box.x0, box.x1, box.y0, box.y1), axes.get_ylim()

    def _timeline_html(self, index: int) -> str:
        x0, x1, y0, y1 = self._axes_box
        left = 100 * (x0 + (index + 0.5) / len(self.frames) * (x1 - x0))
        low, high = self._y_limits
        dot = y0 + (self.frames[index]["live_bytes"] / _unit(self.peak_bytes)[1] - low) / (high - low) * (y1 - y0)
        return (f"<div style='position:relative; width:{TIMELINE_PX[0]}px; height:{TIMELINE_PX[1]}px'>"
                f"<img src='{png_data_uri(self._timeline_png)}' style='width:{TIMELINE_PX[0]}px; display:block'>"
                f"<div style='position:absolute; left:{left:.2f}%; top:{100 * (1 - y1):.1f}%; "
                f"height:{100 * (y1 - y0):.1f}%; border-left:2px solid {HIGHLIGHT}'></div>"
                f"<div style='position:absolute; left:calc({left:.2f}% - 4px); top:calc({100 * (1 - dot):.1f}% - 4px);"
                f" width:9px; height:9px; border-radius:50%; background:{HIGHLIGHT}'></div></div>")


def _unit(peak_bytes: int) -> tuple[str, int]:
    """The unit a plot of values up to ``peak_bytes`` reads best in."""
    return next((name, size) for name, size in (("MiB", 2**20), ("KiB", 2**10), ("B", 1)) if peak_bytes >= 2 * size
                or size == 1)


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
