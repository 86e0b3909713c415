"""The report of a run: the text tables printed on stdout, and the Markdown tables of
``benchmarks/README.md``.

Both are drawn from the JSON summary alone (so ``--from-json`` reports a saved
run the same way). The Markdown shows ratios only: absolute times mean
something on one machine, ratios measured in the same interleaved rounds carry
over. ``write_markdown`` replaces what lies between two marker lines, so the
prose around the tables is kept.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Sequence

from benchmarks.bench.summary import check_summary
from benchmarks.bench.sweeps import forward_mismatches
from ckptlib.memory import format_bytes


def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A plain-text table: first column left-aligned, the others right-aligned.

    >>> print(format_table(["variant", "ratio"], [["plain", "1.00"], ["ckptlib", "0.45"]]))
    variant  ratio
    -------  -----
    plain     1.00
    ckptlib   0.45
    """
    cells = [[str(h) for h in headers]] + [
        ["" if c is None else str(c) for c in row] for row in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))
        ).rstrip()

    return "\n".join([line(cells[0]), line(["-" * w for w in widths]), *map(line, cells[1:])])


def _x(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _pct(value: float | None, digits: int = 0) -> str:
    return "n/a" if value is None else f"{value * 100:+.{digits}f}%"


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1e3:.1f} ms"


def _claim_rows(claims: dict[str, Any], quote: str) -> list[list[str]]:
    """Rows of the claims-vs-measured table: the seed article's claims, then our variants."""
    rows = [
        [f"claim: {c['claim']}", _span(c["memory_saving"], "-"), _span(c["time_overhead"], "+")]
        for c in claims["claims"]
    ]
    rows += [
        [
            f"measured: {quote}{m['variant']}{quote}",
            _pct(-m["memory_saving"]),
            _pct(m["time_overhead"]),
        ]
        for m in claims["measured"]
    ]
    return rows


def format_report(summary: dict[str, Any]) -> str:
    """The stdout report: one table per group, the claims, the sweeps and the targets."""
    check_summary(summary)
    env = summary["environment"]
    parts = [
        f"ckptlib.bench on {env['device']} ({env['device_name']}), torch {env['torch']}, "
        f"{_threads(env)}, {env['rounds']} interleaved rounds, {env['clock']} clock; "
        f"memory: {env['meter']} meter"
    ]
    for group in summary["groups"].values():
        rows = [
            [
                name,
                format_bytes(v["peak_bytes"]) if v["peak_bytes"] is not None else "-",
                _x(v["memory_vs_plain"]),
                _ms(v["median_s"]),
                _ms(v["iqr_s"]),
                _x(v["time_vs_plain"]),
                _x(v["time_vs_plain_iqr"]),
            ]
            for name, v in group["variants"].items()
        ]
        parts.append(
            f"\n{group['title']}: {group['model']}\n"
            + format_table(
                ["variant", "peak", "mem/plain", "median step", "IQR", "time/plain", "IQR"], rows
            )
        )
        for name, pair in group["pairs"].items():
            parts.append(
                f"{pair['numerator']} / {pair['denominator']}: memory {_x(pair['memory'])}, "
                f"time {_x(pair['time'])}"
            )
        for name, tradeoff in group["tradeoffs"].items():
            parts.append(
                f"{name}: keeps {_x(tradeoff['saving_kept'])} of {tradeoff['full']}'s saving, "
                f"pays {_x(tradeoff['extra_time_paid'])} of its extra time" + _reference(tradeoff)
            )
    overhead = summary["meter_overhead"]
    parts.append(
        f"\nLive-tensor meter: step time x{_x(overhead['peak'])} (peak only), "
        f"x{_x(overhead['timeline'])} (recording a timeline)"
    )
    parts.append(
        "\nThe seed article's claims next to ours (change vs plain)\n"
        + format_table(
            ["", "peak memory", "step time"], _claim_rows(summary["seed_claims"], quote="")
        )
    )
    depth = summary["depth"]
    rows = [
        [d]
        + [format_bytes(depth["peak_bytes"][name][i]) for name in depth["peak_bytes"]]
        + [_pct(depth["saving_vs_plain"]["ckptlib"][i])]
        for i, d in enumerate(depth["depths"])
    ]
    parts.append(
        f"\nPeak vs depth: {depth['model']}\n"
        + format_table(["depth", *depth["peak_bytes"], "ckptlib saving"], rows)
    )
    scaling = summary["scaling"]
    rows = [
        [n]
        + [
            f"{format_bytes(r['peak_bytes'][i])} "
            f"{r['forward_calls'][i]}/{r['plan_forward_calls'][i]}"
            for r in scaling["modes"].values()
        ]
        for i, n in enumerate(scaling["ns"])
    ]
    rows.append(
        ["n^p fit"]
        + [
            f"p={r['power_fit']['exponent']:.2f} R2={r['power_fit']['r2']:.3f}"
            for r in scaling["modes"].values()
        ]
    )
    rows.append(
        ["log2 n fit"]
        + [
            f"{format_bytes(r['log_fit']['per_doubling'])}/x2 R2={r['log_fit']['r2']:.3f}"
            for r in scaling["modes"].values()
        ]
    )
    parts.append(
        f"\nScaling: {scaling['model']}; peak, forward calls counted/planned\n"
        + format_table(["n", *scaling["modes"]], rows)
    )
    if summary["meter_agreement"] is not None:
        rows = [
            [
                name,
                format_bytes(r["allocator_bytes"]),
                format_bytes(r["tensors_bytes"]),
                _pct(r["relative_difference"], 2),
            ]
            for name, r in summary["meter_agreement"]["variants"].items()
        ]
        parts.append(
            "\nMeters on the same steps\n"
            + format_table(["variant", "allocator", "live tensors", "diff"], rows)
        )
    parts.append("\nTargets\n" + _targets_table(summary["targets"]))
    return "\n".join(parts)


def _threads(environment: dict[str, Any]) -> str:
    threads = environment["threads"]
    return f"{threads} CPU thread{'s' if threads != 1 else ''}"


def _interval(bounds: Sequence[float] | None) -> str:
    return "" if bounds is None else f" (95% interval {_x(bounds[0])} to {_x(bounds[1])})"


def _reference(tradeoff: dict[str, Any]) -> str:
    reference = tradeoff.get("earlier_measurement")
    if reference is None:
        return ""
    return (f" (an earlier run measured {reference['saving_kept']:.2f} and "
            f"{reference['extra_time_paid']:.2f})")


def _span(bounds: Sequence[float], sign: str) -> str:
    """``[0.3, 0.5]`` with sign ``-`` -> ``-30..50%``: a claimed range of changes."""
    low, high = bounds
    return f"{sign}{low * 100:.0f}%" if low == high else f"{sign}{low * 100:.0f}..{high * 100:.0f}%"


def _measured(target: dict[str, Any]) -> str:
    """A target's measured value, with its 95% interval where it has one."""
    value = target["value"]
    text = _x(value, 3) if isinstance(value, float) else str(value)
    return text + (
        f" ({_x(target['interval'][0])} to {_x(target['interval'][1])})"
        if "interval" in target
        else ""
    )


def _targets_table(targets: list[dict[str, Any]]) -> str:
    rows = [
        [
            t["name"],
            _measured(t),
            f"{t['op']} {t['threshold']}",
            {True: "met", False: "MISSED", None: "n/a"}[t["met"]],
            t["source"],
        ]
        for t in targets
    ]
    return format_table(["target", "measured", "goal", "", "from"], rows)


def _markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(["---"] * len(headers)) + "|"]
    lines += ["| " + " | ".join("" if c is None else str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def to_markdown(summary: dict[str, Any]) -> str:
    """The results as Markdown tables of ratios (absolute times only mean something per machine)."""
    check_summary(summary)
    env = summary["environment"]
    parts = [
        f"Measured on {env['device']} ({env['device_name']}), torch {env['torch']}, "
        f"{_threads(env)}, "
        f"{env['rounds']} interleaved rounds, {env['clock']} clock, `{env['meter']}` memory meter"
        + (" (`--quick`)" if env["quick"] else "")
        + "."
    ]
    for group in summary["groups"].values():
        rows = [
            [
                f"`{name}`",
                v["label"],
                _x(v["memory_vs_plain"]),
                _x(v["time_vs_plain"]),
                _x(v["time_vs_plain_iqr"]),
            ]
            for name, v in group["variants"].items()
        ]
        parts.append(
            f"**{group['title']}**: {group['model']}\n\n"
            + _markdown_table(
                ["variant", "what", "peak / plain", "step time / plain", "its IQR"], rows
            )
        )
        lines = [
            f"- `{p['numerator']}` / `{p['denominator']}`: memory {_x(p['memory'])}, "
            f"time {_x(p['time'])}"
            for p in group["pairs"].values()
        ]
        lines += [
            f"- `{name}` keeps {_x(t['saving_kept'])} of `{t['full']}`'s memory saving and pays "
            f"{_x(t['extra_time_paid'])}{_interval(t.get('extra_time_paid_interval'))} "
            "of its extra time"
            + _reference(t)
            for name, t in group["tradeoffs"].items()
        ]
        lines += [f"- {what}: {note}" for what, note in group.get("notes", {}).items()]
        parts.append("\n".join(lines))
    parts.append(
        "**The seed article's claims next to ours** (change vs plain)\n\n"
        + _markdown_table(
            ["", "peak memory", "step time"], _claim_rows(summary["seed_claims"], quote="`")
        )
    )
    overhead = summary["meter_overhead"]
    parts.append(
        f"**Live-tensor meter**: the plain step takes x{_x(overhead['peak'])} as long under "
        f"the meter (peak only), x{_x(overhead['timeline'])} recording a timeline."
    )
    depth = summary["depth"]
    rows = [
        [d]
        + [
            _x(depth["peak_bytes"][name][i] / depth["peak_bytes"]["plain"][i])
            for name in depth["peak_bytes"]
        ]
        for i, d in enumerate(depth["depths"])
    ]
    parts.append(
        f"**Peak / plain peak vs depth** ({depth['model']})\n\n"
        + _markdown_table(["depth", *depth["peak_bytes"]], rows)
    )
    if summary["meter_agreement"] is not None:
        rows = [
            [f"`{name}`", _pct(r["relative_difference"], 2)]
            for name, r in summary["meter_agreement"]["variants"].items()
        ]
        parts.append(
            "**Live-tensor meter vs CUDA allocator on the same steps**\n\n"
            + _markdown_table(["variant", "difference"], rows)
        )
    scaling = summary["scaling"]
    rows = [
        [
            name,
            f"{r['power_fit']['exponent']:.2f}",
            f"{r['power_fit']['r2']:.3f}",
            f"{r['log_fit']['r2']:.3f}",
            "yes" if forward_mismatches(r) == 0 else "no",
        ]
        for name, r in scaling["modes"].items()
    ]
    parts.append(
        f"**Scaling** ({scaling['model']}, n = {', '.join(map(str, scaling['ns']))})\n\n"
        + _markdown_table(
            [
                "plan",
                "exponent p of peak ~ n^p",
                "R² (power)",
                "R² (log2 n)",
                "forward calls as planned",
            ],
            rows,
        )
    )
    rows = [
        [
            t["name"],
            _measured(t),
            f"{t['op']} {t['threshold']}",
            {True: "met", False: "**missed**", None: "n/a"}[t["met"]],
            t["source"],
        ]
        for t in summary["targets"]
    ]
    parts.append(
        "**Targets**\n\n" + _markdown_table(["target", "measured", "goal", "", "from"], rows)
    )
    return "\n\n".join(parts) + "\n"


MARKDOWN_BEGIN = "<!-- bench results: begin (written by python -m benchmarks.bench --markdown) -->"
MARKDOWN_END = "<!-- bench results: end -->"


def write_markdown(path: Path | str, summary: dict[str, Any]) -> None:
    """Put :func:`to_markdown` between the two marker lines of ``path`` (appended if absent)."""
    path = Path(path)
    block = f"{MARKDOWN_BEGIN}\n\n{to_markdown(summary)}\n{MARKDOWN_END}"
    text = path.read_text() if path.exists() else ""
    if MARKDOWN_BEGIN in text and MARKDOWN_END in text:
        head, rest = text.split(MARKDOWN_BEGIN, 1)
        text = head + block + rest.split(MARKDOWN_END, 1)[1]
    else:
        text = (text.rstrip() + "\n\n" if text.strip() else "") + block + "\n"
    path.write_text(text)
