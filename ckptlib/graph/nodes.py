"""What an autograd graph is made of: saved tensors, nodes and the graph, as plain data.

Design notes
============

Plain data. An :class:`AutogradGraph` holds no tensors and no autograd nodes,
only what was read from them (shapes, dtypes, bytes, states), so keeping one
keeps no memory alive and drawing it never touches autograd. The dataclasses
are frozen: a graph is a snapshot, and a variant of it (a saved tensor in
another state, as a step-by-step replay needs) is made with
:func:`dataclasses.replace` or :func:`with_statuses`, never by editing one.

Counting bytes once. Two saved tensors can be one piece of memory: ``exp``
saves its result and the ``sin`` that follows saves the same tensor as its
input; ``q`` and ``k`` split from one ``qkv`` matmul are views of one storage.
Every saved tensor gets a small ``storage`` number (equal numbers, same
memory), and byte totals add each storage's size once. A saved tensor that
shares storage with a leaf (a parameter, a buffer, an input that gets
``.grad``, or any leaf named in ``params``) is marked ``of_leaf`` and left out
of the totals: that memory belongs to the leaf and lives on without the graph.
A checkpoint's dropped tensors are seen through their metadata, and through
the autograd output each one is (the node that made it, its output number):
autograd keeps that with every saved tensor, so a tensor two ops saved (a
ReLU's result, the next Linear's ``mat1``) gets one ``storage`` number and its
bytes count once in the dropped total, as the memory meter frees them once.
What that cannot see counts on its own: a view and its base, a tensor changed
in place and saved before and after, a tensor without history (made under
``no_grad``) saved twice. The dropped total leaves out those whose dropping
frees nothing (``frees_memory`` is False): an input of the checkpoint, a
parameter or a view of one, and a tensor that is held anyway, because a node
outside the checkpoint keeps it or it is another checkpoint's input (a block's
output, dropped by its own checkpoint, is the next block's input).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch

from ckptlib.memory import format_bytes

__all__ = ["SavedTensor", "GraphNode", "AutogradGraph", "STATUSES", "with_statuses"]

STATUSES = ("kept", "dropped", "recomputed", "freed", "modified")
"""The states of a saved tensor, as :attr:`SavedTensor.status` names them."""

NODE_KINDS = ("op", "leaf", "output")
LEAF_KINDS = ("parameter", "buffer", "leaf")


@dataclass(frozen=True)
class SavedTensor:
    """One tensor a node keeps for its backward.

    ``status`` is ``"kept"`` (autograd holds it), ``"dropped"`` (a checkpoint
    dropped it in forward), ``"recomputed"`` (a checkpoint recomputed it and a
    backward used it), ``"freed"`` (a backward released it) or ``"modified"``
    (changed in place after it was saved: backward will fail). ``shape`` and
    ``dtype`` are ``None`` when they cannot be known (freed tensors). ``storage``
    numbers memory: saved tensors with equal numbers share it (see ``storage_nbytes``).
    ``of_leaf`` marks memory a leaf owns (``leaf_kind`` says which: ``"parameter"``,
    ``"buffer"`` or ``"leaf"``); it is never counted in the totals.
    """

    name: str
    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    nbytes: int
    status: str
    region: str | None = None
    storage: int | None = None
    storage_nbytes: int = 0
    of_leaf: bool = False
    tensor_name: str | None = None
    view: tuple | None = field(default=None, repr=False)
    # For a dropped tensor: False if dropping it freed nothing: an input of the checkpoint, a
    # parameter or a view of one, or a tensor held anyway (a node outside keeps it, or it is
    # another checkpoint's input).
    frees_memory: bool = True
    leaf_kind: str | None = None

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(
                f"SavedTensor {self.name!r}: status={self.status!r} is not one of {STATUSES} "
                "(a tensor a backward released is 'freed'; one autograd holds is 'kept')."
            )
        if self.leaf_kind is not None and self.leaf_kind not in LEAF_KINDS:
            raise ValueError(
                f"SavedTensor {self.name!r}: leaf_kind={self.leaf_kind!r} is not one of "
                f"{LEAF_KINDS} or None."
            )

    @property
    def counted(self) -> bool:
        """Whether this tensor's bytes are in :attr:`AutogradGraph.saved_bytes` or
        :attr:`AutogradGraph.dropped_bytes` (kept or dropped memory that no leaf owns)."""
        if self.of_leaf or self.shape is None:
            return False
        if self.status == "kept":
            return True
        return self.status in ("dropped", "recomputed") and self.frees_memory

    def describe(self) -> str:
        """``'self (3,) float32 12 B'``: name, shape, dtype, bytes (just the name if unknown)."""
        if self.shape is None:
            return self.name
        text = (
            f"{self.name} {shape_text(self.shape)} {dtype_text(self.dtype)} "
            f"{bytes_text(self.nbytes)}"
        )
        if self.tensor_name:
            text += f" = {self.tensor_name}"
        return text


@dataclass(frozen=True)
class GraphNode:
    """A node of the drawing: ``kind`` is ``"op"`` (a backward op), ``"leaf"`` (an
    ``AccumulateGrad``: ``name``, ``shape``, ``dtype`` and ``storage`` are its tensor's) or
    ``"output"`` (an output tensor). ``module`` is the path of the submodule that made it."""

    id: str
    kind: str
    op: str | None
    name: str | None = None
    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
    saved: tuple[SavedTensor, ...] = ()
    module: str | None = None
    storage: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in NODE_KINDS:
            raise ValueError(
                f"GraphNode {self.id!r}: kind={self.kind!r} is not one of {NODE_KINDS}."
            )

    @property
    def region(self) -> str | None:
        """The checkpoint region that dropped this node's saved tensors, if any."""
        return next((s.region for s in self.saved if s.region is not None), None)

    @property
    def recomputed(self) -> bool:
        return any(s.status == "recomputed" for s in self.saved)

    @property
    def dropped(self) -> bool:
        return any(s.status in ("dropped", "recomputed") for s in self.saved)

    @property
    def saved_bytes(self) -> int:
        """Bytes this node's kept saved tensors hold (each storage once, leaves excluded)."""
        return distinct_storage_bytes(self.saved)

    @property
    def dropped_bytes(self) -> int:
        """Bytes of this node's saved tensors that a checkpoint dropped in forward, each tensor
        once, counting only those whose dropping freed memory (not inputs, parameters or views
        of them)."""
        return distinct_storage_bytes(self.saved, DROPPED)


@dataclass
class AutogradGraph:
    """A snapshot of an autograd graph, made by :func:`autograd_graph`.

    ``nodes`` are in walk order (outputs first); ``edges`` go from input to
    consumer, as data flows in forward; ``module_types`` maps traced module
    paths to class names. ``print(graph)`` shows one line per node; in a
    notebook it displays itself as a picture (SVG, with a PNG beside it for
    viewers that do not show SVG).
    """

    nodes: list[GraphNode]
    edges: list[tuple[str, str]]
    module_types: dict[str, str] = field(default_factory=dict)

    def __getitem__(self, node_id: str) -> GraphNode:
        for node in self.nodes:
            if node.id == node_id:
                return node
        raise KeyError(
            f"no node {node_id!r} in this graph (ids run n0..n{len(self.ops) - 1}, out0..)"
        )

    @property
    def ops(self) -> list[GraphNode]:
        """The autograd nodes (backward ops and the leaves' ``AccumulateGrad``), without outputs."""
        return [node for node in self.nodes if node.kind != "output"]

    @property
    def saved_bytes(self) -> int:
        """Bytes autograd keeps for backward: kept saved tensors, each storage once, leaves
        excluded."""
        return distinct_storage_bytes(s for node in self.nodes for s in node.saved)

    @property
    def dropped_bytes(self) -> int:
        """Bytes of the saved tensors checkpoints dropped in forward, each tensor once (one
        saved by two ops too: see "Counting bytes once").

        Inputs, parameters and views of them are left out (dropping them frees
        nothing).
        """
        return distinct_storage_bytes((s for node in self.nodes for s in node.saved), DROPPED)

    # Showing a graph is the drawing and display modules' job (see VIEWS).
    def __str__(self) -> str:
        return VIEWS.text(self)

    def __repr__(self) -> str:
        return (
            f"AutogradGraph({len(self.nodes)} nodes, saved {bytes_text(self.saved_bytes)}, "
            f"dropped {bytes_text(self.dropped_bytes)})"
        )

    def _repr_svg_(self) -> str:
        return VIEWS.svg(self)

    def _repr_png_(self) -> tuple[bytes, dict[str, int]] | None:
        return VIEWS.png(self)


def with_statuses(graph: AutogradGraph, statuses: Mapping[tuple[str, str], str]) -> AutogradGraph:
    """A copy of ``graph`` in which some saved tensors are in another state.

    ``statuses`` maps ``(node id, saved-tensor name)`` to one of :data:`STATUSES`;
    the tensors not named keep theirs. Made for replaying a step: build the graph
    once, then draw each moment with ``to_dot(with_statuses(graph, {...}))``.

    >>> import torch
    >>> from ckptlib.graph import autograd_graph
    >>> x = torch.randn(3, requires_grad=True)
    >>> graph = autograd_graph(x.exp().sin())
    >>> [(s.name, s.status) for s in graph["n1"].saved]
    [('result', 'kept')]
    >>> later = with_statuses(graph, {("n1", "result"): "freed"})
    >>> [(s.name, s.status) for s in later["n1"].saved], graph["n1"].saved[0].status
    ([('result', 'freed')], 'kept')
    """
    if not isinstance(graph, AutogradGraph):
        raise TypeError(
            f"with_statuses: graph must be an AutogradGraph (from autograd_graph), "
            f"got {type(graph).__name__}."
        )
    if not isinstance(statuses, Mapping):
        raise TypeError(
            f"with_statuses: statuses must be a dict (node id, saved name) -> status, "
            f"got {type(statuses).__name__}."
        )
    wanted: dict[str, dict[str, str]] = {}
    for key, status in statuses.items():
        if not (
            isinstance(key, tuple) and len(key) == 2 and all(isinstance(part, str) for part in key)
        ):
            raise TypeError(
                f"with_statuses: key {key!r} must be a pair (node id, saved name) such as "
                "('n1', 'result')."
            )
        if status not in STATUSES:
            raise ValueError(
                f"with_statuses: status {status!r} for {key} is not one of {STATUSES} "
                "(a released tensor is 'freed', a saved one 'kept')."
            )
        node_id, name = key
        if not any(s.name == name for s in graph[node_id].saved):
            names = [s.name for s in graph[node_id].saved]
            raise KeyError(
                f"with_statuses: node {node_id} ({graph[node_id].op}) saves no tensor {name!r}; "
                f"it saves {names}."
            )
        wanted.setdefault(node_id, {})[name] = status
    nodes = [
        dataclasses.replace(
            node,
            saved=tuple(
                dataclasses.replace(s, status=wanted[node.id][s.name])
                if s.name in wanted[node.id]
                else s
                for s in node.saved
            ),
        )
        if node.id in wanted
        else node
        for node in graph.nodes
    ]
    return AutogradGraph(nodes, list(graph.edges), dict(graph.module_types))


KEPT = ("kept",)
DROPPED = ("dropped", "recomputed")
"""The statuses a saved tensor is counted under in ``saved_bytes`` and in ``dropped_bytes``."""


def distinct_storage_bytes(saved: Iterable[SavedTensor], statuses: tuple[str, ...] = KEPT) -> int:
    """Bytes of the counted tensors among ``saved`` in one of ``statuses``, each storage once."""
    counted = [s for s in saved if s.status in statuses and s.counted]
    shared = {s.storage: s.storage_nbytes for s in counted if s.storage is not None}
    # A tensor without one storage (sparse, nested; a dropped one without history) counts on
    # its own.
    return sum(shared.values()) + sum(s.nbytes for s in counted if s.storage is None)


def shape_text(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def dtype_text(dtype: torch.dtype | None) -> str:
    return str(dtype).replace("torch.", "")


def bytes_text(nbytes: int) -> str:
    """Bytes as every graph picture and text writes them: ``'12 B'``, ``'1.5 KiB'``."""
    return format_bytes(nbytes, digits=1)


class Views:
    """How graphs show themselves: ``print(graph)`` (``text``), a notebook's picture (``svg``, and
    ``png`` beside it, ``None`` when none can be drawn).

    The functions live in the layers above (text and DOT draw a graph, render makes pictures),
    which import this module; :mod:`ckptlib.graph`'s ``__init__`` hands them to :data:`VIEWS`
    when the package loads, so no data module imports a drawing one. ``NotebookDigraph``
    (:mod:`ckptlib.graph.dot`) shows itself the same way.
    """

    def __init__(self) -> None:
        self.text: Callable[[AutogradGraph], str] = repr
        self.svg: Callable[[Any], str] = _not_loaded
        self.png: Callable[[Any], tuple[bytes, dict[str, int]] | None] = _not_loaded


def _not_loaded(graph: Any) -> Any:
    raise RuntimeError(
        "ckptlib.graph draws graphs once the package is loaded: import ckptlib.graph."
    )


VIEWS = Views()
"""The functions graphs show themselves with, set by :mod:`ckptlib.graph` (see :class:`Views`)."""
