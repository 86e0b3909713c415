"""Memory meters: how many bytes a block of code holds at its worst moment.

Two ways to count
=================

``backend="allocator"`` (CUDA). PyTorch's caching allocator already counts
every byte handed to a tensor: ``torch.cuda.memory_allocated()`` now and
``torch.cuda.max_memory_allocated()`` since the last
``reset_peak_memory_stats()``. The meter resets the peak at entry and reads
both at exit (synchronising first, so queued kernels have run). This is the
number that decides whether a step fits on the GPU, including kernel
workspaces no Python code ever sees.

``backend="tensors"`` (any device; the default off CUDA). A
``TorchDispatchMode`` sees every aten op below autograd, forward and backward.
After each op it looks at the op's outputs and asks: is this storage new? An
output whose schema says it aliases an input (a view such as ``w.t()``, an
in-place or ``out=`` result) allocates nothing; neither does one whose storage
is already counted or belongs to an input. Every new storage is counted with
its ``nbytes`` until it dies, which a weak reference to the Python storage
object reports: PyTorch keeps that object alive exactly as long as the C++
storage, so its weakref callback fires when the memory is given back. This is
how torch's private ``MemTracker`` counts, and it is exact for every tensor an
op returns; what it cannot see is scratch memory *inside* a kernel.

Not every tensor is one storage. A sparse COO tensor holds an index and a value
tensor (a compressed one, CSR and the like, three); a wrapper subclass that says
what it wraps (``__tensor_flatten__``: nested jagged tensors, DTensor) holds its
inner tensors; each of those storages is counted. An MKL-DNN tensor holds an
opaque buffer of ``numel * element_size`` bytes, freed with the tensor. Three
ways to allocate escape the rule "a new storage in an op's output": ``torch.tensor
([...])`` makes its tensor outside dispatch and hands it over through an alias op
(``aten.lift_fresh``), counted when torch's allocator owns it (not NumPy memory
lent by ``torch.as_tensor``); ``resize_`` and ``out=`` give a tensor written in
place a larger storage, counted by comparing sizes around the op (for a moment
old and new both exist); and ``tensor.untyped_storage().resize_(n)`` runs no op at
all, so while a tensor meter runs, ``UntypedStorage.resize_`` reports to it (the
original method is back when the last meter ends).

What the numbers mean
=====================

``baseline_bytes`` is what the meter could see as live when the block began.
For the allocator that is everything already on the device (parameters,
optimizer state, the batch). The tensor meter only knows storages it watched
being born, so a fresh meter starts at 0 (tensors made before the block are
invisible to it, parameters included); a meter entered again reports what is
still alive from its earlier blocks (say, the ``.grad`` of the last step).

``peak_bytes`` is the most memory *allocated inside the block* that was live
at one time, i.e. the peak minus ``baseline_bytes``: the cost of running the
block, which is what checkpointing changes. Each timeline entry's
``live_bytes`` uses the same zero, so ``max`` over the timeline is the peak
(on the allocator, a kernel's scratch space can add a little on top).

The timeline has one entry per aten op: its index, name, phase and live bytes
right after it. Phase is ``"backward"`` while autograd runs a backward pass
(``torch._C._current_graph_task_id() != -1``) and ``"recompute"`` while a
ckptlib checkpoint re-runs its function (``torch.utils.checkpoint``'s
recomputation shows up as ``"backward"``: torch gives no public flag for it).

Threads. Dispatch modes are thread-local, but autograd copies the calling
thread's state (dispatch modes included) to the worker threads that run a
CUDA backward, so a backward started inside the block is seen whichever thread
runs it. Storages can die in any thread; the counts are updated under a lock.
A backward started from *another* Python thread is not seen.

Nesting. Tensor meters nest (each counts for itself). Allocator meters do not:
each resets the device's one peak counter, so an outer one would lose its peak.

>>> from ckptlib.models import MLPChain
>>> model = MLPChain(depth=4, width=32)
>>> batch = model.example_batch(batch=8)
>>> report = measure(lambda: model.training_step(batch))
>>> report.peak_bytes      # 4 layers of gradients, the loss, one gradient, the seed
18948
>>> sorted({entry.phase for entry in report.timeline})
['backward', 'forward']
"""

from __future__ import annotations

import math
import numbers
import threading
import weakref
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from ckptlib._arguments import flag, function, got, integer
from ckptlib.core.checkpoint import is_recomputing
from ckptlib.storage import storage_ptr

__all__ = ["MemoryMeter", "MemoryReport", "TimelineEntry", "measure", "format_bytes", "unit_for"]

BACKENDS = ("allocator", "tensors")
PHASES = ("forward", "backward", "recompute")


_UNITS = (("B", 1), ("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30))


def format_bytes(nbytes: float, digits: int = 2) -> str:
    """``1536 -> '1.50 KiB'``: bytes in binary units, for tables, reports and pictures.

    ``digits``: decimals after the point in KiB and up (whole bytes have none); the graphs'
    boxes use 1.

    >>> format_bytes(512), format_bytes(3 * 2**20), format_bytes(float("nan"))
    ('512 B', '3.00 MiB', 'nan B')
    >>> format_bytes(1536, digits=1)
    '1.5 KiB'
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Real):
        raise TypeError(
            f"format_bytes: nbytes must be a number of bytes (int or float), {got(nbytes)}."
        )
    integer(digits, "digits (decimals shown)", least=0, where="format_bytes")
    if not math.isfinite(nbytes):
        return f"{nbytes} B"  # a table cell that says what it is, rather than a crash
    power = 0
    while abs(nbytes) >= 1024 and power < len(_UNITS) - 1:
        nbytes, power = nbytes / 1024, power + 1
    return f"{int(nbytes)} B" if power == 0 else f"{nbytes:.{digits}f} {_UNITS[power][0]}"


def unit_for(max_bytes: float) -> tuple[str, int]:
    """The unit an axis of values up to ``max_bytes`` reads best in: ``(name, bytes in one)``, the
    largest of B, KiB and MiB that ``max_bytes`` holds at least twice.

    >>> unit_for(3 * 2**20), unit_for(1500), unit_for(0)
    (('MiB', 1048576), ('B', 1), ('B', 1))
    """
    return next(
        ((name, size) for name, size in reversed(_UNITS[:3]) if max_bytes >= 2 * size), _UNITS[0]
    )


class TimelineEntry(NamedTuple):
    """One aten op as the meter saw it: live bytes are counted from the block's baseline."""

    index: int
    op: str
    phase: str
    live_bytes: int


@dataclass(frozen=True)
class MemoryReport:
    """What a :class:`MemoryMeter` measured over one block (see the module notes for the zero)."""

    peak_bytes: int
    baseline_bytes: int
    retained_bytes: int
    backend: str
    device: str
    timeline: list[TimelineEntry] = field(repr=False)

    @property
    def peak_by_phase(self) -> dict[str, int]:
        """The highest ``live_bytes`` the timeline reached in each phase that occurred."""
        peaks: dict[str, int] = {}
        for entry in self.timeline:
            peaks[entry.phase] = max(peaks.get(entry.phase, entry.live_bytes), entry.live_bytes)
        return peaks

    def __str__(self) -> str:
        counts = {phase: 0 for phase in PHASES}
        for entry in self.timeline:
            counts[entry.phase] += 1
        ops = ", ".join(f"{count} {phase}" for phase, count in counts.items() if count)
        return (
            f"peak {format_bytes(self.peak_bytes)} above a baseline of "
            f"{format_bytes(self.baseline_bytes)}; {format_bytes(self.retained_bytes)} still live "
            f"at the end ({self.backend} meter on {self.device}; ops: {ops or 'none recorded'})"
        )


class _OpShape(NamedTuple):
    """What the meter needs to know about one aten op, read once from its schema."""

    name: str
    may_be_new: tuple[bool, ...] | None  # per return: may it hold new memory? None: no return may
    written: tuple[int | str, ...]  # positions (or keyword names) of the tensors it writes
    resizes: bool  # may it give a strided tensor it writes memory of another size?
    keeps_storage: bool  # writes only its first argument, in place (add_): same storage
    fresh: bool  # aten.lift_fresh: hands over a tensor made outside dispatch


# In-place ops keep a strided tensor's storage, except these (and ``out=`` arguments, which are
# resized to fit); a sparse tensor written in place may get new index and value tensors.
_RESIZING_OPS = {"resize_", "resize_as_", "set_", "_resize_output_"}


def _op_shape(func: Any) -> _OpShape:
    """A return may hold new memory unless it is no tensor (``aten._local_scalar_dense`` returns a
    number) or the schema says it aliases an input; an argument marked ``(a!)`` is written."""
    schema = func._schema
    may_be_new = tuple(
        ret.alias_info is None and "Tensor" in str(ret.type) for ret in schema.returns
    )
    written = [
        (position, argument)
        for position, argument in enumerate(schema.arguments)
        if argument.alias_info is not None
        and argument.alias_info.is_write
        and "Tensor" in str(argument.type)
    ]
    name = func._overloadpacket.__name__
    places = tuple(
        argument.name if argument.kwarg_only else position for position, argument in written
    )
    resizes = name in _RESIZING_OPS or any(argument.kwarg_only for _, argument in written)
    return _OpShape(
        name,
        may_be_new if any(may_be_new) else None,
        places,
        resizes,
        not resizes and places == (0,) and "[]" not in str(written[0][1].type),
        func is torch.ops.aten.lift_fresh.default,
    )


_COMPRESSED_PARTS = {
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}


def _memory_of(tensor: torch.Tensor) -> list[tuple[Any, int]]:
    """(owner, bytes) for each block of memory ``tensor`` holds; the owner lives exactly as long
    as the block.

    A strided tensor holds its storage. A sparse COO tensor holds no storage of its own but two
    tensors, indices and values; a compressed one (CSR, CSC, BSR, BSC) three. A wrapper subclass
    that says what it wraps (``__tensor_flatten__``: a nested jagged tensor, DTensor, ...) holds
    its inner tensors. An MKL-DNN tensor holds an opaque buffer of its elements, freed with the
    tensor itself. Anything else that has no storage shows no memory (the meter cannot see it).
    """
    layout = tensor.layout
    if layout is torch.strided and type(tensor) is torch.Tensor:  # the common case, first
        storage = tensor.untyped_storage()
        return [(storage, storage.nbytes())]
    if layout is torch.sparse_coo:
        return _memory_of(tensor._indices()) + _memory_of(tensor._values())
    if layout in _COMPRESSED_PARTS:
        return [
            block
            for part in _COMPRESSED_PARTS[layout]
            for block in _memory_of(getattr(tensor, part)())
        ]
    if layout is torch._mkldnn:  # type: ignore[attr-defined]
        return [(tensor, tensor.numel() * tensor.element_size())]
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is not None and type(tensor) is not torch.Tensor:
        inner = [getattr(tensor, name) for name in flatten()[0]]
        return [
            block for part in inner if isinstance(part, torch.Tensor) for block in _memory_of(part)
        ]
    try:
        storage = tensor.untyped_storage()
        return [(storage, storage.nbytes())]
    except (RuntimeError, NotImplementedError):
        return []


def _address(owner: Any) -> int:
    """Where a block of memory is: a storage's data pointer, an opaque tensor's identity."""
    return owner.data_ptr() if isinstance(owner, torch.UntypedStorage) else id(owner)


def _input_addresses(args: tuple) -> set[int]:
    """Addresses of the memory an op's tensor arguments hold (also inside list arguments)."""
    addresses = set()
    for arg in args:
        for tensor in arg if isinstance(arg, (list, tuple)) else (arg,):
            if type(tensor) is torch.Tensor and tensor.layout is torch.strided:  # the common case
                addresses.add(storage_ptr(tensor))
            elif isinstance(tensor, torch.Tensor):
                addresses.update(_address(owner) for owner, _ in _memory_of(tensor))
    return addresses


def _resizable_written(shape: _OpShape, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an op writes that it may give memory of another size (see ``_RESIZING_OPS``)."""
    found = []
    for where in shape.written:
        value = (
            kwargs.get(where)
            if isinstance(where, str)
            else args[where]
            if where < len(args)
            else None
        )
        for tensor in value if isinstance(value, (list, tuple)) else (value,):
            if (
                isinstance(tensor, torch.Tensor)
                and not tensor.is_meta
                and (shape.resizes or tensor.layout is not torch.strided)
            ):
                found.append(tensor)
    return found


class _OpWatcher(TorchDispatchMode):
    """Calls back into the meter after every aten op (the only per-op Python code)."""

    def __init__(self, meter: "MemoryMeter") -> None:
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        meter = self.meter
        # Keyed by id: an OpOverload's own __hash__ is Python code, too slow to run per op.
        described = meter._ops.get(id(func))
        shape = described[1] if described is not None else meter._describe(func)
        written = None
        if shape.written and not (
            shape.keeps_storage
            and type(args[0]) is torch.Tensor
            and args[0].layout is torch.strided
        ):
            written = meter._before_writing(shape, args, kwargs or {})
        out = func(*args, **(kwargs or {}))
        meter._after_op(shape, args, out, written)
        return out


# Resizing a storage directly (``tensor.untyped_storage().resize_(0)``, as FSDP does to free a
# gathered parameter) calls no aten op, so no dispatch mode sees it. While a tensor meter runs,
# ``UntypedStorage.resize_`` tells the running meters; the original comes back when the last ends.
_ORIGINAL_STORAGE_RESIZE = torch.UntypedStorage.resize_
_resize_listeners: list["MemoryMeter"] = []
_resize_listeners_lock = threading.Lock()


def _storage_resize_(storage: torch.UntypedStorage, size: int) -> Any:
    old_nbytes = storage.nbytes()
    result = _ORIGINAL_STORAGE_RESIZE(storage, size)
    for meter in list(_resize_listeners):
        meter._resized(storage, old_nbytes, storage.nbytes(), inside=meter._watcher_active())
    return result


def _listen_to_storage_resizes(meter: "MemoryMeter", listen: bool) -> None:
    with _resize_listeners_lock:
        if listen:
            _resize_listeners.append(meter)
        else:
            _resize_listeners.remove(meter)
        torch.UntypedStorage.resize_ = (
            _storage_resize_ if _resize_listeners else _ORIGINAL_STORAGE_RESIZE
        )


class MemoryMeter:
    """Context manager that measures the memory a block allocates, op by op.

    Args:
        device: the device to count. ``None`` counts tensors on every device.
        backend: ``"allocator"`` (CUDA only), ``"tensors"``, or ``"auto"``: the
            allocator for a CUDA ``device``, else the tensor meter.
        timeline: record one :class:`TimelineEntry` per op in ``self.timeline``
            (the allocator backend needs no per-op work without it).
        on_op: called with each new entry as it is appended, e.g. to update a
            live plot while the step runs.

    During the block, ``meter.live_bytes`` and ``meter.timeline`` can be read at
    any time; after it, ``meter.report()`` returns a :class:`MemoryReport`.

    >>> import torch
    >>> x = torch.randn(256)                  # made before the block: not counted
    >>> with MemoryMeter() as meter:
    ...     y = x.view(16, 16).t()            # views allocate nothing
    ...     z = (y * 2).sum()                 # 1 KiB, then 4 bytes
    ...     del y
    >>> meter.peak_bytes, meter.live_bytes   # the 1 KiB product died after sum
    (1028, 4)
    >>> [(entry.op, entry.live_bytes) for entry in meter.timeline]
    [('view', 0), ('t', 0), ('mul', 1024), ('sum', 1028)]
    """

    def __init__(
        self,
        device: torch.device | str | None = None,
        *,
        backend: str = "auto",
        timeline: bool = True,
        on_op: Callable[[TimelineEntry], None] | None = None,
    ) -> None:
        self.device = _normalised(device)
        self.record_timeline = flag(timeline, "timeline", where="MemoryMeter")
        if on_op is not None:
            function(
                on_op,
                "on_op",
                takes=1,
                where="MemoryMeter",
                accepts="a function called with each TimelineEntry, or None",
            )
            if not timeline:
                raise ValueError(
                    "MemoryMeter: on_op is called with each timeline entry, but timeline=False "
                    "records none; pass timeline=True, or leave on_op out."
                )
        if backend == "auto":
            backend = (
                "allocator" if self.device is not None and self.device.type == "cuda" else "tensors"
            )
        if backend not in BACKENDS:
            raise ValueError(
                f"backend={backend!r} is not a memory meter; use 'allocator' (CUDA), "
                "'tensors' (any device) or 'auto'."
            )
        if backend == "allocator" and (self.device is None or self.device.type != "cuda"):
            raise ValueError(
                f"backend='allocator' reads the CUDA caching allocator, but device={device!r}; "
                "pass device='cuda', or use backend='tensors' to count tensors on any device."
            )
        self.backend = backend
        self.on_op = on_op
        self.timeline: list[TimelineEntry] = []
        self._lock = threading.Lock()
        self._storages: dict[int, tuple[weakref.ref, int]] = {}  # id(owner) -> (weakref, nbytes)
        self._live = 0  # tensors backend: bytes of counted storages alive now
        self._peak = 0  # tensors backend: highest _live since entry
        self._baseline = 0
        self._final: int | None = None
        # id(op) -> (op, what its schema says); holding the op keeps its id unique
        self._ops: dict[int, tuple[Any, _OpShape]] = {}
        self._watcher: _OpWatcher | None = None

    # -- entering and leaving ---------------------------------------------
    def __enter__(self) -> "MemoryMeter":
        if self._watcher is not None:
            raise RuntimeError(
                "this MemoryMeter is already running; use a second MemoryMeter to nest."
            )
        self.timeline = []
        self._final = None
        if self.backend == "allocator":
            torch.cuda.synchronize(self.device)
            self._baseline = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            with self._lock:
                self._baseline = self._peak = self._live
        if self.record_timeline or self.backend == "tensors":
            self._watcher = _OpWatcher(self)
            self._watcher.__enter__()
        if self.backend == "tensors":
            _listen_to_storage_resizes(self, True)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self.backend == "tensors":
            _listen_to_storage_resizes(self, False)
        if self._watcher is not None:
            self._watcher.__exit__(*exc_info)
            self._watcher = None
        if self.backend == "allocator":
            torch.cuda.synchronize(self.device)
            self._peak = torch.cuda.max_memory_allocated(self.device)
        self._final = self._current()

    # -- readings -----------------------------------------------------------
    def _current(self) -> int:
        if self.backend == "allocator":
            return torch.cuda.memory_allocated(self.device)
        return self._live

    @property
    def baseline_bytes(self) -> int:
        """Live bytes the meter could see when the block began (see the module notes)."""
        return self._baseline

    @property
    def live_bytes(self) -> int:
        """Bytes allocated since the block began that are alive now (at exit, once it ended)."""
        return (self._current() if self._final is None else self._final) - self._baseline

    @property
    def peak_bytes(self) -> int:
        """The most bytes allocated inside the block that were alive at one time."""
        if self.backend == "allocator" and self._final is None:
            return torch.cuda.max_memory_allocated(self.device) - self._baseline
        return self._peak - self._baseline

    def report(self) -> MemoryReport:
        """A snapshot of the readings (call it after the block for the final numbers)."""
        return MemoryReport(
            self.peak_bytes,
            self.baseline_bytes,
            self.live_bytes,
            self.backend,
            str(self.device) if self.device is not None else "all devices",
            list(self.timeline),
        )

    # -- per op (runs inside __torch_dispatch__: keep it lean) -------------
    def _describe(self, func: Any) -> _OpShape:
        shape = _op_shape(func)
        self._ops[id(func)] = (func, shape)
        return shape

    def _before_writing(self, shape: _OpShape, args: tuple, kwargs: dict) -> tuple | None:
        """Before an op that writes tensors it may resize: their memory now, and its inputs'
        addresses."""
        if self.backend != "tensors":
            return None
        written = [
            (tensor, _memory_of(tensor)) for tensor in _resizable_written(shape, args, kwargs)
        ]
        return (written, _input_addresses(args)) if written else None

    def _after_op(self, shape: _OpShape, args: tuple, out: Any, written: tuple | None) -> None:
        if self.backend == "tensors":
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
        if self.record_timeline:
            if is_recomputing():
                phase = "recompute"
            elif torch._C._current_graph_task_id() != -1:
                phase = "backward"
            else:
                phase = "forward"
            entry = TimelineEntry._make(
                (len(self.timeline), shape.name, phase, self._current() - self._baseline)
            )
            self.timeline.append(entry)
            if self.on_op is not None:
                self.on_op(entry)

    def _count(self, tensor: torch.Tensor, args: tuple) -> None:
        if tensor.is_meta or (self.device is not None and tensor.device != self.device):
            return  # meta tensors have a shape but no memory
        if (
            type(tensor) is torch.Tensor and tensor.layout is torch.strided
        ):  # the common case: one storage
            storage = tensor.untyped_storage()
            if id(storage) not in self._storages:
                self._count_block(storage, storage.nbytes(), args)
            return
        for owner, nbytes in _memory_of(tensor):
            if id(owner) not in self._storages:
                self._count_block(owner, nbytes, args)

    def _count_block(self, owner: Any, nbytes: int, args: tuple) -> None:
        # Not empty, and not an input's memory returned by an op whose schema does not say so
        # (aten._unsafe_view, a sparse tensor built on its index and value tensors): allocated here.
        if nbytes and _address(owner) not in _input_addresses(args):
            self._track(owner, nbytes)

    def _count_fresh(self, tensor: torch.Tensor) -> None:
        """``aten.lift_fresh`` hands dispatch a tensor made outside it: new memory from
        ``torch.tensor``, but NumPy's own memory (made before) from
        ``torch.as_tensor``/``torch.from_numpy``. Only memory torch's allocator gave this tensor
        can be resized: that is what the block allocated."""
        if tensor.is_meta or (self.device is not None and tensor.device != self.device):
            return
        for owner, nbytes in _memory_of(tensor):
            if (
                id(owner) not in self._storages
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
            for owner, nbytes in _memory_of(tensor):
                if id(owner) in sizes:
                    if nbytes != sizes[id(owner)]:
                        self._resized(owner, sizes[id(owner)], nbytes, inside=True)
                elif nbytes and id(owner) not in self._storages and _address(owner) not in inputs:
                    self._track(
                        owner, nbytes
                    )  # (set_ gives a tensor another's storage: an input's)

    def _resized(self, owner: Any, old_nbytes: int, new_nbytes: int, inside: bool) -> None:
        """A block of memory was reallocated from ``old_nbytes`` to ``new_nbytes``: for a moment
        both exist (the contents are copied over), then the old one is freed. Memory the meter
        does not count (made before the block) counts from here on, if this block resized it."""
        with self._lock:
            record = self._storages.get(id(owner))
            if record is not None:
                self._storages[id(owner)] = (record[0], new_nbytes)
                if new_nbytes:
                    self._peak = max(self._peak, self._live + new_nbytes)
                self._live += new_nbytes - old_nbytes
                return
        if inside and new_nbytes:
            self._track(owner, new_nbytes)

    def _track(self, owner: Any, nbytes: int) -> None:
        key = id(owner)
        record = (weakref.ref(owner, partial(self._died, key)), nbytes)
        # Nothing inside the lock creates a Python container, so no garbage collection (and
        # no storage death calling _died in this thread) can start while it is held.
        with self._lock:
            self._storages[key] = record
            self._live += nbytes
            if self._live > self._peak:
                self._peak = self._live

    def _died(self, key: int, _ref: weakref.ref) -> None:
        # Runs in whichever thread dropped the last reference to the storage.
        with self._lock:
            _, nbytes = self._storages.pop(key)
            self._live -= nbytes

    def _watcher_active(self) -> bool:
        """Is this meter's block running in this thread (where a storage was just resized)?"""
        return self._watcher is not None and self._watcher in _get_current_dispatch_mode_stack()


def _normalised(device: torch.device | str | int | None) -> torch.device | None:
    """``"cuda"`` -> ``cuda:<current>``, so a tensor's device compares equal to it.

    A CUDA device this machine does not have is refused: the allocator could not be read,
    and a tensor meter would count nothing at all.
    """
    if device is None:
        return None
    accepts = (
        "a torch.device, a string such as 'cpu', 'cuda' or 'cuda:0', or None (count every device)"
    )
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise TypeError(f"device must be {accepts}, {got(device)}.")
    try:
        device = torch.device(device)
    except RuntimeError as error:
        reason = str(error).splitlines()[0]
        raise ValueError(
            f"device={device!r} is not a device torch knows ({reason}); device must be {accepts}."
        ) from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(
                f"device={str(device)!r}, but CUDA is not available on this machine "
                "(torch.cuda.is_available() is False); measure on 'cpu', or pass device=None."
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif device.index >= count:
            raise ValueError(
                f"device={str(device)!r}, but this machine has {count} CUDA device"
                f"{'s' if count > 1 else ''} (cuda:0 to cuda:{count - 1})."
            )
    return device


def measure(
    fn: Callable[[], Any],
    *,
    device: torch.device | str | None = None,
    backend: str = "auto",
    timeline: bool = True,
) -> MemoryReport:
    """Run ``fn()`` under a :class:`MemoryMeter` and return its report; ``fn``'s result is dropped.

    >>> import torch
    >>> x = torch.randn(1000)
    >>> measure(lambda: x.exp().sum()).peak_bytes     # 4000 bytes for exp, 4 for the sum
    4004
    """
    function(
        fn,
        "fn",
        takes=0,
        where="measure",
        accepts="a function to call with no arguments, e.g. "
        "measure(lambda: model.training_step(batch)) "
        "(the function, not its result)",
    )
    with MemoryMeter(device, backend=backend, timeline=timeline) as meter:
        fn()
    return meter.report()
