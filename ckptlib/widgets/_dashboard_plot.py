"""The memory dashboard's one figure: a step's live memory op by op, beside a bar per schedule.

The plot is a single ``matplotlib.figure.Figure`` made without pyplot, drawn at twice its
on-screen size (sharp on any screen, text at least 11 px), redrawn whole after each step
(fixed rectangles: a layout engine would cost as much as the drawing itself) and shown as
PNG bytes in an ``Image`` widget; before the first run it shows what will appear there. The
plot sits above the readout and the message, so text that appears or wraps below it never
moves it. The bars are horizontal so that their names, one per line, can never overlap; the
left edge of the bars leaves room for the longest schedule name at :data:`FONT_PT`. Every
number is in MiB.
"""

from __future__ import annotations

import math
from typing import Any

from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from ckptlib import palette
from ckptlib.memory import TimelineEntry
from ckptlib.widgets._dashboard_models import TOP_HOOKS, TORCH, MiB, in_mib

LIMIT_SHOWN = 2.5  # the memory limit is drawn when it is at most this many times the plot's top
# The plot: its size on screen (CSS pixels at 80 per inch) and the scale it is drawn at.
FIGURE_INCHES, SCREEN_DPI, DRAW_SCALE = (8.2, 3.4), 80, 2  # 656 px: fits 1100 px, side panel open
FIGURE_PX = round(FIGURE_INCHES[0] * SCREEN_DPI)  # its width on screen, in CSS pixels
FONT_PT = 10  # 10 pt at 80 px per inch: 11 px on screen


def new_figure() -> Figure:
    return Figure(figsize=FIGURE_INCHES, dpi=SCREEN_DPI * DRAW_SCALE)


def _axes(figure: Figure) -> tuple[Any, Any]:
    figure.clear()
    return (figure.add_axes((0.085, 0.15, 0.42, 0.67)), figure.add_axes((0.76, 0.15, 0.215, 0.67)))


def _style(axes: Any) -> None:
    axes.tick_params(labelsize=FONT_PT)
    axes.xaxis.label.set_fontsize(FONT_PT)
    axes.yaxis.label.set_fontsize(FONT_PT)
    axes.title.set_fontsize(FONT_PT + 1)
    for text in axes.texts:
        text.set_fontsize(FONT_PT)


def draw_placeholder(figure: Figure) -> None:
    """Before the first run: what will appear where."""
    timeline_axes, peaks_axes = _axes(figure)
    timeline_axes.set(
        xlabel="op index in the step",
        ylabel="live memory (MiB)",
        title="One training step, op by op",
    )
    timeline_axes.text(
        0.5,
        0.5,
        # Short lines: the text stays inside the axes, clear of the y-axis label.
        "Press Run: the live memory\nof one step appears here,\ncoloured by phase\n"
        "(forward, backward, recompute).",
        ha="center",
        va="center",
        transform=timeline_axes.transAxes,
        color=palette.MUTED,
        family=palette.FONT_FAMILY,
    )
    timeline_axes.set(xticks=[], yticks=[])
    peaks_axes.set(title="Peak per schedule", xlabel="peak (MiB)", xticks=[], yticks=[])
    peaks_axes.text(
        0.5,
        0.5,
        "one bar\nper schedule",
        ha="center",
        va="center",
        transform=peaks_axes.transAxes,
        color=palette.MUTED,
        family=palette.FONT_FAMILY,
    )
    for axes in (timeline_axes, peaks_axes):
        _style(axes)


def draw(
    figure: Figure,
    outcome: dict[str, Any],
    timeline: list[TimelineEntry],
    bars: dict[str, dict[str, Any]],
    limit_bytes: float,
    label: str,
) -> None:
    """``outcome`` (a history record, or a failure) as its ``timeline`` and the ``bars`` of its
    depth and batch; ``label`` names its settings."""
    timeline_axes, peaks_axes = _axes(figure)
    fits = "peak_bytes" in outcome
    index = [entry.index for entry in timeline]
    live_mib = [entry.live_bytes / MiB for entry in timeline]
    for phase, colour in palette.PHASES.items():
        in_phase = [entry.phase == phase for entry in timeline]
        if any(in_phase):
            timeline_axes.fill_between(
                index, live_mib, where=in_phase, step="post", color=colour, linewidth=0, label=phase
            )
    limit_mib = limit_bytes / MiB
    top = max(live_mib, default=0)
    limit_off_chart = math.isfinite(limit_mib) and limit_mib > LIMIT_SHOWN * top
    limit_label = f"limit {in_mib(limit_bytes, 0)}"
    if math.isfinite(limit_mib) and not limit_off_chart:
        timeline_axes.axhline(
            limit_mib, color=palette.LIMIT, linestyle="--", linewidth=1.5, label=limit_label
        )
        top = max(top, limit_mib)
    if not fits:
        timeline_axes.plot(
            index[-1:],
            live_mib[-1:],
            "x",
            color=palette.LIMIT,
            markersize=10,
            mew=2.5,
            label="stopped: did not fit",
        )
    timeline_axes.set_ylim(0, top * 1.5 or 1)  # headroom for the legend above the curve
    title = (
        f"peak {in_mib(outcome['peak_bytes'])}"
        if fits
        else f"did not fit, stopped at op #{index[-1]}"
    )
    timeline_axes.set(
        xlabel="op index in the step",
        ylabel="live memory (MiB)",
        title=f"One step: {title}\n{label}",
    )
    handles, _labels = timeline_axes.get_legend_handles_labels()
    if limit_off_chart:
        # The limit is far above the curve: not drawn, but its legend entry keeps its colour sample.
        handles.append(
            Line2D(
                [],
                [],
                color=palette.LIMIT,
                linestyle="--",
                linewidth=1.5,
                label=f"{limit_label} (off scale)",
            )
        )
    if outcome["schedule"] == TORCH and TOP_HOOKS is None:
        handles.append(Patch(color="none", label="torch's rerun: not told apart from backward"))
    timeline_axes.legend(
        handles=handles,
        loc="upper left",
        fontsize=FONT_PT,
        ncols=2,
        frameon=False,
        handlelength=1.5,
        columnspacing=1.0,
        borderaxespad=0.3,
    )
    _draw_bars(peaks_axes, outcome, bars, limit_mib)
    for axes in (timeline_axes, peaks_axes):
        _style(axes)


def _draw_bars(
    axes: Any, outcome: dict[str, Any], bars: dict[str, dict[str, Any]], limit_mib: float
) -> None:
    names = list(bars)
    values = [
        (o["peak_bytes"] if "peak_bytes" in o else o["stopped_bytes"]) / MiB for o in bars.values()
    ]
    colours = [
        palette.HIGHLIGHT if name == outcome["schedule"] else palette.MUTED for name in names
    ]
    drawn = axes.barh(range(len(names)), values, color=colours, height=0.7)
    for bar, result in zip(drawn, bars.values()):
        if "peak_bytes" not in result:
            bar.set_hatch("///")
            bar.set_facecolor("white")
            bar.set_edgecolor(palette.HIGHLIGHT if result is outcome else palette.MUTED)
    limit_drawn = math.isfinite(limit_mib) and limit_mib <= LIMIT_SHOWN * max(values, default=0)
    # The numbers stand in one column right of every bar and of the limit line, so that no
    # label ("did not fit" least of all) can sit on the line.
    column = max(values + ([limit_mib] if limit_drawn else []), default=1) * 1.07
    for row, (value, result) in enumerate(zip(values, bars.values())):
        fits = "peak_bytes" in result
        axes.text(
            column,
            row,
            f"{value:.1f}" if fits else "did not fit",
            va="center",
            ha="left",
            color="black" if fits else palette.LIMIT,
        )
    # Room right of the column for its widest entry: "did not fit" is longer than a number.
    axes.set_xlim(0, column * (1.95 if any("peak_bytes" not in o for o in bars.values()) else 1.45))
    if limit_drawn:
        axes.axvline(limit_mib, color=palette.LIMIT, linestyle="--", linewidth=1.5)
        axes.text(
            limit_mib,
            -0.8,
            "limit",
            color=palette.LIMIT,
            ha="center",
            va="center",
            bbox=dict(facecolor="white", edgecolor="none", pad=0.5),
        )
    axes.set_yticks(range(len(names)), names)
    axes.set_ylim(len(names) - 0.5, -1.15)  # top to bottom, in menu order, room for "limit" above
    axes.set(xlabel="peak (MiB)")
    axes.set_title(f"Peak per schedule\ndepth {outcome['depth']}, batch {outcome['batch']}")
