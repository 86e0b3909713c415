"""The text view of a graph: one line per node with what it saves, columns sized to fit.

``print(graph)`` shows it. The id column is as wide as the longest id, the op
column as the longest op that saves something (at least 6 and 22 characters,
so short graphs line up as they always did); each saved tensor says in brackets what
its bytes are: a leaf's (not counted), dropped by a checkpoint (counted as dropped, or
freeing nothing), freed or modified. The last line gives the totals, which add exactly the
tensors the brackets do not exclude.
"""

from __future__ import annotations

from ckptlib.graph.nodes import AutogradGraph, GraphNode, SavedTensor, bytes_text, shape_text

__all__ = ["graph_text", "status_note"]


def graph_text(graph: AutogradGraph) -> str:
    """The lines ``print(graph)`` shows (see the module docstring)."""
    titles = [_title(node) for node in graph.nodes]
    id_width = max([6] + [len(node.id) + 2 for node in graph.nodes])
    # Only lines that go on after the title need the column: those of nodes that save tensors.
    title_width = max(
        [22] + [len(title) + 2 for node, title in zip(graph.nodes, titles) if node.saved]
    )
    lines = []
    for node, title in zip(graph.nodes, titles):
        saves = ", ".join(s.describe() + status_note(s) for s in node.saved)
        lines.append(
            f"{node.id:<{id_width}}{title:<{title_width}}"
            f"{'saves ' + saves if saves else ''}".rstrip()
        )
    lines.append(
        f"saved {bytes_text(graph.saved_bytes)}, dropped by checkpoints "
        f"{bytes_text(graph.dropped_bytes)}"
    )
    return "\n".join(lines)


def _title(node: GraphNode) -> str:
    title = node.op if node.kind == "op" else f"{node.kind} {node.name or ''}".rstrip()
    if node.kind != "op" and node.shape is not None:
        title += f" {shape_text(node.shape)}"
    return title


def status_note(saved: SavedTensor) -> str:
    """What a saved tensor's bytes are, in brackets: ``' (leaf, not counted)'``, ``''`` for a
    plain kept tensor."""
    if saved.of_leaf and saved.status in ("kept", "dropped", "recomputed"):
        kind = saved.leaf_kind or "leaf"
        return f" ({kind}, not counted)" if saved.status == "kept" else f" ({kind}, kept)"
    if saved.status in ("dropped", "recomputed") and saved.region is not None:
        recomputed = ", recomputed" if saved.status == "recomputed" else ""
        frees = "" if saved.frees_memory else ", frees nothing"
        return f" (dropped by checkpoint {saved.region}{recomputed}{frees})"
    if saved.status == "kept":
        return (
            f" (of a {bytes_text(saved.storage_nbytes)} storage)"
            if saved.storage_nbytes > saved.nbytes
            else ""
        )
    return f" ({saved.status})"
