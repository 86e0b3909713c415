"""``record_saved()``: every tensor autograd saves during a forward pass, with the module and
the torch function that saved it.

Its pack hook (``torch.autograd.graph.saved_tensors_hooks``) sees every tensor autograd
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
autograd never passes to saved-tensor hooks: walking the graph
(:mod:`ckptlib.inspect.walking`) lists it, recording cannot (8 bytes each).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode

from ckptlib.autograd_walk import SavedRecord, read_saved, walk
from ckptlib.core.checkpoint import is_recomputing
from ckptlib.core.trace import CheckpointTrace, record_trace
from ckptlib.inspect.labels import (
    attribute_label,
    check_model,
    grad_fns,
    kind_of,
    region_label,
    state_storages,
)
from ckptlib.inspect.report import SavedTensor, SavedTensorsReport

__all__ = ["record_saved"]


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


def _short_op(func: Any) -> str:
    """A torch function's name as a row shows it: ``linear``, ``add`` for ``Tensor.__add__``."""
    name = getattr(func, "__name__", str(func))
    return name.strip("_") if name.startswith("__") else name


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
        self.state.update(state_storages(module, recurse=False))

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
            self.state.get(key, kind_of(tensor)),
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
        for node in walk(grad_fns(out), first=min(save.seq for save in new)).nodes:
            for record in read_saved(node):
                save = self.save_of(record)
                if save is not None:
                    save.node, save.attribute = node.name(), attribute_label(record)

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
                    region_label(regions, save.region) if save.region else "",
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
    check_model(model, "record_saved")
    report = SavedTensorsReport()
    with record_trace() as trace:
        recorder = _Recorder(trace)
        if model is not None:
            recorder.state.update(state_storages(model, recurse=True))
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
