"""What autograd saves for backward: per node, per module, in bytes.

Two ways to look
================

``record_saved()`` watches a forward pass. Its pack hook
(``torch.autograd.graph.saved_tensors_hooks``) sees every tensor autograd
saves, and stores ``tensor.detach()`` (returning the tensor itself would make
a saved *output* hold its own ``grad_fn``: a reference cycle nothing frees).
Around it:

* global module hooks keep the path of the module running (``blocks.0.fc1``);
* a ``TorchFunctionMode`` knows the torch function being called (``linear``).
  Inside a ckptlib checkpoint the checkpoint's own pack hook is on top, so for
  the length of each call the mode pushes a thin hook over it that notes the
  tensor and passes it on. Whether the checkpoint dropped it shows in
  ``record_trace()``: a ``pack`` event with the region and index;
* after each call, the nodes made since the saves it caused are read back
  (autograd numbers nodes as it makes them: ``node._sequence_nr()``; the walk
  from the call's outputs stops at older ones). Each saved tensor's box holds
  what the pack hook stored: this recorder's own record of the save, or, for a
  tensor a checkpoint dropped, the checkpoint's handle, whose region and index
  ``ckptlib.peek_saved`` tells without recomputing anything. That
  names the node and the attribute.

A Python number in an op (``x * 0.5``) is saved as a 0-dim tensor that
autograd never passes to saved-tensor hooks: the walk below lists it, recording
cannot (8 bytes each).

``saved_tensors_report(outputs)`` walks a graph that already exists, from the
outputs' ``grad_fn`` through ``next_functions``, and reads every saved tensor the
same way: both use :mod:`ckptlib.autograd_walk`, the walker ``ckptlib.graph``
draws with. It cannot know modules or functions, nor which dropped
tensors shared a storage or were parameters (only their shape and dtype were
kept: such rows have kind "unknown" and each counts on its own, so
``dropped_bytes`` is an upper bound there). Tensors ``torch.utils.checkpoint``
dropped are recognised without unpacking them (a recomputation, for that
checkpoint): "dropped" rows of region ``torch.utils.checkpoint#0``. Tensors saved
under any other hook are unpacked by that hook.

Counting
========

A tensor is saved once per node that needs it, but memory holds storages: the
output of a ReLU saved by the ReLU and by the next Linear is one storage. Rows
list every save; totals count each storage once, at its full size (a saved
view keeps its whole base alive). Parameters and buffers are marked and left
out of the totals: they live anyway. Under a ckptlib checkpoint a save is
"dropped" (the checkpoint keeps only a handle) and the region's inputs are
"kept" as ``checkpoint`` / ``input`` rows; ``dropped_bytes`` counts the
storages that only dropped saves referenced, i.e. what the checkpoints freed.
Saves made under some other saved-tensor hook are "hooked": what is kept is up
to that hook.

Everything printed is deterministic: storages are numbered ``s0, s1, ...`` in
order of first appearance and checkpoint regions ``name#0, name#1, ...``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterable, Iterator, Sequence, Union

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ckptlib._arguments import function, got, integer
from ckptlib.autograd_walk import SavedRecord, read_saved, walk
from ckptlib.core.trace import CheckpointTrace, record_trace
from ckptlib.core.checkpoint import is_recomputing
from ckptlib.memory import format_bytes

__all__ = [
    "SavedTensor",
    "SavedTensorsReport",
    "ModuleTotals",
    "record_saved",
    "saved_tensors_report",
]

Outputs = Union[torch.Tensor, Sequence[Any]]
_STATE = ("parameter", "buffer")  # saved, but alive anyway: left out of the totals


@dataclass(frozen=True)
class SavedTensor:
    """One tensor autograd saved for backward (one row of a :class:`SavedTensorsReport`)."""

    module: str  # path of the module that was running ("" at top level or unknown)
    op: str  # torch function that saved it ("linear"); "" when unknown
    node: str  # autograd node holding it ("AddmmBackward0"); "?" when not found
    attribute: str  # name on the node (node._saved_mat1 -> "mat1")
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int  # this tensor's own elements
    storage: str  # "s0", "s1", ...: same label, same memory
    storage_bytes: int  # the whole storage it views (what keeping it costs)
    kind: str  # "activation", "parameter", "buffer", or "unknown" (see the notes)
    status: str  # "kept", "dropped" or "hooked"
    region: str = ""  # the checkpoint region it belongs to, if any

    def as_dict(self) -> dict[str, Any]:
        """The row with plain values (shape as a list, dtype as a string), e.g. for JSON."""
        row = dataclasses.asdict(self)
        row["shape"], row["dtype"] = list(self.shape), str(self.dtype).replace("torch.", "")
        return row


@dataclass(frozen=True)
class ModuleTotals:
    """Activation bytes saved while one module ran (each storage counted once)."""

    kept_bytes: int
    dropped_bytes: int
    tensors: int

    def __str__(self) -> str:
        return (
            f"kept {format_bytes(self.kept_bytes)}, dropped {format_bytes(self.dropped_bytes)} "
            f"({self.tensors} saves)"
        )


class SavedTensorsReport:
    """Rows of :class:`SavedTensor` with totals; ``print(report)`` shows a table.

    >>> import torch
    >>> x = torch.randn(4, 8, requires_grad=True)
    >>> y = x.relu()
    >>> z = (y * y).sum()             # y is saved twice (as self and as other): one storage
    >>> report = saved_tensors_report(z)
    >>> [(row.node, row.attribute, row.storage) for row in report.rows]
    ... # doctest: +NORMALIZE_WHITESPACE
    [('MulBackward0', 'other', 's0'), ('MulBackward0', 'self', 's0'),
     ('ReluBackward0', 'result', 's0')]
    >>> report.kept_bytes             # 4 x 8 float32, once
    128
    """

    def __init__(self, rows: Sequence[SavedTensor] = ()) -> None:
        if isinstance(rows, (str, bytes)) or not isinstance(rows, Iterable):
            raise TypeError(
                f"SavedTensorsReport: rows must be a list of SavedTensor rows, {got(rows)}."
            )
        self.rows: list[SavedTensor] = list(rows)
        for position, row in enumerate(self.rows):
            if not isinstance(row, SavedTensor):
                raise TypeError(
                    f"SavedTensorsReport: rows must be SavedTensor rows (as saved_tensors_report "
                    f"makes them), but rows[{position}] is {got(row)[4:]}."
                )

    def _storages(self, status: str) -> dict[str, int]:
        """Storages of activations (not parameters or buffers) with a save of this status ->
        bytes."""
        return {
            row.storage: row.storage_bytes
            for row in self.rows
            if row.kind not in _STATE and row.status == status
        }

    @property
    def kept_bytes(self) -> int:
        """Activation memory the saved tensors hold (each storage once)."""
        return sum(self._storages("kept").values())

    @property
    def dropped_bytes(self) -> int:
        """Activation memory only dropped saves referenced: what the checkpoints freed."""
        kept = self._storages("kept")
        return sum(
            size for storage, size in self._storages("dropped").items() if storage not in kept
        )

    @property
    def state_bytes(self) -> int:
        """Parameters and buffers that were saved (not in the totals: they live anyway)."""
        return sum(
            {row.storage: row.storage_bytes for row in self.rows if row.kind in _STATE}.values()
        )

    def by_module(self, depth: int | None = None) -> dict[str, ModuleTotals]:
        """Totals per module path, cut to its first ``depth`` parts (``depth=2``: ``blocks.0``).

        A storage counts for the module whose save of it came first.
        """
        if depth is not None:
            integer(depth, "depth", least=1, where="by_module")
        owner: dict[str, str] = {}
        saves: dict[str, int] = {}
        for row in self.rows:
            if row.kind in _STATE:
                continue
            module = ".".join(row.module.split(".")[:depth]) if depth is not None else row.module
            owner.setdefault(row.storage, module)
            saves[module] = saves.get(module, 0) + 1
        kept, dropped = self._storages("kept"), self._storages("dropped")
        totals = {}
        for module, count in saves.items():
            mine = [storage for storage, where in owner.items() if where == module]
            totals[module] = ModuleTotals(
                sum(kept[s] for s in mine if s in kept),
                sum(dropped[s] for s in mine if s in dropped and s not in kept),
                count,
            )
        return totals

    def records(self) -> list[dict[str, Any]]:
        """Machine-readable rows (plain values), in the order autograd saved them."""
        return [row.as_dict() for row in self.rows]

    def __len__(self) -> int:
        return len(self.rows)

    def __str__(self) -> str:
        columns = [
            "module",
            "op",
            "node",
            "saved",
            "shape",
            "dtype",
            "bytes",
            "storage",
            "kind",
            "status",
        ]
        with_region = any(row.region for row in self.rows)
        if with_region:
            columns.append("region")
        table = [columns]
        for row in self.rows:
            cells = [
                row.module or "-",
                row.op or "-",
                row.node,
                row.attribute,
                "x".join(map(str, row.shape)) or "scalar",
                str(row.dtype).replace("torch.", ""),
                format_bytes(row.nbytes),
                row.storage,
                row.kind,
                row.status,
            ]
            table.append(cells + [row.region or "-"] if with_region else cells)
        widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
        lines = [
            "  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip()
            for line in table
        ]
        kept = self._storages("kept")
        lines.append(f"activations kept: {format_bytes(self.kept_bytes)} in {len(kept)} storages")
        if any(row.status == "dropped" for row in self.rows):
            lines.append(f"activations dropped by checkpoints: {format_bytes(self.dropped_bytes)}")
        if self.state_bytes:
            lines.append(
                f"parameters and buffers saved: {format_bytes(self.state_bytes)} "
                "(not counted: they live anyway)"
            )
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"SavedTensorsReport({len(self.rows)} saved tensors, "
            f"kept {format_bytes(self.kept_bytes)}, "
            f"dropped {format_bytes(self.dropped_bytes)})"
        )

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        # Jupyter shows the table when the report is a cell's last expression.
        printer.text(str(self))


# ---------------------------------------------------------------------------
# Shared by both ways (reading saved tensors is ckptlib.autograd_walk's)
# ---------------------------------------------------------------------------


def _grad_fns(value: Any) -> list[Any]:
    leaves, _ = tree_flatten(value)
    return [
        leaf.grad_fn
        for leaf in leaves
        if isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None
    ]


def _kind_of(tensor: torch.Tensor) -> str:
    base = tensor._base if tensor._base is not None else tensor
    return "parameter" if isinstance(base, nn.Parameter) else "activation"


def _state_storages(module: nn.Module, recurse: bool) -> dict[StorageWeakRef, str]:
    """The storages of ``module``'s parameters and buffers -> ``"parameter"`` / ``"buffer"``."""
    state = {
        StorageWeakRef(buffer.untyped_storage()): "buffer"
        for buffer in module.buffers(recurse=recurse)
    }
    state.update(
        (StorageWeakRef(p.untyped_storage()), "parameter")
        for p in module.parameters(recurse=recurse)
    )
    return state


def _short_op(func: Any) -> str:
    name = getattr(func, "__name__", str(func))
    return name.strip("_") if name.startswith("__") else name


def _region_label(labels: dict[Any, str], region: Any) -> str:
    """``"Sequential@17"`` -> ``"Sequential#0"``: ckptlib numbers regions process-wide, a report
    numbers them per name in order of appearance, so printed reports are reproducible."""
    if region not in labels:
        name = getattr(region, "name", region)   # a RegionId, or a label such as torch's checkpoint
        labels[region] = (
            f"{name}#{sum(label.rsplit('#', 1)[0] == name for label in labels.values())}"
        )
    return labels[region]


def _attribute_label(record: SavedRecord) -> str:
    """The attribute a row names: ``"mat1"``, ``"saved_tensors"``, ``"tensors[1]"`` in a list
    of several."""
    label = record.attribute.removeprefix("_saved_")
    return f"{label}[{record.index}]" if record.count > 1 else label


# ---------------------------------------------------------------------------
# record_saved: watching a forward pass
# ---------------------------------------------------------------------------


@dataclass
class _Save:
    """A save as recorded in forward; becomes a SavedTensor when the block ends."""

    module: str
    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    storage: StorageWeakRef  # identity of the storage (keeps no memory alive)
    storage_bytes: int
    kind: str
    status: str
    seq: int  # newest autograd node when saved: the node saving it (nodes are numbered)
    region: str = ""
    node: str = "?"
    attribute: str = ""
    trace_position: int | None = None  # set for saves made outside any torch function


class _Packed:
    """What autograd stores under ``record_saved``'s own hook: the detached tensor and its save."""

    __slots__ = ("tensor", "save")

    def __init__(self, tensor: torch.Tensor, save: _Save) -> None:
        self.tensor, self.save = tensor, save


class _Recorder(TorchFunctionMode):
    """The machinery behind :func:`record_saved` (see the module notes)."""

    def __init__(self, trace: CheckpointTrace) -> None:
        super().__init__()
        self.trace = trace
        self.saves: list[_Save] = []
        self.dropped: dict[tuple[str, int], _Save] = {}  # (region, index) -> save
        self.module_path: list[str] = []
        self.module_names: dict[nn.Module, str] = {}
        self.state: dict[StorageWeakRef, str] = {}  # parameter/buffer storages -> kind
        self.op = ""
        self.in_call = False
        self.named_upto = 0

    @staticmethod
    def recording() -> bool:
        """Forward only: saves made by backward (``create_graph``) or recomputation are not
        recorded."""
        return torch._C._current_graph_task_id() == -1 and not is_recomputing()

    # -- modules ------------------------------------------------------------
    def enter_module(self, module: nn.Module, args: Any) -> None:
        if not self.recording():
            return
        if not self.module_path and module not in self.module_names:
            self.module_names = {sub: name for name, sub in module.named_modules()}
        parent = self.module_path[-1] if self.module_path else ""
        fallback = f"{parent}.{type(module).__name__}" if parent else ""
        self.module_path.append(self.module_names.get(module, fallback))
        self.state.update(_state_storages(module, recurse=False))

    def leave_module(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.recording() and self.module_path:
            self.module_path.pop()

    # -- packing ------------------------------------------------------------
    def record(self, tensor: torch.Tensor, status: str) -> _Save:
        storage = tensor.untyped_storage()
        key = StorageWeakRef(storage)
        save = _Save(
            self.module_path[-1] if self.module_path else "",
            self.op if self.in_call else "",
            tuple(tensor.shape),
            tensor.dtype,
            tensor.numel() * tensor.element_size(),
            key,
            storage.nbytes(),
            self.state.get(key, _kind_of(tensor)),
            status,
            torch._C._autograd._get_sequence_nr() - 1,
        )
        if not self.in_call:
            save.trace_position = len(self.trace.events)
        self.saves.append(save)
        return save

    def pack(self, tensor: torch.Tensor) -> Any:
        detached = tensor.detach()
        return _Packed(detached, self.record(tensor, "kept")) if self.recording() else detached

    def unpack(self, packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Packed) else packed

    def pack_under(self, inner_pack: Callable[[torch.Tensor], Any], tensor: torch.Tensor) -> Any:
        """Pack for the hook that is on top (a checkpoint's), noting what it did with the tensor."""
        events_before = len(self.trace.events)
        packed = inner_pack(tensor)
        if self.recording():
            save = self.record(tensor, "hooked")
            event = self.trace.events[-1] if len(self.trace.events) > events_before else None
            if event is not None and event.kind == "pack" and event.index is not None:
                save.status, save.region = "dropped", event.region
                self.dropped[(event.region, event.index)] = save
        return packed

    # -- each torch function call --------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.recording():
            return func(*args, **kwargs)
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        hooks = contextlib.nullcontext()
        if top is not None and top[0] != self.pack:
            hooks = torch.autograd.graph.saved_tensors_hooks(
                partial(self.pack_under, top[0]), top[1]
            )
        self.op, self.in_call = _short_op(func), True
        try:
            with hooks:
                out = func(*args, **kwargs)
        finally:
            self.in_call = False
        self.name_new_saves(out)
        return out

    def name_new_saves(self, out: Any) -> None:
        """Find the node and attribute of the saves made since the last call (see the notes)."""
        new = self.saves[self.named_upto :]
        self.named_upto = len(self.saves)
        if not new or any(save.status == "hooked" for save in new):
            return  # nothing to name, or a foreign hook whose unpack might recompute
        for node in walk(_grad_fns(out), first=min(save.seq for save in new)).nodes:
            for record in read_saved(node):
                save = self.save_of(record)
                if save is not None:
                    save.node, save.attribute = node.name(), _attribute_label(record)

    def save_of(self, record: SavedRecord) -> _Save | None:
        """The recorded save behind a saved tensor: what this recorder's pack stored, or what a
        checkpoint dropped (known by its region and index)."""
        if isinstance(record.packed, _Packed):
            return record.packed.save
        if record.info is not None:
            return self.dropped.get((record.info.region, record.info.index))
        return None

    # -- the report -----------------------------------------------------------
    def finish(self) -> list[SavedTensor]:
        storages: dict[StorageWeakRef, str] = {}
        regions: dict[str, str] = {}
        rows = []
        for save in self.saves:
            if save.node == "?" and save.trace_position is not None:
                region = self._region_starting_at(save.trace_position)
                if region is not None:  # checkpoint() kept this input of a region starting here
                    save.op, save.node, save.attribute, save.region = (
                        "checkpoint",
                        "checkpoint",
                        "input",
                        region,
                    )
            rows.append(
                SavedTensor(
                    save.module,
                    save.op,
                    save.node,
                    save.attribute,
                    save.shape,
                    save.dtype,
                    save.nbytes,
                    storages.setdefault(save.storage, f"s{len(storages)}"),
                    save.storage_bytes,
                    save.kind,
                    save.status,
                    _region_label(regions, save.region) if save.region else "",
                )
            )
        return rows

    def _region_starting_at(self, position: int) -> str | None:
        """The region of the first trace event at ``position``, if no earlier event names it."""
        events = self.trace.events
        if position >= len(events):
            return None
        region = events[position].region
        return None if any(event.region == region for event in events[:position]) else region


@contextlib.contextmanager
def record_saved(model: nn.Module | None = None) -> Iterator[SavedTensorsReport]:
    """Record every tensor autograd saves inside the block; the report fills when it ends.

    ``model``: mark all its parameters and buffers as such, also where code outside their own
    module's ``forward`` uses them (module hooks find the others).

    >>> import torch
    >>> from ckptlib.models import MLPChain
    >>> model = MLPChain(depth=2, width=8)
    >>> x, _ = model.example_batch(batch=4)
    >>> with record_saved() as saved:
    ...     y = model(x)
    >>> print(saved)   # x needs no gradient, so the first Linear does not save its weight
    module      op      node            saved   shape  dtype    bytes  storage  kind        status
    blocks.0.0  linear  AddmmBackward0  mat1    4x8    float32  128 B  s0       activation  kept
    blocks.0.1  relu    ReluBackward0   result  4x8    float32  128 B  s1       activation  kept
    blocks.1.0  linear  AddmmBackward0  mat1    4x8    float32  128 B  s1       activation  kept
    blocks.1.0  linear  AddmmBackward0  mat2    8x8    float32  256 B  s2       parameter   kept
    blocks.1.1  relu    ReluBackward0   result  4x8    float32  128 B  s3       activation  kept
    activations kept: 384 B in 3 storages
    parameters and buffers saved: 256 B (not counted: they live anyway)
    """
    _check_model(model, "record_saved")
    report = SavedTensorsReport()
    with record_trace() as trace:
        recorder = _Recorder(trace)
        if model is not None:
            recorder.state.update(_state_storages(model, recurse=True))
        pre = torch.nn.modules.module.register_module_forward_pre_hook(recorder.enter_module)
        post = torch.nn.modules.module.register_module_forward_hook(
            recorder.leave_module, always_call=True
        )
        try:
            with torch.autograd.graph.saved_tensors_hooks(recorder.pack, recorder.unpack), recorder:
                yield report
        finally:
            pre.remove()
            post.remove()
    report.rows = recorder.finish()


# ---------------------------------------------------------------------------
# saved_tensors_report: a function to run, or a graph that exists
# ---------------------------------------------------------------------------


def saved_tensors_report(
    outputs_or_fn: Outputs | Callable[[], Any], model: nn.Module | None = None
) -> SavedTensorsReport:
    """What autograd saved: for a function (run under :func:`record_saved`, with modules and
    functions named) or for the graph behind existing output tensors (walked node by node).

    ``outputs_or_fn``: a function to run with no arguments (``lambda: model(x)``), or a tensor
    or a list, tuple or dict of tensors (what a forward returned). ``model``: mark its
    parameters and buffers as such (a graph does not know them; a recorded function finds
    most of them through the module hooks).

    >>> import torch
    >>> from ckptlib import checkpoint
    >>> x = torch.randn(4, 8, requires_grad=True)
    >>> report = saved_tensors_report(lambda: checkpoint(lambda t: t.sin().exp(), x))
    >>> [(row.node, row.attribute, row.status) for row in report.rows]
    ... # doctest: +NORMALIZE_WHITESPACE
    [('checkpoint', 'input', 'kept'), ('SinBackward0', 'self', 'dropped'),
     ('ExpBackward0', 'result', 'dropped')]
    >>> report.kept_bytes, report.dropped_bytes   # x is kept; sin's output was dropped
    (128, 128)
    """
    _check_model(model, "saved_tensors_report")
    accepts = (
        "a function to run with no arguments (saved_tensors_report(lambda: model(x))), or the "
        "output tensor(s) of a forward pass (a tensor, or a list, tuple or dict of tensors)"
    )
    if isinstance(outputs_or_fn, nn.Module):
        raise TypeError(
            f"saved_tensors_report: outputs_or_fn is the module {type(outputs_or_fn).__name__} "
            f"itself; it must be {accepts}."
        )
    if callable(outputs_or_fn) and not isinstance(outputs_or_fn, torch.Tensor):
        function(
            outputs_or_fn, "outputs_or_fn", takes=0, accepts=accepts, where="saved_tensors_report"
        )
        with record_saved(model) as report:
            outputs = outputs_or_fn()
        del outputs  # the graph had to live until the block ended; the rows keep no tensors
        return report
    leaves, _ = tree_flatten(outputs_or_fn)
    if not any(isinstance(leaf, torch.Tensor) for leaf in leaves):
        error = ValueError if isinstance(outputs_or_fn, (list, tuple, dict)) else TypeError
        raise error(
            f"saved_tensors_report: outputs_or_fn must be {accepts}; {got(outputs_or_fn)}, "
            "which holds no tensor."
        )
    return _walk_report(
        _grad_fns(outputs_or_fn), _state_storages(model, recurse=True) if model is not None else {}
    )


def _check_model(model: Any, where: str) -> None:
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(
            f"{where}: model must be an nn.Module (its parameters and buffers are marked as such) "
            f"or None, {got(model)}."
        )


def _walk_report(roots: Sequence[Any], state: dict[StorageWeakRef, str]) -> SavedTensorsReport:
    # Storage keys: ("storage", address) for a tensor in memory, ("dropped", ...) for one a
    # checkpoint dropped. ``refs`` holds a weak reference to every storage seen, so no
    # address can be reused by a new storage during the walk.
    labels: dict[tuple, str] = {}
    refs: list[StorageWeakRef] = []
    regions: dict[str, str] = {}
    rows = []
    for node in walk(roots).nodes:
        for record in read_saved(node):
            label = _attribute_label(record)
            if record.status in ("freed", "modified") or record.shape is None:
                # Nothing held (or backward would fail); or torch's records moved: nothing known.
                continue
            if record.status != "kept":
                # Dropped by a checkpoint: only its metadata is known, so it gets a storage of
                # its own and kind "unknown" (it may have been a parameter).
                info = record.info
                key = ("dropped", info.region, info.index) if info else ("dropped", len(rows))
                storage_bytes, kind, status = record.nbytes, "unknown", "dropped"
                region = _region_label(regions, record.region) if record.region else ""
            else:
                storage = record.tensor.untyped_storage()
                ref = StorageWeakRef(storage)
                refs.append(ref)
                key = ("storage", ref.cdata)
                storage_bytes, kind = storage.nbytes(), state.get(ref, _kind_of(record.tensor))
                status, region = "kept", ""
            rows.append(
                SavedTensor(
                    "",
                    "",
                    node.name(),
                    label,
                    record.shape,
                    record.dtype,
                    record.nbytes,
                    labels.setdefault(key, f"s{len(labels)}"),
                    storage_bytes,
                    kind,
                    status,
                    region,
                )
            )
    return SavedTensorsReport(rows)
