"""The memory meter: how many bytes a block of code holds at its worst moment, read from the
CUDA caching allocator or counted as live storages on any device.

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
``TorchDispatchMode`` sees every aten op below autograd, forward and backward,
and hands each op's outputs to a :class:`~ckptlib.memory.storages.LiveStorages`,
which counts every new storage until it dies (how, and what it cannot see, is
in :mod:`ckptlib.memory.storages`).

Either way the same mode can record a timeline, one entry per op; what the
numbers of a :class:`MemoryReport` mean is in :mod:`ckptlib.memory.report`.

Threads. Dispatch modes are thread-local, but autograd copies the calling
thread's state (dispatch modes included) to the worker threads that run a
CUDA backward, so a backward started inside the block is seen whichever thread
runs it. Storages can die in any thread; the counts are updated under a lock.
A backward started from *another* Python thread is not seen.

Nesting. Tensor meters nest (each counts for itself). Allocator meters do not:
each resets the device's one peak counter, so an outer one would lose its peak.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ckptlib._arguments import flag, function, got
from ckptlib.core.checkpoint import is_recomputing
from ckptlib.memory.allocations import OpShape, op_shape
from ckptlib.memory.report import MemoryReport, TimelineEntry
from ckptlib.memory.storages import LiveStorages, listen_to_storage_resizes

__all__ = ["MemoryMeter", "measure", "BACKENDS"]

BACKENDS = ("allocator", "tensors")


class _OpWatcher(TorchDispatchMode):
    """Calls back into the meter after every aten op (the only per-op Python code)."""

    def __init__(self, meter: "MemoryMeter") -> None:
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        meter = self.meter
        storages = meter._storages  # None on the allocator: it counts by itself
        # Keyed by id: an OpOverload's own __hash__ is Python code, too slow to run per op.
        described = meter._ops.get(id(func))
        shape = described[1] if described is not None else meter._describe(func)
        written = None
        if (
            storages is not None
            and shape.written
            and not (
                shape.keeps_storage
                and type(args[0]) is torch.Tensor
                and args[0].layout is torch.strided
            )
        ):
            written = storages.before_writing(shape, args, kwargs or {})
        out = func(*args, **(kwargs or {}))
        if storages is not None:
            storages.after_op(shape, args, out, written)
        if meter.record_timeline:
            meter._append(shape.name)
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
        # The tensors backend's count; it outlives each block, so a meter entered again still
        # counts what its earlier blocks left alive.
        self._storages = LiveStorages(self.device) if backend == "tensors" else None
        self._allocator_peak = 0  # allocator backend: max_memory_allocated at exit
        self._baseline = 0
        self._final: int | None = None
        # id(op) -> (op, what its schema says); holding the op keeps its id unique
        self._ops: dict[int, tuple[Any, OpShape]] = {}
        self._watcher: _OpWatcher | None = None

    # -- entering and leaving ---------------------------------------------
    def __enter__(self) -> "MemoryMeter":
        if self._watcher is not None:
            raise RuntimeError(
                "this MemoryMeter is already running; use a second MemoryMeter to nest."
            )
        self.timeline = []
        self._final = None
        if self._storages is None:
            torch.cuda.synchronize(self.device)
            self._baseline = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._baseline = self._storages.restart_peak()
        if self.record_timeline or self._storages is not None:
            self._watcher = _OpWatcher(self)
            self._watcher.__enter__()
        if self._storages is not None:
            listen_to_storage_resizes(self._storages, self._watcher, True)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self._storages is not None:
            listen_to_storage_resizes(self._storages, self._watcher, False)
        if self._watcher is not None:
            self._watcher.__exit__(*exc_info)
            self._watcher = None
        if self._storages is None:
            torch.cuda.synchronize(self.device)
            self._allocator_peak = torch.cuda.max_memory_allocated(self.device)
        self._final = self._current()

    # -- readings -----------------------------------------------------------
    def _current(self) -> int:
        if self._storages is None:
            return torch.cuda.memory_allocated(self.device)
        return self._storages.live_bytes

    @property
    def baseline_bytes(self) -> int:
        """Live bytes the meter could see when the block began (see ``ckptlib.memory.report``)."""
        return self._baseline

    @property
    def live_bytes(self) -> int:
        """Bytes allocated since the block began that are alive now (at exit, once it ended)."""
        return (self._current() if self._final is None else self._final) - self._baseline

    @property
    def peak_bytes(self) -> int:
        """The most bytes allocated inside the block that were alive at one time."""
        if self._storages is not None:
            return self._storages.peak_bytes - self._baseline
        if self._final is None:
            return torch.cuda.max_memory_allocated(self.device) - self._baseline
        return self._allocator_peak - self._baseline

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
    def _describe(self, func: Any) -> OpShape:
        shape = op_shape(func)
        self._ops[id(func)] = (func, shape)
        return shape

    def _append(self, op: str) -> None:
        """One timeline entry for the op that just ran, in its phase."""
        if is_recomputing():
            phase = "recompute"
        elif torch._C._current_graph_task_id() != -1:
            phase = "backward"
        else:
            phase = "forward"
        entry = TimelineEntry._make(
            (len(self.timeline), op, phase, self._current() - self._baseline)
        )
        self.timeline.append(entry)
        if self.on_op is not None:
            self.on_op(entry)


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
