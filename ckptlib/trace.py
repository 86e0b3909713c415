"""What a checkpoint did, step by step: the learner-facing trace of packs, reruns and unpacks.

Design notes
============

A checkpoint works out of sight: its hooks run inside autograd, between two
lines of the learner's code. The trace makes every step visible as one line
(``[Block.forward@3] pack #2 linear 4x16 float32 on cpu (256 bytes) dropped``),
so a notebook can print a training step and the reader sees when each tensor
was dropped, when the region ran again, where early stop cut it short and
which backward node took each recomputed tensor.

Off unless asked for. ``ckptlib.checkpoint`` asks :func:`tracing_active` once
per call and per rerun; only then does it name ops (``OpNames``, a torch-function
mode, which costs a Python call per op) and build events. So the trace costs
nothing in a training loop that does not record one.

As it happens. ``record_trace(on_event=...)`` also hands each event to a
function the moment the checkpoint makes it, inside its hook: a tool that
follows a step live (``ckptlib.widgets.BackwardStepper`` reads the memory meter
at each event) sees the event where it happens, between the ops around it.

``TensorMeta`` lives here because the trace is where learners meet it: it is
what an event says about a saved tensor (shape, dtype, device, bytes), and the
part of a saved tensor's fingerprint (``ckptlib.guards``) that reads as text.

>>> import torch, ckptlib
>>> x = torch.randn(3, requires_grad=True)
>>> with record_trace() as trace:
...     ckptlib.checkpoint(lambda t: t.sin().cos(), x).sum().backward()
>>> trace.count("pack"), trace.count("recompute"), trace.count("unpack")
(2, 1, 2)
"""
from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterator

import torch

from ckptlib._arguments import function

__all__ = ["TensorMeta", "TraceEvent", "CheckpointTrace", "record_trace", "EVENT_KINDS"]

EVENT_KINDS = ("pack", "forward_done", "recompute", "early_stop", "unpack", "release")


@dataclass(frozen=True)
class TensorMeta:
    """What an event says about a saved tensor: shape, dtype, device and its bytes."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    nbytes: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TensorMeta":
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"TensorMeta.of needs a tensor, got {type(tensor).__name__}.")
        return cls.from_key((tensor.shape, tensor.dtype, tensor.device))

    @classmethod
    def from_key(cls, key: tuple) -> "TensorMeta":
        """From a saved tensor's key; only its first three fields (shape, dtype, device) are used."""
        shape, dtype, device = key[:3]
        return cls(tuple(shape), dtype, device, math.prod(shape) * dtype.itemsize)

    def __str__(self) -> str:
        dims = "x".join(map(str, self.shape)) or "scalar"
        dtype = str(self.dtype).replace("torch.", "")
        return f"{dims} {dtype} on {self.device} ({self.nbytes} bytes)"


@dataclass(frozen=True)
class TraceEvent:
    """One step of a checkpoint's life: pack, forward_done, recompute, early_stop, unpack, release."""

    kind: str
    region: str
    index: int | None = None
    op: str | None = None
    meta: TensorMeta | None = None
    detail: str = ""

    def __str__(self) -> str:
        parts = [f"[{self.region}] {self.kind}"]
        if self.index is not None:
            parts.append(f"#{self.index}")
        if self.op:
            parts.append(f"{self.op}")
        if self.meta is not None:
            parts.append(str(self.meta))
        if self.detail:
            parts.append(self.detail)
        return " ".join(parts)


class CheckpointTrace:
    """Events recorded by :func:`record_trace`; ``print(trace)`` shows one per line."""

    def __init__(self, on_event: Callable[[TraceEvent], None] | None = None) -> None:
        self.events: list[TraceEvent] = []
        self.on_event = on_event
        self._lock = threading.Lock()

    def add(self, event: TraceEvent) -> None:
        """Record ``event``, then hand it to ``on_event`` (if any), in the thread that made it."""
        with self._lock:
            self.events.append(event)
        if self.on_event is not None:
            self.on_event(event)

    def count(self, kind: str) -> int:
        """How many events of ``kind`` (one of ``EVENT_KINDS``) were recorded."""
        if kind not in EVENT_KINDS:
            raise ValueError(f"CheckpointTrace.count: kind must be one of {', '.join(EVENT_KINDS)}; "
                             f"got {kind!r}.")
        return sum(event.kind == kind for event in self.events)

    def __len__(self) -> int:
        return len(self.events)

    def __str__(self) -> str:
        return "\n".join(map(str, self.events))

    def __repr__(self) -> str:
        kinds = ("pack", "recompute", "early_stop", "unpack", "release")
        return "CheckpointTrace(" + ", ".join(f"{k}={self.count(k)}" for k in kinds) + ")"


_active_traces: list[CheckpointTrace] = []


def record_trace(on_event: Callable[[TraceEvent], None] | None = None) -> ContextManager[CheckpointTrace]:
    """Record what every checkpoint does inside the block (and in backward passes run in it).

    Args:
        on_event: called with each event as the checkpoint makes it, after it is recorded:
            inside the checkpoint's hook, in the thread that runs it (a backward may run in
            another). Keep it short; an exception it raises ends the checkpointed call.

    >>> import torch, ckptlib
    >>> x = torch.randn(3, requires_grad=True)
    >>> with record_trace() as trace:
    ...     ckptlib.checkpoint(torch.sin, x).sum().backward()
    >>> print(trace.events[0])  # doctest: +ELLIPSIS
    [sin@...] pack #0 sin 3 float32 on cpu (12 bytes) dropped, but it is an input, a parameter or a view of one: frees nothing
    >>> kinds = []
    >>> with record_trace(on_event=lambda event: kinds.append(event.kind)):
    ...     y = ckptlib.checkpoint(torch.sin, x)
    ...     kinds.copy()            # both came before checkpoint returned
    ['pack', 'forward_done']
    """
    if on_event is not None:
        function(on_event, "on_event", takes=1, accepts="a function of one TraceEvent, or None",
                 where="record_trace")
    return _recording(CheckpointTrace(on_event))


@contextlib.contextmanager
def _recording(trace: CheckpointTrace) -> Iterator[CheckpointTrace]:
    _active_traces.append(trace)
    try:
        yield trace
    finally:
        _active_traces.remove(trace)


def tracing_active() -> bool:
    """Is any :func:`record_trace` block open?"""
    return bool(_active_traces)


def publish(event: TraceEvent, echo: bool) -> None:
    """Hand ``event`` to every open trace; print it too if ``echo`` (``checkpoint(debug=True)``)."""
    for trace in list(_active_traces):
        trace.add(event)
    if echo:
        print(event)


class OpNames(torch.overrides.TorchFunctionMode):
    """Remembers the user-level op being called, so a pack can say who saved the tensor.

    Only installed when tracing: ``torch.sin(x)`` and ``F.linear(...)`` are seen
    here before autograd saves their tensors.
    """

    def __init__(self) -> None:
        super().__init__()
        self.current = "?"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.current = getattr(func, "__name__", str(func))
        return func(*args, **(kwargs or {}))
