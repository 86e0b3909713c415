"""The backward stepper's picture: the autograd graph laid out once, each event only recoloured.

Design notes
============

One layout. Graphviz places boxes from their labels, so a graph drawn again with other
boxes or other words moves every node. The picture is therefore drawn once, from the graph
after forward with *every* saved tensor of the step in it (labelled with the name the
stepper's words use: ``block 1 #2``, ``saved #3``), and rendered to SVG once. An event
changes only the styles of that SVG's boxes and edges: fill, border, dashes. Node
positions, the scale and the legend never change, so what moves on screen is what
changed in the step.

What is not there yet. At the first event forward has made nothing: ops that forward has
not reached yet and tensors not packed yet are drawn pale (grey outline, grey text). A
node's autograd creation number (``_sequence_nr``) gives the forward's order; a node is
shown once a node made at or after it has saved a tensor, and every node once forward is
done.

The window. A graph of a few blocks is taller than a screen beside the controls. So the
picture shows a band of it: the whole width, as tall as fits beside the controls. The band
moves only when the event's box would leave it (it re-centres then), and a thin bar beside
it shows which part of the graph is in view. Sideways nothing is cut: the picture is never
drawn narrower than :data:`MIN_PX_PER_PT` keeps its text readable, and a graph wider than
the notebook scrolls sideways instead.

Colours are those of :mod:`ckptlib.palette`, the same in every picture of the course.
"""

from __future__ import annotations

import dataclasses
import html
import re
from dataclasses import dataclass
from typing import Any

from ckptlib import palette
from ckptlib.graph import AutogradGraph, render_svg, to_dot

__all__ = ["StepPicture", "STATE_STYLES", "NOT_YET", "MIN_PX_PER_PT"]

NOT_YET = "not packed yet"
# state -> (fill, border colour, dash pattern or None); the chips beside the graph use the same.
STATE_STYLES: dict[str, tuple[str, str, str | None]] = {
    NOT_YET: ("#FFFFFF", "#C8C8C8", "2,2"),
    "saved": (palette.SAVED, "#2F5E3A", None),
    "dropped": ("#FFFFFF", palette.DROPPED, "5,2"),
    "recomputed": (palette.RECOMPUTED, palette.RECOMPUTE, "5,2"),
    "released": (palette.RELEASED, "#9A9A9A", "1,2"),
}
_MOST_ALIVE_FIRST = ("saved", "recomputed", "dropped", "released", NOT_YET)
_PALE_TEXT, _PALE_LINE, _PALE_FILL = "#B4B4B4", "#D6D6D6", "#F7F7F7"
# The band in view: the whole width, at most WINDOW_HEIGHT_PT graph points tall.
WINDOW_HEIGHT_PT = 290.0
# The picture's narrowest scale, CSS pixels per graph point: Graphviz's 10 pt labels stay 11 px.
MIN_PX_PER_PT = 1.1
_GROUP = re.compile(r'<g id="[^"]*" class="(node|edge)">\n<title>([^<]*)</title>\n(.*?)</g>', re.S)
_TRANSLATE = re.compile(
    r'<g id="graph0" class="graph" transform="scale\(1 1\) rotate\(0\) '
    r'translate\(([-\d.]+) ([-\d.]+)\)"'
)
_NUMBERS = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass
class _Element:
    kind: str  # "node" or "edge"
    name: str  # the node id, or "src->dst"
    body: str  # the SVG inside the group
    box: tuple[float, float, float, float] | None = None  # x0, y0, x1, y1 in viewBox units


class StepPicture:
    """The graph of one step laid out once; :meth:`html` draws it at one event's states.

    Args:
        graph: the graph after forward (``StepReplay.graph``).
        slot_of_label: label -> where a node keeps that saved tensor (``StepReplay.slot_of_label``).
        region_of_raw: raw checkpoint name -> the name the words use.
        sequence_of_node: node id -> autograd's creation number.
        sharers: label -> the labels that are the same memory (``StepReplay.sharers``): one box,
            which names them all (``saved #1, #2``), so every number the words use is on it.
        collapse: ``None`` or ``"module"`` (one box per submodule), as :func:`ckptlib.graph.to_dot`.
    """

    def __init__(
        self,
        graph: AutogradGraph,
        slot_of_label: dict[str, Any],
        region_of_raw: dict[str, str],
        sequence_of_node: dict[str, int],
        sharers: dict[str, tuple[str, ...]],
        collapse: str | None = None,
    ) -> None:
        self.labels = list(slot_of_label)
        self.graph, drawn_name = _with_every_tensor(graph, slot_of_label, region_of_raw, sharers)
        dot = to_dot(self.graph, collapse=collapse, legend=False)
        dot.graph_attr.update(
            ranksep="0.2", nodesep="0.15"
        )  # compact: more of the graph beside the controls
        svg = render_svg(dot)
        self._parse(svg[svg.index("<svg") :])
        self.leaves = {node.id for node in self.graph.nodes if node.kind == "leaf"}
        self.outputs = {node.id for node in self.graph.nodes if node.kind == "output"}
        # What each label is drawn as: a box (its own, a shared one, its module's) or, for a
        # leaf's own memory, the dashed edge from its node to the leaf.
        self.element_of: dict[str, str] = {}
        # How the words point at it: "the box 'saved #1, #2'", "the dashed edge 'mat2: saved #3'
        # to its leaf".
        self.drawn_as: dict[str, str] = {}
        for label, slot in slot_of_label.items():
            name = drawn_name[slot.node_id, slot.name]
            target = dot.module_boxes.get(slot.node_id) or dot.saved_boxes.get(
                (slot.node_id, name)
            )
            if target in self.leaves:
                self.element_of[label] = f"{slot.node_id}->{target}"
                self.drawn_as[label] = f"the dashed edge '{name}' to its leaf"
            elif target is not None:
                self.element_of[label] = target
                self.drawn_as[label] = ("its module's box" if target in dot.module_boxes.values()
                                        else f"the box '{_box_name(sharers[label])}'")
        self.node_of_label = {label: slot.node_id for label, slot in slot_of_label.items()}
        self.module_of = dict(dot.module_boxes)
        self.sequence = sequence_of_node
        self.boxes = sorted({e for label, e in self.element_of.items() if "->" not in e})
        self.leaf_edges = sorted({e for e in self.element_of.values() if "->" in e})

    # -- reading the SVG once --------------------------------------------------------
    def _parse(self, svg: str) -> None:
        width, height = (
            float(v) for v in re.search(r'viewBox="0\.00 0\.00 ([\d.]+) ([\d.]+)"', svg).groups()
        )
        self.width, self.height = width, height
        shift = _TRANSLATE.search(svg)
        tx, ty = (float(shift[1]), float(shift[2])) if shift else (0.0, 0.0)
        self._head = svg[
            svg.index(">", svg.index("<svg")) + 1 :
        ]  # everything after the <svg ...> tag
        self._pieces: list[str | _Element] = []
        position = 0
        self.elements: dict[str, _Element] = {}
        for match in _GROUP.finditer(self._head):
            self._pieces.append(self._head[position : match.start()])
            name = html.unescape(match[2])
            element = _Element(match[1], name, match[3])
            points = [
                float(v)
                for v in _NUMBERS.findall(" ".join(re.findall(r'points="([^"]*)"', match[3])[:1]))
            ]
            if element.kind == "node" and points:
                xs, ys = points[0::2], points[1::2]
                element.box = (min(xs) + tx, min(ys) + ty, max(xs) + tx, max(ys) + ty)
            self.elements[name] = element
            self._pieces.append(element)
            position = match.end()
        self._pieces.append(self._head[position:])

    # -- one event ---------------------------------------------------------------------
    def box_states(self, states: dict[str, str]) -> dict[str, str]:
        """Drawn element -> the state it shows: the most alive state of the tensors it stands
        for."""
        shown: dict[str, str] = {}
        for label, element in self.element_of.items():
            state = states.get(label, NOT_YET)
            if element not in shown or _MOST_ALIVE_FIRST.index(state) < _MOST_ALIVE_FIRST.index(
                shown[element]
            ):
                shown[element] = state
        return shown

    def made(self, states: dict[str, str], forward_done: bool) -> set[str]:
        """The graph's nodes forward has made by the time of ``states``."""
        if forward_done:
            return set(self.elements)
        frontier = max(
            (
                self.sequence.get(self.node_of_label[label], -1)
                for label in states
                if label in self.node_of_label
            ),
            default=-1,
        )
        made = {node for node, number in self.sequence.items() if number <= frontier} | self.leaves
        made |= {self.module_of[node] for node in made if node in self.module_of}
        return made

    def svg(
        self,
        states: dict[str, str],
        forward_done: bool,
        current: str | None,
        window: tuple[float, float, float, float],
    ) -> str:
        """The SVG at one event: ``window`` is (x, y, width, height) of the graph in view."""
        shown = self.box_states(states)
        made = self.made(states, forward_done)
        highlight = self.element_of.get(current) if current is not None else None
        parts = []
        for piece in self._pieces:
            if isinstance(piece, str):
                parts.append(piece)
                continue
            # The title (a tooltip) names the state too, in words.
            title = piece.name + (f": {shown[piece.name]}" if piece.name in shown else "")
            parts.append(
                f'<g class="{piece.kind}"><title>{html.escape(title)}</title>\n'
                f"{self._styled(piece, shown, made, highlight)}</g>"
            )
        x, y, w, h = window
        size = (
            f'width="{w:.0f}pt" height="{h:.0f}pt" style="width:100%; '
            f'min-width:{MIN_PX_PER_PT * w:.0f}px; height:auto; display:block"'
        )
        return (
            f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="{x:.1f} {y:.1f} {w:.1f} {h:.1f}" '
            f"{size}>" + "".join(parts)
        )

    def _styled(
        self, element: _Element, shown: dict[str, str], made: set[str], highlight: str | None
    ) -> str:
        body = element.body
        if (
            element.name in shown
        ):  # a saved tensor's box, or the edge that stands for a leaf's memory
            state = shown[element.name]
            fill, line, dash = STATE_STYLES[state]
            width = "2.5" if element.name == highlight else "1.2"
            line = palette.HIGHLIGHT if element.name == highlight else line
            if element.kind == "node":
                body = _set(
                    body,
                    "polygon",
                    fill=fill,
                    stroke=line,
                    stroke_dasharray=dash,
                    stroke_width=width,
                )
                return _pale_text(body) if state == NOT_YET else body
            return _set(
                body, "path", stroke=line if state != NOT_YET else _PALE_LINE, stroke_width=width
            )
        if element.kind == "node":
            return (
                body
                if element.name in made
                else _pale_text(_set(body, "polygon", fill=_PALE_FILL, stroke=_PALE_LINE))
            )
        source, _, target = element.name.partition("->")
        ends_there = all(
            end in made or shown.get(end, NOT_YET) != NOT_YET for end in (source, target)
        )
        return (
            body
            if ends_there
            else _set(
                _set(body, "path", stroke=_PALE_LINE), "polygon", fill=_PALE_LINE, stroke=_PALE_LINE
            )
        )

    def focus(
        self, label: str | None, states: dict[str, str], forward_done: bool
    ) -> tuple[float, float] | None:
        """The centre of what an event is about: its tensor's box, else (in forward) the newest
        node."""
        element = self.elements.get(self.element_of.get(label, "")) if label else None
        if (
            element is None and label in self.element_of
        ):  # a leaf edge: look at the node it hangs from
            element = self.elements.get(self.element_of[label].partition("->")[0])
        if element is None and not forward_done:
            newest = [
                n
                for n in self.made(states, False)
                if n in self.sequence and n in self.elements and n not in self.leaves
            ]
            if newest:
                element = self.elements[max(newest, key=self.sequence.__getitem__)]
        if element is None or element.box is None:
            return None
        x0, y0, x1, y1 = element.box
        return (x0 + x1) / 2, (y0 + y1) / 2

    def windows(self, focuses: list[tuple[float, float] | None]) -> list[tuple]:
        """One window per event, the graph's whole width: the band in view is kept while the
        event's box stays well inside it, else re-centred on it."""
        w, h = self.width, min(self.height, WINDOW_HEIGHT_PT)
        y = 0.0
        out = []
        for focus in focuses:
            if focus is not None and not (y + 0.15 * h <= focus[1] <= y + 0.85 * h):
                y = min(max(focus[1] - h / 2, 0.0), self.height - h)
            out.append((0.0, y, w, h))
        return out


def _box_name(labels: tuple[str, ...]) -> str:
    """One memory's labels as its box says them: ``saved #1, #2`` (one prefix), else joined."""
    prefixes = {label.rpartition(" #")[0] for label in labels}
    if len(prefixes) == 1 and all(" #" in label for label in labels):
        return f"{prefixes.pop()} " + ", ".join("#" + label.rpartition("#")[2] for label in labels)
    return ", ".join(labels)


def _with_every_tensor(
    graph: AutogradGraph,
    slot_of_label: dict[str, Any],
    region_of_raw: dict[str, str],
    sharers: dict[str, tuple[str, ...]],
) -> tuple[AutogradGraph, dict[tuple[str, str], str]]:
    """The graph with each saved tensor the step packs, in one state (``kept``: a label without
    a state word, so every box keeps its size whatever it shows), and where each is drawn by
    name: (node id, attribute) -> the name the picture gives it.

    A box is named by every label of its memory; a leaf's own memory has no box, so its label
    goes on the dashed edge beside the attribute (``mat2: saved #3``)."""
    label_of = {(slot.node_id, slot.name): label for label, slot in slot_of_label.items()}
    nodes, drawn_name = [], {}
    for node in graph.nodes:
        saved = []
        for s in node.saved:
            label = label_of.get((node.id, s.name))
            if label is None:
                continue
            name = f"{s.name}: {label}" if s.of_leaf else s.name
            drawn_name[node.id, s.name] = name
            saved.append(dataclasses.replace(
                s,
                name=name,
                status="kept",
                tensor_name=_box_name(sharers[label]),
                region=region_of_raw.get(s.region, s.region),
            ))
        nodes.append(dataclasses.replace(node, saved=tuple(saved)))
    return dataclasses.replace(graph, nodes=nodes), drawn_name


def _set(body: str, tag: str, **attributes: str | None) -> str:
    """``body`` with every ``<tag ...>`` given these attributes (``stroke_width`` ->
    ``stroke-width``;
    ``None`` removes one)."""

    def restyle(match: re.Match) -> str:
        text = match[0]
        for name, value in attributes.items():
            name = name.replace("_", "-")
            text = re.sub(rf' {name}="[^"]*"', "", text)
            if value is not None:
                text = text.replace(f"<{tag}", f'<{tag} {name}="{value}"', 1)
        return text

    return re.sub(rf"<{tag}\b[^>]*>", restyle, body)


def _pale_text(body: str) -> str:
    return _set(body, "text", fill=_PALE_TEXT)
