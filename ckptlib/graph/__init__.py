"""Autograd graphs you can look at: what each node saves, what a checkpoint dropped and recomputed.

>>> import torch
>>> x = torch.randn(3, requires_grad=True)
>>> graph = autograd_graph(x.exp().sin(), params={"x": x})
>>> graph
AutogradGraph(4 nodes, saved 12 B, dropped 0 B)

The package has two halves. What a graph *is*:

- :mod:`~ckptlib.graph.nodes`: :class:`SavedTensor`, :class:`GraphNode`,
  :class:`AutogradGraph` (plain, frozen data) and :func:`with_statuses`;
- :mod:`~ckptlib.graph.walk`: :func:`autograd_graph`, which walks ``grad_fn``
  and reads every saved tensor without recomputing it;
- :mod:`~ckptlib.graph.modules`: :func:`trace_modules`, which submodule made which node.

How it is *drawn*:

- :mod:`~ckptlib.graph.text`: ``print(graph)``, one line per node;
- :mod:`~ckptlib.graph.dot`: :func:`to_dot`, DOT with torchviz's colours and the
  saved tensors' states; :class:`NotebookDigraph`, a Digraph that shows itself;
- :mod:`~ckptlib.graph.render`: :func:`render_svg` and :func:`render_png`, with
  system Graphviz or Graphviz compiled to WebAssembly;
- :mod:`~ckptlib.graph.raster`: the PNG drawn with matplotlib when there is no
  system Graphviz;
- :mod:`~ckptlib.graph.notebook`: :func:`torchviz_dot` and :class:`SideBySide`.

The layers import downwards only: data (``nodes``, ``modules``) <- build (``walk``) <- draw
(``text``, ``dot``) <- display (``render``, ``raster``, ``notebook``). Where data shows itself
(``print(graph)``, a graph or a DOT drawing as a notebook's cell value) it calls the functions
this package hands to :data:`~ckptlib.graph.nodes.VIEWS` below.
"""

from __future__ import annotations

from ckptlib.graph.dot import LEGEND, STYLES, NotebookDigraph, to_dot
from ckptlib.graph.modules import ModuleTrace, trace_modules
from ckptlib.graph.nodes import (
    STATUSES,
    VIEWS,
    AutogradGraph,
    GraphNode,
    SavedTensor,
    with_statuses,
)
from ckptlib.graph.notebook import SideBySide, torchviz_dot
from ckptlib.graph.render import NO_RENDERER, png_for_display, render_png, render_svg
from ckptlib.graph.text import graph_text
from ckptlib.graph.walk import TORCH_CHECKPOINT, autograd_graph

VIEWS.text, VIEWS.svg, VIEWS.png = graph_text, render_svg, png_for_display

__all__ = [
    "autograd_graph",
    "to_dot",
    "render_svg",
    "render_png",
    "trace_modules",
    "torchviz_dot",
    "SideBySide",
    "AutogradGraph",
    "GraphNode",
    "SavedTensor",
    "ModuleTrace",
    "NotebookDigraph",
    "with_statuses",
    "STATUSES",
    "TORCH_CHECKPOINT",
    "NO_RENDERER",
    "STYLES",
    "LEGEND",
]
