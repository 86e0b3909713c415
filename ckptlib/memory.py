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
from torch.utils._python_dispatch import TorchDispatchMode

from ckptlib._arguments import flag, function, got
from ckptlib.checkpoint import is_recomputing

__all__ = ["MemoryMeter", "MemoryReport", "TimelineEntry", "measure", "format_bytes"]

BACKENDS = ("allocator", "tensors")
PHASES = ("forward", "backward", "recompute")


def format_bytes(nbytes: float) -> str:
    """``1536 -> '1.50 KiB'``: bytes in binary units, for tables and reports.

    >>> format_bytes(512), format_bytes(3 * 2**20), format_bytes(float("nan"))
    ('512 B', '3.00 MiB', 'nan B')
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Real):
        raise TypeError(f"format_bytes: nbytes must be a number of bytes (int or float), {got(nbytes)}.")
    if not math.isfinite(nbytes):
        return f"{nbytes} B"  # a table cell that says what it is, rather than a crash
    units = ("B", "KiB", "MiB", "GiB")
    power = 0
    while abs(nbytes) >= 1024 and power < len(units) - 1:
        nbytes, power = nbytes / 1024, power + 1
    return f"{int(nbytes)} B" if power == 0 else f"{nbytes:.2f} {units[power]}"


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
        return (f"peak {format_bytes(self.peak_bytes)} above a baseline of "
                f"{format_bytes(self.baseline_bytes)}; {format_bytes(self.retained_bytes)} still live "
                f"at the end ({self.backend} meter on {self.device}; ops: {ops or 'none recorded'})")


def _new_storage_returns(func: Any) -> tuple[bool, ...]:
    """For each return of an aten op: may it hold a new storage? Not if it is no tensor
    (``aten._local_scalar_dense`` returns a number) or the schema says it aliases an input."""
    return tuple(ret.alias_info is None and "Tensor" in str(ret.type) for ret in func._schema.returns)


def _storage_ptrs(args: tuple) -> list[int]:
    """Addresses of the storages of an op's tensor arguments (also inside list arguments)."""
    ptrs = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            ptrs.append(arg.untyped_storage().data_ptr())
        elif isinstance(arg, (list, tuple)):
            ptrs.extend(a.untyped_storage().data_ptr() for a in arg if isinstance(a, torch.Tensor))
    return ptrs


class _OpWatcher(TorchDispatchMode):
    """Calls back into the meter after every aten op (the only per-op Python code)."""

    def __init__(self, meter: "MemoryMeter") -> None:
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.meter._after_op(func, args, out)
        return out


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

    def __init__(self, device: torch.device | str | None = None, *, backend: str = "auto",
                 timeline: bool = True, on_op: Callable[[TimelineEntry], None] | None = None) -> None:
        self.device = _normalised(device)
        self.record_timeline = flag(timeline, "timeline", where="MemoryMeter")
        if on_op is not None:
            function(on_op, "on_op", takes=1, where="MemoryMeter",
                     accepts="a function called with each TimelineEntry, or None")
            if not timeline:
                raise ValueError("MemoryMeter: on_op is called with each timeline entry, but timeline=False "
                                 "records none; pass timeline=True, or leave on_op out.")
        if backend == "auto":
            backend = "allocator" if self.device is not None and self.device.type == "cuda" else "tensors"
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is not a memory meter; use 'allocator' (CUDA), "
                             "'tensors' (any device) or 'auto'.")
        if backend == "allocator" and (self.device is None or self.device.type != "cuda"):
            raise ValueError(f"backend='allocator' reads the CUDA caching allocator, but device={device!r}; "
                             "pass device='cuda', or use backend='tensors' to count tensors on any device.")
        self.backend = backend
        self.on_op = on_op
        self.timeline: list[TimelineEntry] = []
        self._lock = threading.Lock()
        self._storages: dict[int, tuple[weakref.ref, int]] = {}  # id(storage) -> (weakref, nbytes)
        self._live = 0          # tensors backend: bytes of counted storages alive now
        self._peak = 0          # tensors backend: highest _live since entry
        self._baseline = 0
        self._final: int | None = None
        # id(op) -> (op, name, which returns may be new); holding the op keeps its id unique
        self._ops: dict[int, tuple[Any, str, tuple[bool, ...] | None]] = {}
        self._watcher: _OpWatcher | None = None

    # -- entering and leaving ---------------------------------------------
    def __enter__(self) -> "MemoryMeter":
        if self._watcher is not None:
            raise RuntimeError("this MemoryMeter is already running; use a second MemoryMeter to nest.")
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
        return self

    def __exit__(self, *exc_info: Any) -> None:
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
        return MemoryReport(self.peak_bytes, self.baseline_bytes, self.live_bytes, self.backend,
                            str(self.device) if self.device is not None else "all devices", list(self.timeline))

    # -- per op (runs inside __torch_dispatch__: keep it lean) -------------
    def _after_op(self, func: Any, args: tuple, out: Any) -> None:
        # Keyed by id: an OpOverload's own __hash__ is Python code, too slow to run per op.
        described = self._ops.get(id(func))
        if described is None:
            may_be_new = _new_storage_returns(func)
            described = self._ops[id(func)] = (func, func._overloadpacket.__name__,
                                               may_be_new if any(may_be_new) else None)
        _, name, may_be_new = described
        if may_be_new is not None and self.backend == "tensors":
            if isinstance(out, torch.Tensor):
                self._count(out, args)
            else:
                # Several returns (aten.native_layer_norm), or one list of tensors (aten._foreach_mul).
                for value, maybe in zip((out,) if len(may_be_new) == 1 else out, may_be_new):
                    for tensor in (value if isinstance(value, (list, tuple)) else (value,)):
                        if maybe and isinstance(tensor, torch.Tensor):
                            self._count(tensor, args)
        if self.record_timeline:
            if is_recomputing():
                phase = "recompute"
            elif torch._C._current_graph_task_id() != -1:
                phase = "backward"
            else:
                phase = "forward"
            entry = TimelineEntry._make((len(self.timeline), name, phase, self._current() - self._baseline))
            self.timeline.append(entry)
            if self.on_op is not None:
                self.on_op(entry)

    def _count(self, tensor: torch.Tensor, args: tuple) -> None:
        if tensor.is_meta or (self.device is not None and tensor.device != self.device):
            return  # meta tensors have a shape but no memory
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._storages:
            return
        nbytes = storage.nbytes()
        if nbytes == 0 or storage.data_ptr() in _storage_ptrs(args):
            # Empty, or an input's storage returned by an op whose schema does not say so
            # (aten._unsafe_view): nothing was allocated.
            return
        record = (weakref.ref(storage, partial(self._died, key)), nbytes)
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


def _normalised(device: torch.device | str | int | None) -> torch.device | None:
    """``"cuda"`` -> ``cuda:<current>``, so a tensor's device compares equal to it.

    A CUDA device this machine does not have is refused: the allocator could not be read,
    and a tensor meter would count nothing at all.
    """
    if device is None:
        return None
    accepts = "a torch.device, a string such as 'cpu', 'cuda' or 'cuda:0', or None (count every device)"
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise TypeError(f"device must be {accepts}, {got(device)}.")
    try:
        device = torch.device(device)
    except RuntimeError as error:
        reason = str(error).splitlines()[0]
        raise ValueError(f"device={device!r} is not a device torch knows ({reason}); "
                         f"device must be {accepts}.") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device={str(device)!r}, but CUDA is not available on this machine "
                             "(torch.cuda.is_available() is False); measure on 'cpu', or pass device=None.")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif device.index >= count:
            raise ValueError(f"device={str(device)!r}, but this machine has {count} CUDA device"
                             f"{'s' if count > 1 else ''} (cuda:0 to cuda:{count - 1}).")
    return device


def measure(fn: Callable[[], Any], *, device: torch.device | str | None = None, backend: str = "auto",
            timeline: bool = True) -> MemoryReport:
    """Run ``fn()`` under a :class:`MemoryMeter` and return its report; ``fn``'s result is dropped.

    >>> import torch
    >>> x = torch.randn(1000)
    >>> measure(lambda: x.exp().sum()).peak_bytes     # 4000 bytes for exp, 4 for the sum
    4004
    """
    function(fn, "fn", takes=0, where="measure",
             accepts="a function to call with no arguments, e.g. measure(lambda: model.training_step(batch)) "
                     "(the function, not its result)")
    with MemoryMeter(device, backend=backend, timeline=timeline) as meter:
        fn()
    return meter.report()
