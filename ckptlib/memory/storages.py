"""The live-storage count behind ``backend="tensors"``: which memory the ops of a block made,
alive until it dies, and the most of it alive at once. Exact on any device.

After each aten op the meter (:mod:`ckptlib.memory.meter`) hands the op's outputs to
:meth:`LiveStorages.after_op`, which asks: is this storage new? An output whose schema says it
aliases an input (a view, an in-place or ``out=`` result) allocates nothing; neither does one
whose storage is already counted or belongs to an input (what the schema says, and which
blocks a tensor holds, is :mod:`ckptlib.memory.allocations`). Every new storage is counted
with its ``nbytes`` until it dies, which a weak reference to the Python storage object
reports: PyTorch keeps that object alive exactly as long as the C++ storage, so its weakref
callback fires when the memory is given back. This is how torch's private ``MemTracker``
counts, and it is exact for every tensor an op returns; what it cannot see is scratch memory
*inside* a kernel.

Three ways to allocate escape the rule "a new storage in an op's output": ``torch.tensor
([...])`` makes its tensor outside dispatch and hands it over through an alias op
(``aten.lift_fresh``), counted when torch's allocator owns it (not NumPy memory lent by
``torch.as_tensor``); ``resize_`` and ``out=`` give a tensor written in place a larger
storage, counted by comparing sizes around the op (for a moment old and new both exist); and
``tensor.untyped_storage().resize_(n)`` runs no op at all, so while a tensor meter runs,
``UntypedStorage.resize_`` reports to it (:func:`listen_to_storage_resizes`; the original
method is back when the last meter ends).

Storages can die in any thread; the counts are updated under a lock.
"""

from __future__ import annotations

import threading
import weakref
from functools import partial
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from ckptlib.memory.allocations import (
    OpShape,
    address,
    input_addresses,
    memory_of,
    resizable_written,
)

__all__ = ["LiveStorages", "listen_to_storage_resizes", "ORIGINAL_STORAGE_RESIZE"]


class LiveStorages:
    """The blocks of memory the ops of a block allocated that are alive now: ``live_bytes``, and
    ``peak_bytes``, the most that were alive at once. Only memory on ``device`` (None: every
    device) is counted."""

    def __init__(self, device: torch.device | None) -> None:
        self.device = device
        self._lock = threading.Lock()
        self._blocks: dict[int, tuple[weakref.ref, int]] = {}  # id(owner) -> (weakref, nbytes)
        self.live_bytes = 0  # bytes of counted blocks alive now
        self.peak_bytes = 0  # highest live_bytes since restart_peak

    def restart_peak(self) -> int:
        """Start a new block: the peak is what is alive now, which is returned."""
        with self._lock:
            self.peak_bytes = self.live_bytes
            return self.live_bytes

    # -- per op (runs inside __torch_dispatch__: keep it lean) -------------
    def before_writing(self, shape: OpShape, args: tuple, kwargs: dict) -> tuple | None:
        """Before an op that writes tensors it may resize: their memory now, and its inputs'
        addresses (what :meth:`after_op` compares with)."""
        written = [(tensor, memory_of(tensor)) for tensor in resizable_written(shape, args, kwargs)]
        return (written, input_addresses(args)) if written else None

    def after_op(self, shape: OpShape, args: tuple, out: Any, written: tuple | None) -> None:
        """Count the memory an op's outputs (and the tensors it wrote) hold that is new."""
        if written is not None:
            self._count_written(*written)
        if shape.fresh:
            self._count_fresh(out)
        elif shape.may_be_new is not None:
            if isinstance(out, torch.Tensor):
                self._count(out, args)
            else:
                # Several returns (aten.native_layer_norm), or one list of tensors
                # (aten._foreach_mul).
                for value, maybe in zip(
                    (out,) if len(shape.may_be_new) == 1 else out, shape.may_be_new
                ):
                    for tensor in value if isinstance(value, (list, tuple)) else (value,):
                        if maybe and isinstance(tensor, torch.Tensor):
                            self._count(tensor, args)

    def _count(self, tensor: torch.Tensor, args: tuple) -> None:
        if tensor.is_meta or (self.device is not None and tensor.device != self.device):
            return  # meta tensors have a shape but no memory
        if (
            type(tensor) is torch.Tensor and tensor.layout is torch.strided
        ):  # the common case: one storage
            storage = tensor.untyped_storage()
            if id(storage) not in self._blocks:
                self._count_block(storage, storage.nbytes(), args)
            return
        for owner, nbytes in memory_of(tensor):
            if id(owner) not in self._blocks:
                self._count_block(owner, nbytes, args)

    def _count_block(self, owner: Any, nbytes: int, args: tuple) -> None:
        # Not empty, and not an input's memory returned by an op whose schema does not say so
        # (aten._unsafe_view, a sparse tensor built on its index and value tensors): allocated here.
        if nbytes and address(owner) not in input_addresses(args):
            self._track(owner, nbytes)

    def _count_fresh(self, tensor: torch.Tensor) -> None:
        """``aten.lift_fresh`` hands dispatch a tensor made outside it: new memory from
        ``torch.tensor``, but NumPy's own memory (made before) from
        ``torch.as_tensor``/``torch.from_numpy``. Only memory torch's allocator gave this tensor
        can be resized: that is what the block allocated."""
        if tensor.is_meta or (self.device is not None and tensor.device != self.device):
            return
        for owner, nbytes in memory_of(tensor):
            if (
                id(owner) not in self._blocks
                and nbytes
                and isinstance(owner, torch.UntypedStorage)
                and owner.resizable()
            ):
                self._track(owner, nbytes)

    def _count_written(self, written: list, inputs: set[int]) -> None:
        """After an op that may write tensors: memory they hold now that they did not (a sparse
        ``add_``'s new values), or memory whose size the op changed (``resize_``, ``out=``).
        ``inputs``: the addresses of the op's arguments' memory before it ran."""
        for tensor, before in written:
            if self.device is not None and tensor.device != self.device:
                continue
            sizes = {id(owner): nbytes for owner, nbytes in before}
            for owner, nbytes in memory_of(tensor):
                if id(owner) in sizes:
                    if nbytes != sizes[id(owner)]:
                        self.resized(owner, sizes[id(owner)], nbytes, inside=True)
                elif nbytes and id(owner) not in self._blocks and address(owner) not in inputs:
                    self._track(
                        owner, nbytes
                    )  # (set_ gives a tensor another's storage: an input's)

    # -- the ledger ---------------------------------------------------------
    def resized(self, owner: Any, old_nbytes: int, new_nbytes: int, inside: bool) -> None:
        """A block of memory was reallocated from ``old_nbytes`` to ``new_nbytes``: for a moment
        both exist (the contents are copied over), then the old one is freed. Memory not counted
        (made before the block) counts from here on if the block resized it (``inside``)."""
        with self._lock:
            record = self._blocks.get(id(owner))
            if record is not None:
                self._blocks[id(owner)] = (record[0], new_nbytes)
                if new_nbytes:
                    self.peak_bytes = max(self.peak_bytes, self.live_bytes + new_nbytes)
                self.live_bytes += new_nbytes - old_nbytes
                return
        if inside and new_nbytes:
            self._track(owner, new_nbytes)

    def _track(self, owner: Any, nbytes: int) -> None:
        key = id(owner)
        record = (weakref.ref(owner, partial(self._died, key)), nbytes)
        # Nothing inside the lock creates a Python container, so no garbage collection (and
        # no storage death calling _died in this thread) can start while it is held.
        with self._lock:
            self._blocks[key] = record
            self.live_bytes += nbytes
            if self.live_bytes > self.peak_bytes:
                self.peak_bytes = self.live_bytes

    def _died(self, key: int, _ref: weakref.ref) -> None:
        # Runs in whichever thread dropped the last reference to the storage.
        with self._lock:
            _, nbytes = self._blocks.pop(key)
            self.live_bytes -= nbytes


# Resizing a storage directly (``tensor.untyped_storage().resize_(0)``, as FSDP does to free a
# gathered parameter) calls no aten op, so no dispatch mode sees it. While a tensor meter runs,
# ``UntypedStorage.resize_`` tells the running meters; the original comes back when the last ends.
ORIGINAL_STORAGE_RESIZE = torch.UntypedStorage.resize_
_resize_listeners: list[tuple[LiveStorages, TorchDispatchMode]] = []
_resize_listeners_lock = threading.Lock()


def _storage_resize_(storage: torch.UntypedStorage, size: int) -> Any:
    old_nbytes = storage.nbytes()
    result = ORIGINAL_STORAGE_RESIZE(storage, size)
    for storages, watcher in list(_resize_listeners):
        # Inside the block when its meter's watcher is running in this thread.
        inside = watcher in _get_current_dispatch_mode_stack()
        storages.resized(storage, old_nbytes, storage.nbytes(), inside=inside)
    return result


def listen_to_storage_resizes(
    storages: LiveStorages, watcher: TorchDispatchMode, listen: bool
) -> None:
    """Tell ``storages`` of every ``UntypedStorage.resize_`` from now on (``listen=False``: no
    more); ``watcher`` is the dispatch mode of its meter, running in the threads of its block."""
    with _resize_listeners_lock:
        if listen:
            _resize_listeners.append((storages, watcher))
        else:
            _resize_listeners.remove((storages, watcher))
        torch.UntypedStorage.resize_ = (
            _storage_resize_ if _resize_listeners else ORIGINAL_STORAGE_RESIZE
        )
