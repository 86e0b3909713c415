"""Graphs side by side in a notebook, and torchviz's ``make_dot`` beside ckptlib's, without
system Graphviz.

Design notes
============

Side by side. :class:`SideBySide` is HTML: a row of pictures, each with its
title above it. The pictures are ``<img>`` tags holding the SVG as a data
URI, not inline ``<svg>``: JupyterLab cleans the HTML of an untrusted
notebook, and its cleaner keeps ``img`` (embedded data included) but drops
``svg``. Each picture's share of the row is its natural width's share of the
row's, and no picture grows past its natural width; so in a wide output both
are at their natural size, in a narrow one both shrink by the same factor: one
scale, and nothing cut off.
"""

from __future__ import annotations

import base64
import html
import re
import warnings
from typing import Any, Sequence

import graphviz
import torch
from torch import nn

from ckptlib.graph.dot import STYLES, NotebookDigraph
from ckptlib.graph.nodes import AutogradGraph
from ckptlib.graph.render import render_svg
from ckptlib.graph.walk import Params, output_tensors

__all__ = ["torchviz_dot", "SideBySide"]

_GAP_PERCENT = 2.0  # between two pictures, of the row's width
_ROW_PERCENT = (
    99.0  # pictures and gaps; the rest keeps rounding from pushing the last one to a new line
)


def torchviz_dot(
    outputs: torch.Tensor | Sequence[torch.Tensor], params: Params = None, **make_dot_kwargs: Any
) -> NotebookDigraph:
    """torchviz's ``make_dot``, returned as a :class:`NotebookDigraph` so it displays anywhere.

    ``params`` may be an ``nn.Module`` (its named parameters) or a dict, as in
    :func:`autograd_graph`; other keywords (``show_attrs``, ``show_saved``) go
    to ``make_dot``. Its node names are ``id()`` values, so its source differs
    from run to run.

    One change to torchviz's colours: its light green output is drawn as ckptlib draws an
    output (white, bold border), because green means "saved by autograd" in every picture
    of the course (:mod:`ckptlib.palette`), and the two drawings are shown side by side.
    """
    tensors = output_tensors(outputs, "torchviz_dot")
    if isinstance(params, nn.Module):
        params = dict(params.named_parameters())
    elif params is not None and not isinstance(params, dict):
        raise TypeError(
            f"torchviz_dot: params must be an nn.Module or a dict name -> tensor, "
            f"got {type(params).__name__}."
        )
    output = tensors[0] if isinstance(outputs, torch.Tensor) else tuple(tensors)
    with warnings.catch_warnings():
        # torchviz 0.0.3 compares versions with distutils, which warns on every call.
        warnings.simplefilter("ignore", DeprecationWarning)
        from torchviz import make_dot  # optional: only this comparison picture needs it

        made = make_dot(output, params=params, **make_dot_kwargs)
    output_style = " ".join(f"{key}={value}" for key, value in STYLES["output"].items())
    dot = NotebookDigraph(
        body=[line.replace("fillcolor=darkolivegreen1", output_style) for line in made.body],
        graph_attr=made.graph_attr,
        node_attr=made.node_attr,
        edge_attr=made.edge_attr,
    )
    dot.summary = (
        f"torchviz make_dot, {sum('->' not in line and '[' in line for line in made.body)} boxes"
    )
    return dot


class SideBySide:
    """Graphs in one row of a notebook: ``SideBySide(torchviz_dot(y), autograd_graph(y))``.

    Takes anything :func:`render_svg` takes; ``titles`` go above each picture.
    Both pictures keep one scale, shrinking together when the row is narrow.
    """

    def __init__(self, *graphs: Any, titles: Sequence[str] = ()) -> None:
        if not graphs:
            raise ValueError(
                "SideBySide: give at least one graph, e.g. SideBySide(torchviz_dot(y), "
                "autograd_graph(y))."
            )
        for position, graph in enumerate(graphs):
            if not isinstance(
                graph,
                (
                    str,
                    graphviz.Digraph,
                    graphviz.Graph,
                    graphviz.Source,
                    AutogradGraph,
                    torch.Tensor,
                ),
            ):
                raise TypeError(
                    f"SideBySide: graph #{position} is of type {type(graph).__name__}; "
                    "pass DOT source, "
                    "a graphviz object, an AutogradGraph or a tensor that requires grad."
                )
        if isinstance(titles, str) or not all(isinstance(title, str) for title in titles):
            raise TypeError(
                f"SideBySide: titles must be a list of strings, one per graph, got {titles!r}."
            )
        if len(titles) > len(graphs):
            raise ValueError(
                f"SideBySide: {len(titles)} titles for {len(graphs)} graphs; give at most one "
                "title per graph."
            )
        self.graphs = graphs
        self.titles = list(titles) + [""] * (len(graphs) - len(titles))

    def __repr__(self) -> str:
        shown = ", ".join(
            repr(title) if title else f"graph #{i}" for i, title in enumerate(self.titles)
        )
        return f"SideBySide({shown})"

    def _repr_html_(self) -> str:
        pictures = [render_svg(graph) for graph in self.graphs]
        widths = [_width_px(svg) for svg in pictures]
        share = (_ROW_PERCENT - _GAP_PERCENT * (len(pictures) - 1)) / sum(widths)
        cells = []
        for number, (svg, title, width) in enumerate(zip(pictures, self.titles, widths)):
            gap = f" margin-right: {_GAP_PERCENT}%;" if number < len(pictures) - 1 else ""
            data = base64.b64encode(svg.encode("utf-8")).decode("ascii")
            cells.append(
                '<div style="display: inline-block; vertical-align: top; '
                f'width: {width * share:.3f}%;{gap}">'
                f'<div style="font-weight: bold; margin-bottom: 4px">{html.escape(title)}</div>'
                f'<img alt="{html.escape(title or "graph")}" '
                f'src="data:image/svg+xml;base64,{data}" '
                f'style="width: 100%; max-width: {width:.1f}px; height: auto"></div>'
            )
        return f'<div class="ckptlib-side-by-side" style="width: 100%">{"".join(cells)}</div>'


def _width_px(svg: str) -> float:
    """The width a browser gives the SVG: Graphviz writes it in points, 96/72 pixels each."""
    match = re.search(r'<svg[^>]*\swidth="([\d.]+)(pt|px)?"', svg)
    if match is None:
        raise ValueError("SideBySide: a picture has no width; was it made by Graphviz?")
    return float(match.group(1)) * (4 / 3 if match.group(2) == "pt" else 1)
