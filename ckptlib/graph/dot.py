"""Drawing an AutogradGraph as DOT: torchviz's colours, plus saved-tensor states and module boxes.

Design notes
============

Colours. Leaves light blue and ops grey, as torchviz draws them; the saved tensors'
states in the colours of :mod:`ckptlib.palette`, the same in every picture of the course:
saved green, a tensor a checkpoint dropped a dashed white box (light purple once
recomputed) inside a dashed purple box for its checkpoint region (purple: recomputation),
a freed one light grey and dotted, a modified one red. The output is a white box with a
bold border (torchviz's green would read as "saved").

What is counted is what is drawn. The caption gives the totals of
:class:`AutogradGraph` (``saved_bytes``, ``dropped_bytes``), and every box with
bytes on it says whether they are in them: green boxes and those with a dashed
grey or purple border are counted (a view of a larger storage says so, as the storage counts
once); a saved leaf is the leaf's own memory, drawn as an edge to the leaf's node, or as a
pale box "leaf, not counted" when the leaf is not in the graph (an input that
needs no grad, a buffer); a dropped tensor whose dropping freed nothing (the
checkpoint's own input, or a tensor held elsewhere: kept by a node outside the
checkpoint, or the next checkpoint's input) has a pale dashed border and says
"frees nothing": the fill gives its state, the border whether its bytes count.

One box per memory. Kept tensors that are one view of one memory share a box
(``exp``'s result is ``sin``'s input), with one dashed edge per node that saves
it; so do dropped tensors that are one autograd output (a ReLU's result, the
next Linear's ``mat1``). When the sharers are in different states (a replay marks one freed while
another node still holds it), the box shows the most alive state: the memory
is there while anyone holds it. A collapsed module's box counts the memory
its nodes save once in the whole picture: a tensor that one module outputs and
the next takes in is counted in one of them, so the boxes add up to the caption.
"""

from __future__ import annotations

import graphviz
import torch

from ckptlib import palette
from ckptlib._arguments import flag, integer
from ckptlib.graph.nodes import (
    DROPPED,
    KEPT,
    VIEWS,
    AutogradGraph,
    GraphNode,
    SavedTensor,
    bytes_text,
    dtype_text,
    shape_text,
)
from ckptlib.graph.walk import build_graph

__all__ = ["to_dot", "NotebookDigraph", "STYLES", "LEGEND", "memory_key"]

# Not counted: the border of a dropped or recomputed tensor whose bytes are in no total.
UNCOUNTED_BORDER = "grey75"
STYLES: dict[str, dict[str, str]] = {
    "leaf": {"fillcolor": "lightblue"},
    "output": {"fillcolor": "white", "penwidth": "2"},
    "op": {"fillcolor": "lightgrey"},
    "kept": {"fillcolor": palette.SAVED},
    "saved leaf": {"fillcolor": "aliceblue", "color": "grey50", "style": "filled,dashed"},
    "dropped": {"fillcolor": "white", "color": palette.DROPPED, "style": "filled,dashed"},
    "frees nothing": {
        "fillcolor": "white",
        "color": UNCOUNTED_BORDER,
        "style": "filled,dashed",
        "fontcolor": "grey35",
    },
    "recomputed": {
        "fillcolor": palette.RECOMPUTED,
        "color": palette.RECOMPUTE,
        "style": "filled,dashed",
    },
    "recomputed, frees nothing": {
        "fillcolor": palette.RECOMPUTED,
        "color": UNCOUNTED_BORDER,
        "style": "filled,dashed",
        "fontcolor": "grey35",
    },
    "freed": {"fillcolor": palette.RELEASED, "color": "grey50", "style": "filled,dotted"},
    "modified": {"fillcolor": "tomato"},
    # Not an op's grey: the legend's samples are flat boxes, so the fill alone tells them apart.
    "module": {"fillcolor": "#E8DFCC", "shape": "box3d"},
    "module dropped": {
        "fillcolor": "white",
        "color": palette.DROPPED,
        "style": "filled,dashed",
        "shape": "box3d",
    },
    "module recomputed": {
        "fillcolor": palette.RECOMPUTED,
        "color": palette.RECOMPUTE,
        "style": "filled,dashed",
        "shape": "box3d",
    },
}
LEGEND = {
    "leaf": "leaf (gets .grad)",
    "output": "output",
    "op": "backward op",
    "kept": "saved by autograd (counted)",
    "saved leaf": "a leaf's own memory (not counted)",
    "dropped": "dropped by checkpoint (counted)",
    "frees nothing": "dropped, held elsewhere: frees nothing",
    "recomputed": "recomputed in backward (counted)",
    "recomputed, frees nothing": "recomputed; dropping it freed nothing",
    "freed": "freed by backward",
    "modified": "modified in place: backward fails",
    "module": "module (collapsed): its memory, counted once",
    "module dropped": "module, checkpointed",
    "module recomputed": "module, recomputed",
}
# Courier, not "monospace": Graphviz sizes boxes from a font's metrics, and the WebAssembly build
# knows Courier's (every glyph 0.6 em) but measures "monospace" as a narrower proportional font,
# so browsers' monospace text would overflow its boxes.
FONT = "Courier"
_NODE_ATTR = {
    "style": "filled",
    "shape": "box",
    "align": "left",
    "fontsize": "10",
    "ranksep": "0.1",
    "height": "0.2",
    "fontname": FONT,
}
# A box shared by saved tensors in different states shows the first of these that one of them is in.
_MOST_ALIVE_FIRST = ("modified", "kept", "recomputed", "dropped", "freed")


class NotebookDigraph(graphviz.Digraph):
    """A ``graphviz.Digraph`` that displays in a notebook through :func:`render_svg` (no system
    Graphviz needed), with a PNG beside the SVG for viewers that do not show SVG (an untrusted
    notebook in JupyterLab, GitHub) and a one-line text form. ``.render()``/``.pipe()`` still
    need system Graphviz."""

    summary: str = ""
    # Where each thing is drawn, for a picture that restyles boxes later (the backward stepper):
    # (node id, saved attribute) -> the id of its box (or of the leaf it is an edge to), and,
    # with collapse="module", node id -> the id of its module's box.
    saved_boxes: dict[tuple[str, str], str]
    module_boxes: dict[str, str]

    def __repr__(self) -> str:
        summary = self.summary or f"{sum('->' in line for line in self.body)} edges"
        return f"NotebookDigraph({summary})"

    # Pictures are the display layer's (ckptlib.graph.render), handed over in nodes.VIEWS.
    def _repr_image_svg_xml(self) -> str:
        return VIEWS.svg(self)

    def _repr_png_(self) -> tuple[bytes, dict[str, int]] | None:
        return VIEWS.png(self)


def to_dot(
    graph: AutogradGraph | torch.Tensor,
    collapse: str | None = None,
    *,
    depth: int = 2,
    legend: bool = True,
) -> NotebookDigraph:
    """Draw ``graph`` (or the graph behind a tensor) as DOT: ops grey, leaves blue, outputs white
    with a bold border, saved tensors green (:mod:`ckptlib.palette`).

    Saved tensors hang off their node (dashed edges, labelled with the attribute
    name); a saved leaf points at the leaf itself (a pale box "leaf, not counted"
    when no node stands for it). Tensors a checkpoint dropped are dashed white
    boxes (light purple once recomputed) inside a dashed purple box for their checkpoint
    region; a pale border marks those whose dropping frees nothing. The caption's totals
    add exactly the boxes that say they are counted. ``collapse="module"`` draws each submodule,
    cut at
    ``depth`` path components (``blocks.3.attn`` -> ``blocks.3``), as one box
    with its op count and bytes; this needs a graph built with ``modules=``.

    >>> import torch
    >>> from ckptlib.graph import autograd_graph
    >>> x = torch.randn(3, requires_grad=True)
    >>> dot = to_dot(autograd_graph(x.exp().sin(), params={"x": x}), legend=False)
    >>> print(dot.source.strip())  # doctest: +NORMALIZE_WHITESPACE
    digraph {
        node [align=left fontname=Courier fontsize=10 height=0.2 ranksep=0.1 shape=box style=filled]
        out0 [label="output
    (3,)" fillcolor=white penwidth=2]
        n0 [label=SinBackward0 fillcolor=lightgrey]
        "n0.self" [label="(3,) float32
    12 B" fillcolor="#55A868"]
        n1 [label=ExpBackward0 fillcolor=lightgrey]
        n2 [label="x
    (3,)" fillcolor=lightblue]
        n0 -> "n0.self" [label=self arrowhead=none fontsize=8 style=dashed]
        n1 -> "n0.self" [label=result arrowhead=none fontsize=8 style=dashed]
        n1 -> n0
        n2 -> n1
        n0 -> out0
    }
    """
    if isinstance(graph, torch.Tensor):
        graph = build_graph(graph, None, None, caller="to_dot")
    elif not isinstance(graph, AutogradGraph):
        raise TypeError(
            f"to_dot: graph must be an AutogradGraph (from autograd_graph) or a tensor that "
            f"requires grad, got {type(graph).__name__}."
        )
    if collapse is not None and not isinstance(collapse, str):
        raise TypeError(
            f"to_dot: collapse must be None (every node) or 'module' (one box per submodule), "
            f"got {type(collapse).__name__}."
        )
    if collapse not in (None, "module"):
        raise ValueError(
            f"to_dot: collapse={collapse!r} is not known; use None (every node) or "
            "'module' (one box per submodule)."
        )
    integer(depth, "depth (module path components kept)", where="to_dot")
    if depth < 1:
        raise ValueError(
            f"to_dot: depth={depth} keeps no part of a module path; use depth >= 1 "
            "(1: 'blocks', 2: 'blocks.3', ...)."
        )
    flag(legend, "legend", where="to_dot")
    dot = NotebookDigraph(node_attr=_NODE_ATTR)
    dot.saved_boxes, dot.module_boxes = {}, {}
    if collapse is None:
        used = _draw_nodes(dot, graph, graph.nodes)
    else:
        used = _draw_modules(dot, graph, depth)
    caption = (
        f"saved by autograd: {bytes_text(graph.saved_bytes)}; dropped by checkpoints: "
        f"{bytes_text(graph.dropped_bytes)}"
    )
    if legend:
        _draw_legend(dot, used, caption)
    dot.summary = f"{len(graph.ops)} autograd nodes; {caption}"
    return dot


_SavedEdge = tuple[
    str, str, SavedTensor, bool
]  # node id, saved-tensor box or leaf id, the tensor, to a leaf


def _draw_nodes(dot: graphviz.Digraph, graph: AutogradGraph, nodes: list[GraphNode]) -> list[str]:
    """``nodes`` with their saved tensors, checkpoint regions as dashed clusters, then the edges
    (last: an edge written inside a cluster would pull its far end into it). Returns the styles
    used."""
    leaf_of_storage = {
        node.storage: node.id for node in nodes if node.kind == "leaf" and node.storage is not None
    }
    boxes = _Boxes(nodes, leaf_of_storage)
    regions: dict[str, list[GraphNode]] = {}
    for node in nodes:
        if node.region is not None:
            regions.setdefault(node.region, []).append(node)
    for node in nodes:
        if node.region is None:
            boxes.draw(dot, node)
        elif node is regions[node.region][0]:  # draw the whole region where it is first met
            number = list(regions).index(node.region)
            with dot.subgraph(name=f"cluster_checkpoint{number}") as cluster:
                cluster.attr(
                    label=f"checkpoint {node.region}",
                    style="dashed",
                    color=palette.RECOMPUTE,
                    fontname=FONT,
                    fontsize="10",
                )
                for member in regions[node.region]:
                    boxes.draw(cluster, member)
    for src, dst, saved, to_leaf in boxes.edges:
        if isinstance(dot, NotebookDigraph):
            dot.saved_boxes[src, saved.name] = dst
        # An edge to a leaf must not rank it: the leaf stays above the ops that use it.
        extra = {"constraint": "false"} if to_leaf else {}
        if saved.status == "freed":
            extra["color"] = "grey60"
        dot.edge(
            src, dst, label=saved.name, arrowhead="none", style="dashed", fontsize="8", **extra
        )
    wanted = {node.id for node in nodes}
    for src, dst in graph.edges:
        if src in wanted and dst in wanted:
            dot.edge(src, dst)
    return boxes.used


def memory_key(node: GraphNode, saved: SavedTensor) -> tuple:
    """What one box stands for: saved tensors with the same key are one memory, drawn once."""
    return saved.view if saved.view is not None else (node.id, saved.name)


class _Boxes:
    """Draws nodes and their saved-tensor boxes, one box per memory (see "One box per memory")."""

    def __init__(self, nodes: list[GraphNode], leaf_of_storage: dict[int | None, str]) -> None:
        self.leaf_of_storage = leaf_of_storage
        self.used: list[str] = []
        self.edges: list[_SavedEdge] = []
        self.box_of: dict[tuple, str] = {}  # memory -> the id of its box, once drawn
        sharers: dict[tuple, list[SavedTensor]] = {}
        for node in nodes:
            for saved in node.saved:
                sharers.setdefault(memory_key(node, saved), []).append(saved)
        # The tensor each box is drawn from: the first sharer in the most alive state.
        self.face = {
            key: min(group, key=lambda s: _MOST_ALIVE_FIRST.index(s.status))
            for key, group in sharers.items()
        }

    def draw(self, place: graphviz.Digraph, node: GraphNode) -> None:
        """The node and its saved-tensor boxes into ``place``; the dashed edges to them into
        ``edges``."""
        if node.kind == "op":
            label = node.op if node.module is None else f"{node.op}\n{node.module or '(top level)'}"
        else:
            label = f"{node.name or node.kind}\n{shape_text(node.shape)}"
        _use(self.used, node.kind)
        place.node(node.id, label, **STYLES[node.kind])
        for saved in node.saved:
            if saved.of_leaf and saved.storage in self.leaf_of_storage:
                # A saved leaf is the leaf itself: no copy, so no box of its own.
                self.edges.append((node.id, self.leaf_of_storage[saved.storage], saved, True))
                continue
            key = memory_key(node, saved)
            if key not in self.box_of:
                self.box_of[key] = f"{node.id}.{saved.name}"
                face = self.face[key]
                style = _saved_style(face)
                _use(self.used, style)
                place.node(self.box_of[key], _saved_label(face), **STYLES[style])
            self.edges.append((node.id, self.box_of[key], saved, False))


def _saved_style(saved: SavedTensor) -> str:
    if saved.of_leaf and saved.status in ("kept", "dropped", "recomputed"):
        return "saved leaf"
    if saved.status in ("dropped", "recomputed") and not saved.frees_memory:
        return "frees nothing" if saved.status == "dropped" else "recomputed, frees nothing"
    return saved.status


def _saved_label(saved: SavedTensor) -> str:
    lines = [saved.tensor_name] if saved.tensor_name else []
    if saved.shape is not None:
        lines.append(f"{shape_text(saved.shape)} {dtype_text(saved.dtype)}")
        size = bytes_text(saved.nbytes)
        if saved.status == "kept" and not saved.of_leaf and saved.storage_nbytes > saved.nbytes:
            size += f" of a {bytes_text(saved.storage_nbytes)} storage"
        lines.append(size)
    style = _saved_style(saved)
    if style == "saved leaf":
        kind = saved.leaf_kind or "leaf"
        lines.append(f"{kind}, not counted" if saved.status == "kept" else f"{kind}, kept")
    elif style in ("frees nothing", "recomputed, frees nothing"):
        lines += [saved.status, "frees nothing"]
    elif saved.status != "kept":
        lines.append(saved.status)
    return "\n".join(lines)


def _use(used: list[str], style: str) -> None:
    if style not in used:
        used.append(style)


def _draw_modules(dot: graphviz.Digraph, graph: AutogradGraph, depth: int) -> list[str]:
    """One box per submodule (cut at ``depth``); nodes made outside every module drawn as usual."""
    if not any(node.module is not None for node in graph.nodes):
        raise ValueError(
            "to_dot(collapse='module') needs to know which module made each node. Build the graph "
            "from a traced forward:\n    with trace_modules(model) as modules:\n        loss = "
            "model(x).sum()\n    graph = autograd_graph(loss, modules=modules)"
        )
    groups: dict[str, list[GraphNode]] = {}
    loose: list[GraphNode] = []
    for node in graph.nodes:
        if node.module is None:
            loose.append(node)
        else:
            groups.setdefault(".".join(node.module.split(".")[:depth]), []).append(node)
    box_of = {
        member.id: f"m{number}"
        for number, members in enumerate(groups.values())
        for member in members
    }
    if isinstance(dot, NotebookDigraph):
        dot.module_boxes.update(box_of)
    used = _draw_nodes(dot, graph, loose)
    saved_bytes = _charged_bytes(loose, groups, KEPT)
    dropped_bytes = _charged_bytes(loose, groups, DROPPED)
    for number, (path, members) in enumerate(groups.items()):
        style = _module_style(members)
        _use(used, style)
        label = _module_label(path, members, graph.module_types, saved_bytes[path],
                              dropped_bytes[path])
        dot.node(f"m{number}", label, **STYLES[style])
    boxes = set(box_of.values())
    edges: dict[tuple[str, str], None] = {}  # a dict keeps first-seen order, a set would not
    for src, dst in graph.edges:
        src, dst = box_of.get(src, src), box_of.get(dst, dst)
        if src != dst and (src in boxes or dst in boxes):
            edges.setdefault((src, dst))
    for src, dst in edges:
        dot.edge(src, dst)
    return used


def _charged_bytes(loose: list[GraphNode], groups: dict[str, list[GraphNode]],
                   statuses: tuple[str, ...]) -> dict[str, int]:
    """Bytes per module box of the saved tensors in ``statuses`` (kept, or dropped), each memory
    counted once in the picture: the boxes of nodes outside every module show their own bytes,
    so their memory is theirs; memory several modules save is counted in the first met from the
    outputs (the last to use it in forward)."""
    charged = {
        _memory(node, s) for node in loose for s in node.saved
        if s.status in statuses and s.counted
    }
    module_bytes = {}
    for path, members in groups.items():
        total = 0
        for node in members:
            for saved in node.saved:
                memory = _memory(node, saved)
                if saved.status in statuses and saved.counted and memory not in charged:
                    charged.add(memory)
                    total += saved.storage_nbytes if saved.storage is not None else saved.nbytes
        module_bytes[path] = total
    return module_bytes


def _memory(node: GraphNode, saved: SavedTensor) -> tuple:
    return ("storage", saved.storage) if saved.storage is not None else (node.id, saved.name)


def _module_style(members: list[GraphNode]) -> str:
    if any(node.recomputed for node in members):
        return "module recomputed"
    if any(node.dropped for node in members):
        return "module dropped"
    return "module"


def _module_label(
    path: str, members: list[GraphNode], module_types: dict[str, str], saved_bytes: int,
    dropped_bytes: int,
) -> str:
    ops = [node for node in members if node.kind == "op"]
    leaves = [node for node in members if node.kind == "leaf"]
    parameter_bytes = sum(torch.Size(n.shape).numel() * n.dtype.itemsize for n in leaves)
    lines = [
        f"{path or '(top level)'}: {module_types.get(path, '?')}",
        f"{len(ops)} ops, {len(leaves)} leaves ({bytes_text(parameter_bytes)})",
        f"saved {bytes_text(saved_bytes)}",
    ]
    if dropped_bytes:
        lines.append(f"dropped {bytes_text(dropped_bytes)}")
    return "\n".join(lines)


def _draw_legend(dot: graphviz.Digraph, used: list[str], caption: str) -> None:
    # One node holding a small table (a colour sample and its words per row): a compact block
    # beside the graph. One node per entry would be spread over the graph's ranks, as tall as it.
    shown = [style for style in STYLES if style in used]
    rows = "".join(_legend_row(style) for style in shown)
    with dot.subgraph(name="cluster_legend") as legend:
        legend.attr(label="legend", fontname=FONT, fontsize="10", color="grey70")
        legend.node(
            "legend.table",
            f'<<TABLE BORDER="0" CELLSPACING="3" CELLPADDING="1">{rows}</TABLE>>',
            shape="plaintext",
            style="",
            fillcolor="",
        )
    dot.attr(label=caption, fontname=FONT, fontsize="10")


def _legend_row(style: str) -> str:
    """One legend row: a sample drawn as ``STYLES[style]`` draws a box, then its meaning."""
    attributes = STYLES[style]
    line = attributes.get("style", "")
    dash = ' STYLE="dashed"' if "dashed" in line else ' STYLE="dotted"' if "dotted" in line else ""
    sample = (
        '<TD WIDTH="22" HEIGHT="12" FIXEDSIZE="TRUE" BORDER="1" '
        f'BGCOLOR="{attributes["fillcolor"]}" '
        f'COLOR="{attributes.get("color", "black")}"{dash}></TD>'
    )
    return f'<TR>{sample}<TD ALIGN="LEFT">{LEGEND[style]}</TD></TR>'
