"""Step through one training step on the autograd graph: each saved tensor packed, dropped,
rerun, released.

Design notes
============

What it shows. ``ckptlib.widgets._replay`` observes the step (exact live bytes, the
checkpoint trace, every saved tensor; see its notes) and hands over one frame per event.
This module only shows a frame: its words, the live bytes so far as a timeline with a
cursor, how many saved tensors are in each state, and the autograd graph with every saved
tensor in its state at that moment.

One graph, laid out once. ``ckptlib.widgets._stepper_picture`` draws the graph after
forward with every saved tensor of the step in it, once; an event only recolours its boxes
(pale until packed, then saved, dropped, recomputed, released), so nothing moves, and the
legend and the counts beside it are fixed in place. The counts are of what is drawn: one
box per memory; a leaf's own memory is the dashed edge to that leaf; what a checkpoint
keeps to rerun from is not a node of the graph and is counted on a line of its own.

A cursor without redrawing. The timeline is one PNG, drawn once; the cursor and the dot on
it are HTML laid over the picture at the frame's place, so a step only moves two HTML elements.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import textwrap
from typing import Any, Callable

import ipywidgets as widgets
import torch
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from ckptlib import palette
from ckptlib.graph import AutogradGraph
from ckptlib.graph.raster import svg_to_png
from ckptlib.memory import format_bytes, unit_for
from ckptlib.widgets._replay import STATES, StepReplay, describe
from ckptlib.widgets._step import make_step
from ckptlib.widgets._stepper_picture import STATE_STYLES, StepPicture
from ckptlib.widgets._view import WidgetView, png_bytes, png_data_uri

__all__ = ["BackwardStepper", "STATES"]

# A saved tensor's state -> the status ckptlib.graph draws it with.
_GRAPH_STATUS = {
    "saved": "kept",
    "dropped": "dropped",
    "recomputed": "recomputed",
    "released": "freed",
}
TIMELINE_PX = (380, 210)  # the timeline picture's size on screen (drawn at twice the pixels)
TIMELINE_PT = 11  # its text: 11 pt at 80 px per inch is 12 px on screen


class BackwardStepper(WidgetView):
    """One training step replayed event by event, on the autograd graph and the memory timeline.

    ``BackwardStepper(model)`` for a ckptlib demo model (``MLPChain``, ``TinyTransformer``:
    anything with ``loss``, ``example_batch`` and a ``checkpointing`` switch): the step is
    ``model.training_step(model.example_batch(batch))``. ``BackwardStepper(fn, *inputs)``
    for a function that calls ``ckptlib.checkpoint`` inside: the step is
    ``fn(*inputs).sum().backward()`` (no ``.sum()`` for a scalar), after the ``.grad`` of the
    inputs and of every leaf the step reaches (the parameters ``fn`` uses) is reset to
    ``None``. Inputs may be nested (a dict or list of tensors) and need not require grad
    (token ids): the step has a backward as soon as ``fn``'s output requires grad.

    Any other module: ``BackwardStepper(layer, hidden, **kwargs)`` replays
    ``layer(hidden, **kwargs)`` summed (its ``loss`` where it returns one, else its first
    tensor), keyword arguments included (an attention mask, Llama's ``position_embeddings``);
    ``BackwardStepper(hf_model, batch=2)`` a Hugging Face model on ``batch`` rows of 8 token
    ids, with its own loss. For the step, :func:`ckptlib.apply_checkpointing` checkpoints the
    module's repeated layers (the module itself when it has none), so the regions are named
    by module path (``transformer.h.0``); every ``forward`` is given back after each call.

    The graph is laid out once, with every saved tensor of the step in it; an event only
    recolours it (``svg(k)``), so nodes stay where they are from the first event to the last.

    Args:
        batch: the demo model's batch size (``example_batch(batch)``), or a Hugging Face
            model's.
        collapse: passed to :func:`ckptlib.graph.to_dot` (``"module"``: one box per
            submodule, for a big model).
        all_ops: a frame for every aten op; by default an op that leaves the live bytes as
            they were (a view, a transpose) gets none. The curve and its peak are the same.

    Attributes:
        frames: one :class:`~ckptlib.widgets._replay.AnimationFrame` per event, in order (a
            read-only mapping: ``frame["text"]`` or ``frame.text``), with ``"event"``
            (``"forward_op"``, ``"recompute_op"``, ``"backward_op"``, or a ``record_trace`` kind:
            ``"pack"``, ``"forward_done"``, ``"recompute"``, ``"early_stop"``, ``"unpack"``,
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
    >>> for frame in stepper.frames[22:26]:  # doctest: +NORMALIZE_WHITESPACE
    ...     print(frame["event"], frame["live_bytes"], frame["text"])
    recompute 100 backward needs block 1's tensor #2, which was dropped: block 1 reruns
        for 3 of 3 saved tensors
    unpack 100 block 1 rerun: loads its kept input
    pack 100 block 1 rerun: packs tensor #0, 2x4 float32, 32 B
    pack 100 block 1 rerun: packs tensor #1, 4x4 float32, 64 B
    >>> stepper.frames[24]["states"]["block 1 #0"], stepper.frames[-1]["states"]["block 1 #0"]
    ('recomputed', 'released')
    >>> stepper.position.value = 24        # the view shows that moment
    """

    def __init__(
        self,
        model_or_fn: torch.nn.Module | Callable[..., torch.Tensor],
        *inputs: Any,
        batch: int = 2,
        collapse: str | None = None,
        all_ops: bool = False,
        **kwargs: Any,
    ) -> None:
        replay = StepReplay(make_step(model_or_fn, inputs, batch, kwargs), all_ops)
        self.frames, self.tensors, self.peak_bytes = (
            replay.frames,
            replay.tensors,
            replay.peak_bytes,
        )
        self._graph, self._slot_of_label = replay.graph, replay.slot_of_label
        self._region_of_raw, self._input_region = replay.region_of_raw, replay.input_region
        self.picture = StepPicture(
            replay.graph,
            replay.slot_of_label,
            replay.region_of_raw,
            replay.sequence_of_node,
            replay.sharers,
            collapse,
        )
        self._forward_done = list(
            itertools.accumulate(frame["phase"] != "forward" for frame in self.frames)
        )
        focuses = [
            self.picture.focus(f["tensor"], f["states"], done)
            for f, done in zip(self.frames, self._forward_done)
        ]
        self._windows = self.picture.windows(focuses)
        self._timeline_png, self._axes_box, self._y_limits = self._draw_timeline()

        last = len(self.frames) - 1
        # No readout: the slider counts from 0 (frames[k]), the caption from 1 ("28/53"); one
        # number on screen, not two that differ by one.
        self.position = widgets.IntSlider(
            value=0,
            min=0,
            max=last,
            description="event",
            readout=False,
            continuous_update=False,
            layout=widgets.Layout(flex="1 1 200px", min_width="120px"),
        )
        self.play = widgets.Play(value=0, min=0, max=last, interval=700, description="Play")
        widgets.jslink((self.play, "value"), (self.position, "value"))
        self.prev_button = widgets.Button(
            description="Prev",
            icon="step-backward",
            layout=widgets.Layout(width="80px", flex="0 0 auto"),
        )
        self.next_button = widgets.Button(
            description="Next",
            icon="step-forward",
            layout=widgets.Layout(width="80px", flex="0 0 auto"),
        )
        self.prev_button.on_click(lambda _button: self._move(-1))
        self.next_button.on_click(lambda _button: self._move(+1))
        self.caption = widgets.HTML()
        # The longest caption, laid out unseen under the current one: the caption's box is as
        # tall as the tallest caption at whatever width, so a click never moves the graph.
        self._longest_caption = max(range(len(self.frames)), key=lambda k: len(self._words(k)))
        self._longest_event_line = max(
            range(len(self.frames)), key=lambda k: len(self._event_line(k))
        )
        self.graph_view = widgets.HTML(layout=widgets.Layout(width="100%"))
        self.timeline_view = widgets.HTML(layout=widgets.Layout(flex="0 0 auto"))
        self.states_view = widgets.HTML(
            layout=widgets.Layout(flex="1 1 260px", margin="0 0 0 12px", min_width="0")
        )
        for name, widget in (
            ("stepper-prev", self.prev_button),
            ("stepper-next", self.next_button),
            ("stepper-position", self.position),
            ("stepper-caption", self.caption),
            ("stepper-graph", self.graph_view),
            ("stepper-timeline", self.timeline_view),
            ("stepper-states", self.states_view),
        ):
            widget.add_class(f"ckptlib-{name}")  # stable handles for the browser test
        self.position.observe(lambda change: self._show(change["new"]), names="value")
        # Controls, words, counts and the timeline first, then the graph's window: the part that
        # changes sits right under the controls.
        self.widget = widgets.VBox(
            [
                widgets.HBox(
                    [self.prev_button, self.next_button, self.play, self.position],
                    layout=widgets.Layout(flex_flow="row wrap", align_items="center"),
                ),
                self.caption,
                widgets.HBox(
                    [self.timeline_view, self.states_view],
                    layout=widgets.Layout(flex_flow="row wrap"),
                ),
                self.graph_view,
            ],
            layout=widgets.Layout(max_width="1100px"),
        )
        self._show(0)

    def _text(self) -> str:
        frame = self.frames[self.position.value]
        return (
            f"BackwardStepper({len(self.frames)} events, peak {format_bytes(self.peak_bytes)}; "
            f"event {self.position.value + 1}: {frame['text']})"
        )

    def _static_png(self) -> bytes:
        """The whole graph at one event, with its words above, as a picture (for front ends
        without the widget): the current event, or, while that is the first (nothing made yet,
        every box pale), the peak, where the most is kept."""
        index = self.position.value or self.peak_index
        frame, picture = self.frames[index], self.picture
        svg = picture.svg(
            frame["states"],
            self._forward_done[index],
            frame["tensor"],
            (0.0, 0.0, picture.width, picture.height),
        )
        graph = svg_to_png(svg, dpi=144)
        return _with_words_above(graph, f"event {self._words(index)}", dpi=144)

    @property
    def peak_index(self) -> int:
        """The first frame at the step's peak live bytes."""
        return next(k for k, f in enumerate(self.frames) if f["live_bytes"] == self.peak_bytes)

    # -- the view -------------------------------------------------------------------
    def _move(self, delta: int) -> None:
        self.position.value = min(max(self.position.value + delta, 0), self.position.max)

    def _words(self, index: int) -> str:
        """``"28/53 · <what happened> · live 10.1 KiB"``: the caption of frame ``index``."""
        frame = self.frames[index]
        return (f"{index + 1}/{len(self.frames)} · {frame['text']} · "
                f"live {format_bytes(frame['live_bytes'])}")

    def _caption_html(self, index: int) -> str:
        number, _, words = self._words(index).partition(" · ")
        return f"<b>{number}</b> · {_escape(words)}"

    def _show(self, index: int) -> None:
        # One grid cell holds the caption and, hidden, the longest one: the cell takes the taller.
        cell = "grid-area:1/1; overflow-wrap:anywhere"
        self.caption.value = (
            "<div style='display:grid; font-size:14px; line-height:1.4; padding:4px 0'>"
            f"<div style='{cell}'>{self._caption_html(index)}</div>"
            f"<div aria-hidden='true' style='{cell}; visibility:hidden'>"
            f"{self._caption_html(self._longest_caption)}</div></div>"
        )
        self.graph_view.value = self._graph_html(index)
        self.timeline_view.value = self._timeline_html(index)
        self.states_view.value = self._states_html(index)
        self.prev_button.disabled = index == 0
        self.next_button.disabled = index == len(self.frames) - 1

    def counts(self, index: int) -> dict[str, int]:
        """How many drawn boxes are in each state at frame ``index`` (one box per memory), with
        ``"leaf edges"`` (a leaf's own memory, drawn as the dashed edge to it) and ``"inputs kept"``
        (what checkpoints keep to rerun from, not drawn) on their own."""
        states = self.frames[index]["states"]
        shown = self.picture.box_states(states)
        counts = {
            state: sum(shown[box] == state for box in self.picture.boxes) for state in STATE_STYLES
        }
        counts["leaf edges"] = len(self.picture.leaf_edges)
        counts["inputs kept"] = sum(
            state == "saved" for label, state in states.items() if label in self._input_region
        )
        return counts

    def _states_html(self, index: int) -> str:
        counts = self.counts(index)
        chips = "".join(
            "<span style='display:inline-flex; align-items:center; margin:2px 12px 2px 0; "
            "white-space:nowrap'>"
            f"{_chip(state)}{state}: <b style='margin-left:4px'>{counts[state]}</b></span>"
            for state in STATE_STYLES
        )
        lines = [
            "<div style='font-weight:bold; margin-bottom:2px'>saved tensors in the graph "
            "(boxes)</div>"
            f"<div style='display:flex; flex-wrap:wrap'>{chips}</div>"
        ]
        notes = []
        if counts["leaf edges"]:
            notes.append(
                f"{counts['leaf edges']} more are a leaf's own memory (a parameter, the batch): "
                "the dashed edge to that leaf"
            )
        if self._input_region:   # said at every event, so that the line keeps its height
            notes.append(
                f"{counts['inputs kept']} checkpoint input(s) kept to rerun from (not a box)"
            )
        notes.append("ops forward has not run yet are pale")
        lines.append(f"<div style='color:#555; margin-top:2px'>{'; '.join(notes)}.</div>")
        # The event's line and, hidden in the same grid cell, the longest one: the counts and
        # the timeline beside them keep one height, so the graph below never moves.
        cell = "grid-area:1/1; margin-top:6px"
        lines.append(
            f"<div style='display:grid'><div style='{cell}'>{self._event_line(index)}</div>"
            f"<div aria-hidden='true' style='{cell}; visibility:hidden'>"
            f"{self._event_line(self._longest_event_line)}</div></div>"
        )
        return (
            "<div style='font-size:13px; line-height:1.45; overflow-wrap:anywhere'>"
            + "".join(lines)
            + "</div>"
        )

    def _event_line(self, index: int) -> str:
        """What the event's saved tensor is, and where the graph draws it ("" for an op)."""
        frame = self.frames[index]
        label = frame["tensor"]
        if label is None or label not in self.tensors:
            return ""
        info = self.tensors[label]
        where = f" · {info['node']}.{info['attribute']}" if info.get("node") else ""
        drawn = self.picture.drawn_as.get(label)
        return (
            f"this event: <b>{_escape(label)}</b>{_escape(where)} · "
            f"{describe(info['shape'], info['dtype'], info['nbytes'])} · now "
            f"<b>{frame['states'].get(label, '-')}</b>"
            + (f" (in the graph: {_escape(drawn)}, drawn thick)" if drawn else "")
        )

    def graph_at(self, index: int) -> AutogradGraph:
        """The autograd graph with every saved tensor drawn in its state at frame ``index``
        (tensors not packed yet are left out)."""
        states = self.frames[index]["states"]
        status = {
            (slot.node_id, slot.name): _GRAPH_STATUS[states[label]]
            for label, slot in self._slot_of_label.items()
            if label in states
        }
        nodes = []
        for node in self._graph.nodes:
            saved = tuple(
                dataclasses.replace(
                    s,
                    status=status[node.id, s.name],
                    region=self._region_of_raw.get(s.region, s.region),
                )
                for s in node.saved
                if (node.id, s.name) in status
            )
            nodes.append(dataclasses.replace(node, saved=saved) if saved != node.saved else node)
        return dataclasses.replace(self._graph, nodes=nodes)

    def svg(self, index: int) -> str:
        """The graph at frame ``index`` as SVG: laid out once, recoloured for that frame, cut to the
        band the view shows (the whole width; as tall as fits beside the controls)."""
        frame = self.frames[index]
        return self.picture.svg(
            frame["states"],
            self._forward_done[index],
            frame["tensor"],
            self._windows[index],
        )

    def _graph_html(self, index: int) -> str:
        x, y, w, h = self._windows[index]
        full_h = self.picture.height
        bar = (
            "<div title='the part of the graph in view' style='flex:0 0 6px; "
            "position:relative; background:#EEEEEE; margin-left:4px'><div "
            "style='position:absolute; left:0; right:0; "
            f"top:{100 * y / full_h:.1f}%; height:{100 * h / full_h:.1f}%; "
            "background:#999999'></div></div>"
        )
        note = (
            ""
            if h == full_h
            else "<div style='font-size:12px; color:#555'>part of the graph: the view follows "
            "the event (the grey bar on the right: where it is)</div>"
        )
        # A graph wider than the notebook scrolls sideways rather than shrink its text or lose
        # its edges. (An inline-size container is as wide as the notebook, never as its content.)
        return (
            f"<div style='container-type:inline-size; width:100%'>{note}<div style='display:flex'>"
            f"<div class='ckptlib-stepper-scroll' style='flex:1 1 auto; min-width:0; "
            f"overflow-x:auto'>{self.svg(index)}</div>{bar}</div></div>"
        )

    def _draw_timeline(
        self,
    ) -> tuple[bytes, tuple[float, float, float, float], tuple[float, float]]:
        figure = Figure(figsize=(TIMELINE_PX[0] / 80, TIMELINE_PX[1] / 80), dpi=80)
        axes = figure.add_axes((0.16, 0.36, 0.8, 0.5))
        unit, scale = unit_for(self.peak_bytes)
        live = [frame["live_bytes"] / scale for frame in self.frames]
        axes.bar(
            range(len(live)),
            live,
            width=1.0,
            linewidth=0,
            color=[palette.PHASES[frame["phase"]] for frame in self.frames],
        )
        axes.set_xlim(-0.5, len(live) - 0.5)
        axes.set_ylim(0, max(live) * 1.2 or 1)
        text = {"fontsize": TIMELINE_PT, "family": palette.FONT_FAMILY}
        axes.set_xlabel("event", **text)
        axes.set_ylabel(f"live ({unit})", **text)
        axes.set_title(
            f"Live memory per event: peak {format_bytes(self.peak_bytes)}",
            fontsize=TIMELINE_PT,
            family=palette.FONT_FAMILY,
        )
        axes.tick_params(labelsize=TIMELINE_PT)
        phases = [
            phase for phase in palette.PHASES if phase in {frame["phase"] for frame in self.frames}
        ]
        figure.legend(
            handles=[Patch(color=palette.PHASES[phase], label=phase) for phase in phases],
            loc="lower center",
            ncols=3,
            frameon=False,
            prop={"size": TIMELINE_PT, "family": palette.FONT_FAMILY},
            handlelength=1.0,
            columnspacing=1.0,
            borderaxespad=0.1,
        )
        box = axes.get_position()
        return png_bytes(figure, scale=2), (box.x0, box.x1, box.y0, box.y1), axes.get_ylim()

    def _timeline_html(self, index: int) -> str:
        x0, x1, y0, y1 = self._axes_box
        left = 100 * (x0 + (index + 0.5) / len(self.frames) * (x1 - x0))
        low, high = self._y_limits
        dot = y0 + (self.frames[index]["live_bytes"] / unit_for(self.peak_bytes)[1] - low) / (
            high - low
        ) * (y1 - y0)
        return (
            f"<div style='position:relative; width:{TIMELINE_PX[0]}px; height:{TIMELINE_PX[1]}px'>"
            f"<img src='{png_data_uri(self._timeline_png)}' "
            f"style='width:{TIMELINE_PX[0]}px; display:block'>"
            f"<div style='position:absolute; left:{left:.2f}%; top:{100 * (1 - y1):.1f}%; "
            f"height:{100 * (y1 - y0):.1f}%; border-left:2px solid {palette.HIGHLIGHT}'></div>"
            f"<div style='position:absolute; left:calc({left:.2f}% - 4px); "
            f"top:calc({100 * (1 - dot):.1f}% - 4px);"
            f" width:9px; height:9px; border-radius:50%; background:{palette.HIGHLIGHT}'>"
            "</div></div>"
        )


def _chip(state: str) -> str:
    """A small sample of how the graph draws a box in ``state``."""
    fill, line, dash = STATE_STYLES[state]
    border = "dashed" if dash and dash.startswith("5") else "dotted" if dash else "solid"
    return (
        "<span style='display:inline-block; width:16px; height:11px; margin-right:5px; "
        f"background:{fill}; "
        f"border:1.5px {border} {line}'></span>"
    )



def _with_words_above(png: bytes, words: str, dpi: int) -> bytes:
    """``png`` with ``words`` wrapped above it, at the picture's width."""
    import matplotlib.image

    picture = matplotlib.image.imread(io.BytesIO(png), format="png")
    height_px, width_px = picture.shape[:2]
    lines = textwrap.wrap(words, width=max(40, int(width_px / dpi * 72 / 6.5)))
    words_px = (len(lines) + 1) * 1.45 * 11 / 72 * dpi
    figure = Figure(figsize=(width_px / dpi, (height_px + words_px) / dpi), dpi=dpi)
    figure.figimage(picture, 0, 0)
    figure.text(0.01, 1 - 0.5 * 11 / 72 * dpi / (height_px + words_px), "\n".join(lines),
                va="top", ha="left", fontsize=11, family=palette.FONT_FAMILY, linespacing=1.45)
    return png_bytes(figure)


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
