"""Graphviz's SVG drawn again with matplotlib, as a PNG, for machines without system Graphviz.

Design notes
============

Graphviz compiled to WebAssembly writes SVG but no PNG, and the notebook needs
a PNG for viewers that do not show SVG (see :mod:`ckptlib.graph.render`).
Graphviz's SVG is a small language: one ``<g>`` with a ``scale ... translate``
transform around polygons, polylines, ellipses, paths made of one move and
cubic Bezier segments, and text placed at its baseline, with fill, stroke,
dash pattern and font as attributes. This module draws exactly those shapes on
a matplotlib canvas of the SVG's size in points (one SVG unit is one point), so
the PNG has Graphviz's layout, colours and labels. matplotlib is imported only
when a PNG is drawn, so importing ``ckptlib.graph`` stays light.
"""

from __future__ import annotations

import io
import re
import xml.etree.ElementTree as ET
from typing import Any

__all__ = ["svg_to_png"]

_SVG = "{http://www.w3.org/2000/svg}"
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e-?\d+)?")
_FONTS = {"monospace": "monospace", "courier": "monospace", "times": "serif", "serif": "serif"}
_ANCHORS = {"start": "left", "middle": "center", "end": "right"}


def svg_to_png(svg: str, *, dpi: int = 96) -> bytes:
    """A PNG of a Graphviz SVG, at ``dpi`` dots per inch.

    >>> png = svg_to_png('<svg xmlns="http://www.w3.org/2000/svg" width="20pt" height="10pt" '
    ...                  'viewBox="0 0 20 10"><g><polygon fill="orange" stroke="black" '
    ...                  'points="1,1 19,1 19,9 1,9"/></g></svg>')
    >>> png[:4] == b"\\x89PNG"
    True
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # heavy: only when a PNG is drawn
    from matplotlib.figure import Figure

    if not isinstance(svg, str):
        raise TypeError(
            "svg_to_png: svg must be the SVG text Graphviz wrote (a str), "
            f"got {type(svg).__name__}."
        )
    try:
        root = ET.fromstring(svg.encode("utf-8"))
    except ET.ParseError as error:
        raise ValueError(
            f"svg_to_png: the text is not SVG ({error}); pass what render_svg returns."
        ) from None
    if root.tag != f"{_SVG}svg":
        raise ValueError(
            f"svg_to_png: the document is a <{root.tag}>, not an SVG; pass what render_svg returns."
        )
    width, height = (_points(root.get(side)) for side in ("width", "height"))
    figure = Figure(figsize=(width / 72, height / 72), dpi=dpi)
    FigureCanvasAgg(figure)
    axes = figure.add_axes((0, 0, 1, 1))
    axes.set_xlim(0, width)
    axes.set_ylim(height, 0)  # SVG's y axis points down
    axes.set_axis_off()
    _draw_group(axes, root, (1.0, 1.0, 0.0, 0.0))
    out = io.BytesIO()
    figure.savefig(out, format="png", dpi=dpi, facecolor="white")
    return out.getvalue()


def _points(length: str | None) -> float:
    if length is None:
        raise ValueError("svg_to_png: the SVG has no width or height; pass the SVG Graphviz wrote.")
    return float(_NUMBER.match(length).group())


def _draw_group(
    axes: Any, element: ET.Element, transform: tuple[float, float, float, float]
) -> None:
    """Draw ``element``'s children; ``transform`` is (scale x, scale y, translate x,
    translate y)."""
    for child in element:
        tag = child.tag.removeprefix(_SVG)
        if tag in ("g", "a"):
            _draw_group(axes, child, _combined(transform, child.get("transform")))
        elif tag in ("polygon", "polyline", "ellipse", "path"):
            _draw_shape(axes, tag, child, transform)
        elif tag == "text":
            _draw_text(axes, child, transform)


def _combined(
    transform: tuple[float, float, float, float], text: str | None
) -> tuple[float, float, float, float]:
    """Graphviz writes ``scale(sx sy) rotate(0) translate(tx ty)``: a point p goes to
    s * (p + t)."""
    if not text:
        return transform
    scale = re.search(r"scale\(([^)]*)\)", text)
    shift = re.search(r"translate\(([^)]*)\)", text)
    sx, sy = (list(map(float, _NUMBER.findall(scale.group(1)))) * 2)[:2] if scale else (1.0, 1.0)
    tx, ty = (
        (list(map(float, _NUMBER.findall(shift.group(1)))) + [0.0])[:2] if shift else (0.0, 0.0)
    )
    outer_sx, outer_sy, outer_tx, outer_ty = transform
    # outer(inner(p)) = outer_s * (s * (p + t) + outer_t)
    return outer_sx * sx, outer_sy * sy, outer_tx / sx + tx, outer_ty / sy + ty


def _apply(transform: tuple[float, float, float, float], x: float, y: float) -> tuple[float, float]:
    sx, sy, tx, ty = transform
    return sx * (x + tx), sy * (y + ty)


def _colour(value: str | None) -> str:
    return "none" if value in (None, "none", "transparent") else value


def _stroke_style(element: ET.Element) -> dict[str, Any]:
    style: dict[str, Any] = {
        "edgecolor": _colour(element.get("stroke", "none")),
        "linewidth": float(element.get("stroke-width", "1")),
    }
    dashes = element.get("stroke-dasharray")
    if dashes:
        style["linestyle"] = (0, tuple(float(n) for n in _NUMBER.findall(dashes)))
    return style


def _draw_shape(
    axes: Any, tag: str, element: ET.Element, transform: tuple[float, float, float, float]
) -> None:
    from matplotlib.patches import Ellipse, PathPatch, Polygon  # heavy: only when a PNG is drawn
    from matplotlib.path import Path

    style = _stroke_style(element)
    fill = _colour(element.get("fill", "black"))
    if tag == "ellipse":
        cx, cy = _apply(transform, float(element.get("cx")), float(element.get("cy")))
        patch = Ellipse(
            (cx, cy),
            2 * float(element.get("rx")) * transform[0],
            2 * float(element.get("ry")) * transform[1],
            facecolor=fill,
            **style,
        )
    elif tag == "path":
        numbers = list(map(float, _NUMBER.findall(element.get("d", ""))))
        points = [_apply(transform, x, y) for x, y in zip(numbers[::2], numbers[1::2])]
        if len(points) < 4:
            return
        points = points[: 1 + 3 * ((len(points) - 1) // 3)]  # a move, then whole Bezier segments
        codes = [Path.MOVETO] + [Path.CURVE4] * (len(points) - 1)
        patch = PathPatch(Path(points, codes), facecolor=fill, **style)
    else:
        numbers = list(map(float, _NUMBER.findall(element.get("points", ""))))
        points = [_apply(transform, x, y) for x, y in zip(numbers[::2], numbers[1::2])]
        if len(points) < 2:
            return
        patch = Polygon(
            points, closed=tag == "polygon", facecolor=fill if tag == "polygon" else "none", **style
        )
    axes.add_patch(patch)


def _draw_text(
    axes: Any, element: ET.Element, transform: tuple[float, float, float, float]
) -> None:
    text = "".join(element.itertext())
    if not text.strip():
        return
    x, y = _apply(transform, float(element.get("x", "0")), float(element.get("y", "0")))
    family = element.get("font-family", "serif").split(",")[0].strip().lower()
    axes.text(
        x,
        y,
        text,
        ha=_ANCHORS.get(element.get("text-anchor", "start"), "left"),
        va="baseline",
        fontsize=float(element.get("font-size", "14")) * transform[1],
        family=_FONTS.get(family, "sans-serif"),
        color=_colour(element.get("fill", "black")),
        fontweight=element.get("font-weight", "normal"),
        fontstyle=element.get("font-style", "normal"),
    )
