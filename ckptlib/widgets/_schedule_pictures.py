"""The schedule explorer's two pictures: a plan as the classic layers-by-time picture, and the
memory/compute trade-off curve of every schedule at this n, the plan a dot on it.

The axes, legends and the curve's points are made once per n (:class:`ExplorerPictures`); an
update only swaps the picture's data, moves the dot and rewrites the titles: clearing and
rebuilding the figures cost more than drawing them. Both are ``matplotlib.figure.Figure``
made without pyplot, in the palette's colours, drawn at twice the pixels they take on screen.
"""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

from ckptlib import palette
from ckptlib.schedules import Plan
from ckptlib.schedules.registry import Schedule
from ckptlib.widgets._view import png_bytes

# What a cell of the schedule picture shows, in the order of its value.
# The palette's colours: kept memory green (a checkpoint, an activation kept for backward, paler),
# forward blue (grey when it keeps nothing), backward orange.
_PICTURE_KINDS = (("nothing", "white"), ("checkpoint held", palette.SAVED),
                  ("recorded, kept for backward", "#B5DBBE"), ("forward, keep nothing", "#BDBDBD"),
                  ("forward, record", palette.FORWARD), ("backward", palette.BACKWARD))
PICTURE_PX = (480, 300)    # the schedule picture's size on screen
TRADEOFF_PX = (340, 320)   # the trade-off curve's
_TEXT = {"family": palette.FONT_FAMILY}
_PICTURE_COLOURS = ListedColormap([colour for _, colour in _PICTURE_KINDS])


def schedule_picture(plan: Plan) -> np.ndarray:
    """The classic picture of a schedule as a ``layers x time`` array of :data:`_PICTURE_KINDS`
    values.

    One column per layer step (a forward or a backward of one layer), in the order of
    ``plan.actions``: the layer that runs, over the checkpoints held (row i: ``x_i``) and
    the layers recorded and not yet reversed at that moment.

    >>> from ckptlib.schedules import Segment
    >>> schedule_picture(Plan([Segment(0, 2), 2]))     # checkpoint layers 0-1, record layer 2
    array([[3, 1, 1, 1, 4, 2, 2, 5],
           [0, 3, 0, 0, 0, 4, 5, 0],
           [0, 0, 4, 5, 0, 0, 0, 0]], dtype=int8)
    """
    columns = []

    def column(layer: int, kind: int, checkpoints: Iterable[int], recorded: Iterable[int]) -> None:
        cells = np.zeros(plan.n, dtype=np.int8)
        cells[sorted(recorded)] = 2
        cells[sorted(checkpoints)] = 1
        cells[layer] = kind
        columns.append(cells)

    checkpoints, recorded = frozenset(), frozenset()   # the state before each action
    for action, after in zip(plan.actions, plan.states()):
        if action.op == "forward":   # layer by layer: each one's input recorded once it has run
            for layer in range(action.start, action.stop):
                column(layer, 4 if action.keep else 3, checkpoints,
                       recorded | set(range(action.start, layer)) if action.keep else recorded)
        elif action.op == "backward":   # in reverse: each layer's record released as it runs
            for layer in reversed(range(action.start, action.stop)):
                column(layer, 5, checkpoints, recorded - set(range(layer, action.stop)))
        checkpoints, recorded = after
    return np.stack(columns, axis=1)


class ExplorerPictures:
    """The two figures of one explorer, and what is drawn on them."""

    def __init__(self) -> None:
        self._figure = Figure(figsize=(PICTURE_PX[0] / 80, PICTURE_PX[1] / 80), dpi=80)
        self._tradeoff_figure = Figure(figsize=(TRADEOFF_PX[0] / 80, TRADEOFF_PX[1] / 80), dpi=80)
        self._drawn_n: int | None = None

    def draw(self, plan: Plan, result: dict[str, Any], curve: list[dict[str, Any]],
             schedules: Iterable[Schedule]) -> tuple[bytes, bytes]:
        """Both pictures for ``plan`` (the explorer's ``result``) on the trade-off ``curve`` of
        ``schedules``, as PNG bytes at twice their size on screen."""
        if self._drawn_n != plan.n:
            self._build_figure(plan.n, curve, schedules)
        image = schedule_picture(plan)
        self._picture.set_data(image)
        self._picture.set_extent((-0.5, image.shape[1] - 0.5, -0.5, plan.n - 0.5))
        self._picture_axes.set_title(f"{plan.name}: {plan.forward_steps} recomputed layer "
                                     f"forwards,\nat most {plan.peak_slots} checkpoints",
                                     fontsize=11, **_TEXT)
        r = result
        self._dot.set_offsets([[r["forward_calls"], r["peak_bytes"] / self._scale]])
        top = max(p["peak_bytes"] for p in curve + [r])
        self._tradeoff_axes.set_ylim(0, top / self._scale * 1.1)
        calls = [p["forward_calls"] for p in curve + [r]]
        self._tradeoff_axes.set_xlim(min(calls) / 1.3, max(calls) * 1.3)
        return png_bytes(self._figure, scale=2), png_bytes(self._tradeoff_figure, scale=2)

    def _build_figure(self, n: int, curve: list[dict[str, Any]],
                      schedules: Iterable[Schedule]) -> None:
        self._figure.clear()
        self._tradeoff_figure.clear()
        picture = self._figure.add_axes((0.1, 0.3, 0.87, 0.56))
        tradeoff = self._tradeoff_figure.add_axes((0.17, 0.38, 0.78, 0.48))
        self._picture = picture.imshow(np.zeros((1, 1)), cmap=_PICTURE_COLOURS, vmin=0,
                                       vmax=len(_PICTURE_KINDS) - 1, origin="lower",
                                       aspect="auto", interpolation="nearest")
        picture.set_xlabel("time (layer forward and backward steps)", fontsize=10.5, **_TEXT)
        picture.set_ylabel("layer i (row: its input)", fontsize=10.5, **_TEXT)
        picture.yaxis.set_major_locator(MaxNLocator(integer=True))
        picture.tick_params(labelsize=10)
        below = dict(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncols=3, frameon=False,
                     prop={"size": 10, "family": palette.FONT_FAMILY})
        picture.legend(handles=[Patch(facecolor=colour, edgecolor="#666666", label=label)
                                for label, colour in _PICTURE_KINDS[1:]],
                       handlelength=1.2, columnspacing=1.0, **below)
        # The curve's unit: MiB from 2 MiB up, KiB below (one unit for every point of the axis).
        large = max(p["peak_bytes"] for p in curve) >= 2**21
        self._scale, unit = (2**20, "MiB") if large else (2**10, "KiB")
        for schedule in schedules:
            points = [p for p in curve if p["schedule"] == schedule.name]
            if points:
                tradeoff.scatter([p["forward_calls"] for p in points],
                                 [p["peak_bytes"] / self._scale for p in points],
                                 marker=schedule.marker, color=palette.MUTED, label=schedule.name,
                                 zorder=2)
        self._dot = tradeoff.scatter([1], [0], s=120, color=palette.HIGHLIGHT, zorder=3,
                                     edgecolor="white", label="this plan")
        tradeoff.set_xscale("log")
        tradeoff.xaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
        tradeoff.xaxis.set_major_formatter(FuncFormatter(lambda value, _position: f"{value:g}"))
        tradeoff.xaxis.set_minor_formatter(NullFormatter())
        tradeoff.tick_params(labelsize=10)
        tradeoff.set_xlabel("layer forward calls per step (log)", fontsize=10.5, **_TEXT)
        tradeoff.set_ylabel(f"step peak, measured ({unit})", fontsize=10.5, **_TEXT)
        tradeoff.set_title(f"Memory vs compute, every schedule\nat n={n}", fontsize=11,
                           **_TEXT)
        tradeoff.legend(handletextpad=0.2, columnspacing=0.8, **below)
        self._picture_axes, self._tradeoff_axes, self._drawn_n = picture, tradeoff, n
