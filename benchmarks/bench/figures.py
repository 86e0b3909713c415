"""The figures of a run (``--figures DIR``, ``make figures``): each one's title states what it
shows.

Every figure is drawn from the JSON summary, except ``memory_timeline``, which
needs the per-op timelines of a fresh run (``BenchRun.timelines``); so a saved
run can be redrawn, timeline aside: ``write_figures(BenchRun(summary, {}), DIR,
names=...)``. Figures use constrained layout and titles on the figure (not on an
axes pushed aside by long tick labels), so nothing is clipped at the edges; the
tests check every text of every figure against the canvas. SVGs carry fixed ids
and no date, so a rerun changes the files only where the numbers changed.
"""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

from ckptlib import palette
from benchmarks.bench.config import METER_VARIANTS
from benchmarks.bench.summary import BenchError, BenchRun, check_summary
from benchmarks.bench.sweeps import forward_mismatches
from ckptlib.memory import TimelineEntry, format_bytes

FIGURE_NAMES = (
    "memory_vs_depth",
    "overhead_per_variant",
    "memory_timeline",
    "scaling_peak_vs_n",
    "forward_calls_vs_theory",
)
PHASE_COLOURS = palette.PHASES
MiB = 2**20
# The salt predates the move out of ckptlib/: kept, so the SVGs' ids stay as committed.
_STYLE = {"svg.hashsalt": "ckptlib.bench", "font.size": 9}
_SIZES = {"overhead_per_variant": (7.0, 5.6)}  # inches; the others (7.0, 4.2)


def draw_figure(name: str, bench: BenchRun) -> Any:
    """One figure of ``bench`` (a ``matplotlib.figure.Figure``, not shown or saved)."""
    import matplotlib
    from matplotlib.figure import Figure

    if not isinstance(bench, BenchRun):
        raise TypeError(
            f"bench must be a BenchRun (what run() returns, or BenchRun(summary, {{}}) for a saved "
            f"summary), got {type(bench).__name__}."
        )
    check_summary(bench.summary)
    drawings: dict[str, Callable[[Any, dict[str, Any]], None]] = {
        "memory_vs_depth": _draw_memory_vs_depth,
        "overhead_per_variant": _draw_overhead,
        "memory_timeline": partial(_draw_timeline, bench.timelines),
        "scaling_peak_vs_n": _draw_scaling,
        "forward_calls_vs_theory": _draw_forward_calls,
    }
    if name not in drawings:
        raise ValueError(f"no figure named {name!r}; the bench draws {', '.join(FIGURE_NAMES)}.")
    if name == "memory_timeline" and not bench.timelines:
        raise BenchError(
            "memory_timeline needs the per-op timelines of a fresh run (they are not in the JSON): "
            "leave it out of names, or run the bench."
        )
    with matplotlib.rc_context(_STYLE):
        figure = Figure(figsize=_SIZES.get(name, (7.0, 4.2)), layout="constrained")
        drawings[name](figure, bench.summary)
        figure.draw_without_rendering()  # tick labels and layout made now, under this style
    return figure


def write_figures(
    bench: BenchRun, directory: Path | str, names: Sequence[str] = FIGURE_NAMES
) -> list[Path]:
    """Draw the figures ``names`` of one run into ``directory`` (PNG and SVG); returns the paths
    written."""
    import matplotlib

    figures = {
        name: draw_figure(name, bench) for name in names
    }  # every check before any file is written
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    with matplotlib.rc_context(_STYLE):
        for name, figure in figures.items():
            for suffix in ("png", "svg"):
                path = directory / f"{name}.{suffix}"
                figure.savefig(path, dpi=150, metadata={"Date": None} if suffix == "svg" else None)
                written.append(path)
    return written


def _draw_memory_vs_depth(figure: Any, summary: dict[str, Any]) -> None:
    depth = summary["depth"]
    ax = figure.add_subplot()
    # torch and ckptlib per block may coincide: a dashed line with crosses stays visible on top.
    styles = {"torch": dict(marker="x", linestyle="--", markersize=8, zorder=3)}
    for name, peaks in depth["peak_bytes"].items():
        ax.plot(
            depth["depths"],
            [p / MiB for p in peaks],
            label=name,
            **styles.get(name, dict(marker="o")),
        )
    ax.set_xlabel("number of Transformer blocks (depth)")
    ax.set_ylabel(
        f"peak memory of one training step (MiB, {summary['environment']['meter']} meter)"
    )
    ax.set_xticks(depth["depths"])
    ax.set_ylim(bottom=0)
    saving = depth["saving_vs_plain"]["ckptlib"]
    same = (
        "\ntorch.utils.checkpoint per block has the same peaks"
        if depth["peak_bytes"]["torch"] == depth["peak_bytes"]["ckptlib"]
        else ""
    )
    figure.suptitle(
        f"Per-block checkpointing saves {saving[0] * 100:.0f}% of the peak at depth "
        f"{depth['depths'][0]}, "
        f"{saving[-1] * 100:.0f}% at depth {depth['depths'][-1]}{same}\n{depth['model']}",
        fontsize=9,
    )
    ax.legend(title="checkpointing")
    ax.grid(alpha=0.3)


def _draw_overhead(figure: Any, summary: dict[str, Any]) -> None:
    """Step time vs plain: the ways to keep activations above, the meter's own cost apart below."""
    meters = set(METER_VARIANTS.values())
    bars: dict[bool, list[tuple[str, dict[str, Any], str]]] = {False: [], True: []}
    for colour, (group_name, group) in zip(
        ("tab:blue", "tab:purple", "tab:gray"), summary["groups"].items()
    ):
        for name, variant in group["variants"].items():
            if name != "plain":
                is_meter = group_name == "blocks" and name in meters
                bars[is_meter].append(
                    (f"{group_name}/{name}", variant, "tab:olive" if is_meter else colour)
                )
    ways, meter_ax = figure.subplots(
        2, 1, sharex=True, height_ratios=[len(bars[False]), len(bars[True]) + 1]
    )
    for ax, rows in ((ways, bars[False]), (meter_ax, bars[True])):
        positions = range(len(rows))
        ax.barh(
            positions,
            [v["time_vs_plain"] for _, v, _ in rows],
            xerr=[v["time_vs_plain_iqr"] / 2 for _, v, _ in rows],
            color=[colour for _, _, colour in rows],
            alpha=0.8,
        )
        ax.axvline(1.0, color="black", linewidth=1)
        ax.set_yticks(list(positions), [label for label, _, _ in rows])
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    blocks = summary["groups"]["blocks"]["variants"]
    environment = summary["environment"]
    ways.set_title("Checkpointing, selective checkpointing and offloading", fontsize=9)
    overhead = summary["meter_overhead"]
    meter_ax.set_title(
        f"The live-tensor meter's own cost, in no bar above:\nx{overhead['peak']:.2f} measuring "
        f"the peak, x{overhead['timeline']:.2f} recording a timeline",
        fontsize=9,
    )
    figure.supxlabel(
        "step time / plain step time of the same round: median over rounds (bars: ± half the IQR)",
        fontsize=9,
    )
    figure.suptitle(
        f"Recomputing costs time: per block x{blocks['ckptlib']['time_vs_plain']:.2f} (ckptlib), "
        f"x{blocks['torch']['time_vs_plain']:.2f} (torch)\nstep time vs plain on "
        f"{environment['device']}, "
        f"median of {environment['rounds']} interleaved rounds",
        fontsize=10,
    )


def _draw_timeline(
    timelines: dict[str, list[TimelineEntry]], figure: Any, summary: dict[str, Any]
) -> None:
    from matplotlib.lines import Line2D

    variants = summary["groups"]["blocks"]["variants"]
    axes = figure.subplots(2, 1, sharex=True, sharey=True)
    for ax, name in zip(axes, ("plain", "ckptlib")):
        timeline = timelines[f"blocks/{name}"]
        ax.plot(
            [e.index for e in timeline],
            [e.live_bytes / MiB for e in timeline],
            color="0.6",
            linewidth=0.6,
        )
        for phase, colour in PHASE_COLOURS.items():
            points = [e for e in timeline if e.phase == phase]
            # Rasterised: thousands of dots would make the SVG heavy for no visible gain.
            ax.scatter(
                [e.index for e in points],
                [e.live_bytes / MiB for e in points],
                s=3,
                color=colour,
                rasterized=True,
            )
        ax.set_ylabel("live MiB")
        ax.set_title(
            f"{variants[name]['label']}: peak {format_bytes(variants[name]['peak_bytes'])}",
            fontsize=9,
        )
        ax.grid(alpha=0.3)
    markers = [
        Line2D([], [], marker="o", linestyle="none", color=colour, label=phase)
        for phase, colour in PHASE_COLOURS.items()
    ]
    axes[0].legend(handles=markers, loc="upper right")
    axes[1].set_xlabel("aten op index within one training step")
    saving = 1 - variants["ckptlib"]["memory_vs_plain"]
    figure.suptitle(
        f"One training step: per-block checkpointing lowers the peak by {saving * 100:.0f}%, "
        "recomputing in backward\n" + summary["groups"]["blocks"]["model"],
        fontsize=10,
    )


def _draw_scaling(figure: Any, summary: dict[str, Any]) -> None:
    from matplotlib.ticker import FuncFormatter

    scaling = summary["scaling"]
    ax = figure.add_subplot()
    ns = scaling["ns"]
    for name, record in scaling["modes"].items():
        fit = record["power_fit"]
        line = ax.plot(ns, [p / MiB for p in record["peak_bytes"]], marker="o", linestyle="none")[0]
        ax.plot(
            ns,
            [fit["coefficient"] * n ** fit["exponent"] / MiB for n in ns],
            color=line.get_color(),
            linewidth=1,
            label=f"{name}: fit n^{fit['exponent']:.2f}",
        )
    fit = scaling["modes"]["recursive"]["log_fit"]
    ax.plot(
        ns,
        [(fit["intercept"] + fit["per_doubling"] * math.log2(n)) / MiB for n in ns],
        color="black",
        linewidth=1,
        linestyle="--",
        label="recursive: fit a + b log2(n)",
    )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.set_xlabel("chain length n (layers)")
    ax.set_ylabel("activation peak of one step (MiB)")
    modes = scaling["modes"]
    figure.suptitle(
        f"sqrt(n) segments: memory grows like n^{modes['sqrt']['power_fit']['exponent']:.2f}\n"
        f"recursive: +{format_bytes(modes['recursive']['log_fit']['per_doubling'])} per doubling "
        f"of n "
        f"(log fit R²={modes['recursive']['log_fit']['r2']:.2f})\n{scaling['model']}",
        fontsize=9,
    )
    ax.legend(title="measured (dots) and fits (lines)")
    ax.grid(alpha=0.3, which="both")


def _draw_forward_calls(figure: Any, summary: dict[str, Any]) -> None:
    scaling = summary["scaling"]
    ax = figure.add_subplot()
    ns = scaling["ns"]
    mismatches = 0
    for name, record in scaling["modes"].items():
        line = ax.plot(
            ns,
            [s / n for s, n in zip(record["plan_forward_steps"], ns)],
            linewidth=1,
            label=f"{name}: plan.forward_steps",
        )[0]
        ax.plot(
            ns,
            [(c - n) / n for c, n in zip(record["forward_calls"], ns)],
            marker="o",
            linestyle="none",
            color=line.get_color(),
            label=f"{name}: counted calls - n",
        )
        mismatches += forward_mismatches(record)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel("chain length n (layers)")
    ax.set_ylabel("recomputed layer forwards per step / n")
    verdict = (
        "counted forward calls equal the plans' at every n"
        if mismatches == 0
        else f"{mismatches} runs differ from their plan's forward calls"
    )
    figure.suptitle(f"Recomputation work: {verdict}\n{scaling['model']}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
