"""Building an AutogradGraph: walk ``grad_fn`` and read every saved tensor without recomputing it.

Walking ``grad_fn`` and reading each node's saved tensors is :mod:`ckptlib.autograd_walk`'s
job (shared with :mod:`ckptlib.inspect`); this module turns what it reads into an
:class:`AutogradGraph`: names, storages, and which leaf owns what.

Design notes
============

Whose memory. A kept saved tensor that shares storage with a leaf (an
``AccumulateGrad`` variable, or a leaf named in ``params``) is ``of_leaf``, with
its ``leaf_kind``: ``"parameter"`` for an ``nn.Parameter``, ``"buffer"`` for a
module's buffer, ``"leaf"`` otherwise. A tensor a checkpoint dropped is known
only by its metadata, yet a parameter inside a checkpoint is still one: when
ckptlib says dropping it freed nothing (or torch's checkpoint says nothing),
the leaves the node reaches through view ops only (``weight.t()`` reaches
``weight`` through ``TBackward0``) are the candidates, and one of the same size
and dtype (the same name, ``weight`` or ``bias``, when several fit) is taken as
its owner. Two saved tensors that fit the same single leaf (``a * w`` with
``a`` and ``w`` alike) stay unnamed: a guess would be a wrong label.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter, deque
from typing import Any, Iterable, Mapping, NamedTuple, Sequence, Union

import torch
from torch import nn

from ckptlib.autograd_walk import TORCH_CHECKPOINT, SavedRecord, op_name, read_saved, walk
from ckptlib.graph.modules import ModuleTrace
from ckptlib.core.checks import storage_ptr
from ckptlib.graph.nodes import DROPPED, AutogradGraph, GraphNode, SavedTensor

__all__ = ["autograd_graph", "TORCH_CHECKPOINT", "Params"]

Params = Union[nn.Module, Mapping[str, torch.Tensor], None]


def autograd_graph(
    outputs: torch.Tensor | Sequence[torch.Tensor],
    params: Params = None,
    modules: ModuleTrace | None = None,
) -> AutogradGraph:
    """Walk the autograd graph behind ``outputs`` and describe what every node saves.

    Args:
        outputs: a tensor, or a sequence of tensors, that requires grad.
        params: names for tensors: an ``nn.Module`` (its parameters and buffers)
            or a dict name -> tensor. Named leaves (and views of them) are not
            counted as saved activations.
        modules: a :class:`ModuleTrace` from :func:`trace_modules`, to know which
            submodule made each node (``params`` defaults to its model).

    Reading the graph recomputes nothing and keeps nothing alive: the result
    holds shapes, dtypes and byte counts, not tensors.

    >>> import torch
    >>> a = torch.randn(3, requires_grad=True)
    >>> b = torch.randn(3, requires_grad=True)
    >>> print(autograd_graph((a * b).sin().sum(), params={"a": a, "b": b}))
    ... # doctest: +NORMALIZE_WHITESPACE
    out0  output ()
    n0    SumBackward0
    n1    SinBackward0          saves self (3,) float32 12 B
    n2    MulBackward0          saves other (3,) float32 12 B = b (leaf, not counted),
                                      self (3,) float32 12 B = a (leaf, not counted)
    n3    leaf a (3,)
    n4    leaf b (3,)
    saved 12 B, dropped by checkpoints 0 B
    """
    return build_graph(outputs, params, modules, caller="autograd_graph")


def build_graph(outputs: Any, params: Any, modules: Any, caller: str) -> AutogradGraph:
    """:func:`autograd_graph`, with errors that name the public function the user called."""
    tensors = output_tensors(outputs, caller)
    if modules is not None and not isinstance(modules, ModuleTrace):
        raise TypeError(
            f"{caller}: modules must be the ModuleTrace that `with trace_modules(model) as "
            f"modules:` gives, got {type(modules).__name__}."
        )
    if params is None and modules is not None:
        params = modules.model
    names = _Names(params, caller)

    roots = [t.grad_fn for t in tensors if t.grad_fn is not None]
    order, edges = walk(roots)
    ids = {fn: f"n{i}" for i, fn in enumerate(order)}
    storages = _StorageIds()
    leaves = _Leaves(order, names, storages)

    records = {fn: list(read_saved(fn)) for fn in order if not hasattr(fn, "variable")}
    lives_on = _outputs_that_live_on(records.values())
    nodes = []
    for position, tensor in enumerate(tensors):
        nodes.append(
            GraphNode(
                f"out{position}",
                "output",
                None,
                names.of(tensor),
                tuple(tensor.shape),
                tensor.dtype,
            )
        )
    for fn in order:
        op = op_name(fn)
        if hasattr(fn, "variable"):
            leaf, name = fn.variable, names.of(fn.variable)
            nodes.append(
                GraphNode(
                    ids[fn],
                    "leaf",
                    op,
                    name,
                    tuple(leaf.shape),
                    leaf.dtype,
                    module=_module_of_parameter(name, modules),
                    storage=storages.of(leaf),
                )
            )
        else:
            module = modules.module_of(fn._sequence_nr()) if modules is not None else None
            saved = tuple(_describe(record, names, storages, leaves, lives_on)
                          for record in records[fn])
            saved = leaves.name_dropped(saved, fn, module)
            nodes.append(GraphNode(ids[fn], "op", op, saved=saved, module=module))

    edge_ids = [(ids[src], ids[dst]) for src, dst in edges]
    edge_ids += [
        (ids[t.grad_fn], f"out{i}") for i, t in enumerate(tensors) if t.grad_fn is not None
    ]
    module_types = modules.module_types if modules is not None else {}
    return AutogradGraph(nodes, edge_ids, dict(module_types))


def output_tensors(outputs: Any, caller: str) -> list[torch.Tensor]:
    """``outputs`` as a list of tensors with an autograd graph, or a clear error naming
    ``caller``."""
    if isinstance(outputs, torch.Tensor):
        tensors = [outputs]
    elif isinstance(outputs, (list, tuple)):
        tensors = list(outputs)
        if not tensors:
            raise ValueError(
                f"{caller}: outputs is an empty {type(outputs).__name__}; pass a tensor "
                "or a list of tensors that require grad."
            )
    else:
        raise TypeError(
            f"{caller}: outputs must be a tensor or a list/tuple of tensors that require grad, "
            f"got {type(outputs).__name__}."
        )
    for position, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"{caller}: output #{position} is of type {type(tensor).__name__}, not a tensor; "
                "pass tensors computed from inputs with requires_grad=True."
            )
        if not tensor.requires_grad:
            raise ValueError(
                f"{caller}: output #{position} is a tensor without grad, so there is no autograd "
                "graph behind it. Pass tensors computed from inputs with requires_grad=True, "
                "outside torch.no_grad()."
            )
    return tensors


# ---------------------------------------------------------------------------
# Memory: storages, names, and which leaf owns what
# ---------------------------------------------------------------------------


def _storage_key(tensor: torch.Tensor) -> tuple[str, int] | None:
    """Where a tensor's memory is; ``None`` where there is none to compare (sparse, nested,
    empty)."""
    ptr = storage_ptr(tensor)
    return None if ptr is None else (str(tensor.device), ptr)


class _StorageIds:
    """Small stable numbers for storages, in the order they are first met."""

    def __init__(self) -> None:
        self.ids: dict[tuple, int] = {}

    def of(self, tensor: torch.Tensor) -> int | None:
        key = _storage_key(tensor)
        return None if key is None else self.ids.setdefault(key, len(self.ids))

    def of_output(self, output: tuple[Any, int]) -> int:
        """The number of a dropped tensor, known as an autograd output (producing node, output
        number): equal for every node that saved it."""
        node, output_nr = output
        return self.ids.setdefault(("output", node, output_nr), len(self.ids))


def _view_of(tensor: torch.Tensor) -> tuple | None:
    """What makes two tensors the same view of the same memory."""
    key = _storage_key(tensor)
    if key is None:
        return None
    return (*key, tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)


def _leaf_kind(tensor: torch.Tensor, buffer: bool = False) -> str:
    return "parameter" if isinstance(tensor, nn.Parameter) else "buffer" if buffer else "leaf"


class _Names:
    """Names for tensors from ``params``: exact views first, then any view of the same storage."""

    def __init__(self, params: Params, caller: str) -> None:
        buffers: set[str] = set()
        if isinstance(params, nn.Module):
            named = [*params.named_parameters(), *params.named_buffers()]
            buffers = {name for name, _ in params.named_buffers()}
        elif params is None:
            named = []
        elif isinstance(params, Mapping):
            named = list(params.items())
        else:
            raise TypeError(
                f"{caller}: params must be an nn.Module or a dict name -> tensor, "
                f"got {type(params).__name__}."
            )
        for name, tensor in named:
            if not isinstance(name, str):
                raise TypeError(f"{caller}: params has the key {name!r}; names must be strings.")
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(
                    f"{caller}: params[{name!r}] is of type {type(tensor).__name__}, "
                    "not a tensor; pass only tensors to name."
                )
        self.named = [(name, tensor, _leaf_kind(tensor, name in buffers)) for name, tensor in named]
        self.by_view: dict[tuple, str] = {}
        self.by_storage: dict[tuple, str] = {}
        for name, tensor in named:
            view = _view_of(tensor)
            if view is not None:
                self.by_view.setdefault(view, name)
                self.by_storage.setdefault(view[:2], name)

    def of(self, tensor: torch.Tensor) -> str | None:
        view = _view_of(tensor)
        if view is None or tensor.numel() == 0:  # empty tensors all sit at address 0
            return None
        if view in self.by_view:
            return self.by_view[view]
        owner = self.by_storage.get(view[:2])
        return f"view of {owner}" if owner is not None else None


class _Leaf(NamedTuple):
    storage: int | None
    name: str | None
    kind: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    direct: bool  # an input of the node itself, not reached through view ops


# Backward nodes of view ops: a saved tensor reached through them may be a view of a leaf.
_VIEW_OP = re.compile(
    r"(T|Mt|View|UnsafeView|Reshape\w*|Transpose|Permute|Expand|Squeeze|Unsqueeze|Slice|"
    r"Select|AsStrided|Alias|Diagonal|Narrow|Split|SplitWithSizes|Unbind)Backward\d*"
)


def _leaves_near(fn: Any) -> list[tuple[Any, bool]]:
    """The ``AccumulateGrad`` nodes ``fn`` reaches through view ops only, each with whether it is
    one of ``fn``'s own inputs."""
    found, seen = [], set()
    queue = deque((next_fn, True) for next_fn, _ in fn.next_functions)
    while queue:
        node, direct = queue.popleft()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):
            found.append((node, direct))
        elif _VIEW_OP.fullmatch(node.name()):
            queue.extend((next_fn, False) for next_fn, _ in node.next_functions)
    return found


class _Leaves:
    """The leaves of one graph by storage (to mark saved tensors ``of_leaf``), and the naming of
    dropped tensors that belong to a leaf (see "Whose memory" above)."""

    def __init__(self, order: list[Any], names: _Names, storages: _StorageIds) -> None:
        self.names, self.storages = names, storages
        self.kind_of_storage: dict[int, str] = {}
        leaves = [(fn.variable, _leaf_kind(fn.variable)) for fn in order if hasattr(fn, "variable")]
        leaves += [(tensor, kind) for _, tensor, kind in names.named if tensor.is_leaf]
        for tensor, kind in leaves:
            storage = storages.of(tensor)
            if storage is not None:
                self.kind_of_storage.setdefault(storage, kind)

    def leaf(self, tensor: torch.Tensor, kind: str, direct: bool = True) -> _Leaf:
        return _Leaf(
            self.storages.of(tensor),
            self.names.of(tensor),
            kind,
            tuple(tensor.shape),
            tensor.dtype,
            direct,
        )

    def name_dropped(
        self, saved: tuple[SavedTensor, ...], fn: Any, module: str | None
    ) -> tuple[SavedTensor, ...]:
        """``saved`` (of node ``fn``) with each dropped tensor that belongs to a leaf marked as
        that leaf's."""
        unsure = [
            s
            for s in saved
            if s.status in ("dropped", "recomputed")
            and s.shape is not None
            and not s.of_leaf
            and (not s.frees_memory or s.region == TORCH_CHECKPOINT)
        ]
        if not unsure:
            return saved
        near = [
            self.leaf(leaf.variable, _leaf_kind(leaf.variable), direct)
            for leaf, direct in _leaves_near(fn)
        ]
        buffers = [
            self.leaf(tensor, kind)
            for name, tensor, kind in self.names.named
            if kind == "buffer" and (module is None or name.startswith(module + "."))
        ]
        owners = {}
        for s in unsure:
            owner = _owner(s, near) or _owner(s, buffers, same_name_only=True)
            if owner is not None:
                owners[s.name] = owner
        claims = Counter(owners.values())
        return tuple(
            _as_leafs(s, owners[s.name]) if s.name in owners and claims[owners[s.name]] == 1 else s
            for s in saved
        )


def _owner(saved: SavedTensor, leaves: list[_Leaf], same_name_only: bool = False) -> _Leaf | None:
    size = math.prod(saved.shape)
    fits = [leaf for leaf in leaves if math.prod(leaf.shape) == size and leaf.dtype == saved.dtype]
    if len(fits) > 1 or same_name_only:
        fits = [
            leaf
            for leaf in fits
            if leaf.name is not None and leaf.name.rsplit(".", 1)[-1] == saved.name
        ]
    return fits[0] if len(fits) == 1 else None


def _as_leafs(saved: SavedTensor, leaf: _Leaf) -> SavedTensor:
    exact = leaf.direct and leaf.shape == saved.shape
    name = leaf.name if leaf.name is None or exact else f"view of {leaf.name}"
    return dataclasses.replace(
        saved,
        of_leaf=True,
        leaf_kind=leaf.kind,
        tensor_name=name,
        storage=leaf.storage,
        frees_memory=False,
    )


def _module_of_parameter(name: str | None, modules: ModuleTrace | None) -> str | None:
    if name is None or modules is None:
        return None
    path = name.rpartition(".")[0]
    return path if path in modules.module_types else None


# ---------------------------------------------------------------------------
# Saved tensors, as the graph shows them
# ---------------------------------------------------------------------------


def _outputs_that_live_on(records: Iterable[list[SavedRecord]]) -> set[tuple[Any, int]]:
    """The autograd outputs (see ``SavedRecord.output``) whose memory no checkpoint frees: a node
    keeps one of them, or a checkpoint dropped it where dropping frees nothing (a block's output
    is the next checkpointed block's input). Dropping such a tensor elsewhere frees nothing
    either, as the memory meter sees: it is still held."""
    return {
        record.output
        for saved in records
        for record in saved
        if record.output is not None
        and (record.status == "kept" or (record.status in DROPPED and not record.frees_memory))
    }


def _describe(
    record: SavedRecord, names: _Names, storages: _StorageIds, leaves: _Leaves,
    lives_on: set[tuple[Any, int]],
) -> SavedTensor:
    """What the graph shows of one saved tensor: its record, with storage, owner and name."""
    if record.status != "kept":
        # Known by its metadata, and by the autograd output it is: one number for every node
        # that saved that tensor, so its bytes count once and it is drawn as one box.
        storage = storages.of_output(record.output) if record.output is not None else None
        return SavedTensor(
            record.label,
            record.shape,
            record.dtype,
            record.nbytes or 0,
            record.status,
            record.region,
            storage,
            record.nbytes or 0,
            view=None if storage is None else (storage, record.shape, record.dtype),
            frees_memory=record.frees_memory and record.output not in lives_on,
        )
    tensor = record.tensor
    storage = storages.of(tensor)
    kind, view, storage_nbytes = None, None, record.nbytes  # a tensor without one storage: its own
    if storage is not None:
        kind = leaves.kind_of_storage.get(storage)
        view = (
            storage,
            tensor.storage_offset(),
            tuple(tensor.shape),
            tensor.stride(),
            tensor.dtype,
        )
        storage_nbytes = tensor.untyped_storage().nbytes()
    return SavedTensor(
        record.label,
        record.shape,
        record.dtype,
        record.nbytes,
        "kept",
        None,
        storage,
        storage_nbytes,
        kind is not None,
        names.of(tensor),
        view,
        leaf_kind=kind,
    )
