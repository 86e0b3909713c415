"""What a checkpoint did, step by step: the learner-facing trace of packs, reruns and unpacks.

Design notes
============

A checkpoint works out of sight: its hooks run inside autograd, between two
lines of the learner's code. The trace makes every step visible as one line
(``[Block.forward@3] pack #2 linear 4x16 float32 on cpu (256 bytes) dropped``),
so a notebook can print a training step and the reader sees when each tensor
was dropped, when the region ran again, where early stop cut it short and
which backward node took each recomputed tensor.

Off unless asked for. The core looks at ``open_traces`` once per call and
per recomputation; only then does it add a :class:`Tracer` to its observers, which names
ops (``OpNames``, a torch-function mode, which costs a Python call per op) and
builds events. So the trace costs nothing in a training loop that does not
record one.

Typed. An event carries what happened as fields (``kind``, ``region``, ``index``,
``meta``, ``frees_memory``, ``needed`` / ``total``, ``nbytes``...); ``str(event)``
and ``event.detail`` make the prose from them, and no code reads the prose back.

As it happens. ``record_trace(on_event=...)`` also hands each event to a
function the moment the checkpoint makes it, inside its hook: a tool that
follows a step live (``ckptlib.widgets.BackwardStepper`` reads the memory meter
at each event) sees the event where it happens, between the ops around it.


>>> import torch, ckptlib
>>> x = torch.randn(3, requires_grad=True)
>>> with record_trace() as trace:
...     ckptlib.checkpoint(lambda t: t.sin().cos(), x).sum().backward()
>>> trace.count("pack"), trace.count("recompute"), trace.count("unpack")
(2, 1, 2)
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten

from ckptlib._arguments import function
from ckptlib.core.checkpoint import Observer, open_traces
from ckptlib.core.checks import storage_ptr
from ckptlib.core.errors import RegionId, TensorMeta

__all__ = ["TensorMeta", "TraceEvent", "CheckpointTrace", "record_trace", "EVENT_KINDS", "RegionId",
           "Tracer", "tracing_active", "open_traces"]

EVENT_KINDS = ("pack", "forward_done", "recompute", "early_stop", "unpack", "release")

_FREES_NOTHING = "dropped, but it is an input, a parameter or a view of one: frees nothing"


@dataclass(frozen=True)
class TraceEvent:
    """One step of a checkpoint's life: pack, forward_done, recompute, early_stop, unpack, release.

    Fields by kind (``None`` where a kind has no such field):

    * ``pack``: ``index``, ``op`` (the user-level op that saved it), ``meta``, ``frees_memory``
      (False for an input, a parameter, a view of one), ``shared`` (same storage as an earlier
      saved tensor: its bytes counted once);
    * ``forward_done``: ``total`` saved tensors dropped, ``nbytes`` freed, ``kept_bytes`` of
      them the region returns (alive while its output is);
    * ``recompute``: ``index`` (the tensor backward asked for), ``needed`` of ``total``;
    * ``early_stop``: ``index`` (the last needed), ``total``;
    * ``unpack``: ``index``, ``op`` (the backward node that took it);
    * ``release``: ``count`` recomputed tensors this backward did not use.
    """

    kind: str
    region: RegionId
    index: int | None = None
    op: str | None = None
    meta: TensorMeta | None = None
    frees_memory: bool | None = None
    shared: bool = False
    needed: int | None = None
    total: int | None = None
    nbytes: int | None = None
    kept_bytes: int | None = None
    count: int | None = None

    @property
    def detail(self) -> str:
        """What happened, in words (made from the fields)."""
        kind = self.kind
        if kind == "pack":
            if not self.frees_memory:
                return _FREES_NOTHING
            return ("dropped (same storage as an earlier saved tensor: counted once)"
                    if self.shared else "dropped")
        if kind == "forward_done":
            kept = (f" ({self.kept_bytes} more are the region's output, alive while it is)"
                    if self.kept_bytes else "")
            return (f"{self.total} saved tensors dropped, {self.nbytes} bytes of activations "
                    f"freed{kept}; kept the inputs, RNG and autocast state")
        if kind == "recompute":
            return f"rerunning {self.region} for {self.needed} of {self.total} saved tensors"
        if kind == "early_stop":
            return f"all needed tensors back; skipped {self.total - self.index - 1} later saves"
        if kind == "unpack":
            return "handed to backward, released"
        return f"{self.count} recomputed tensors not needed by this backward"

    def __str__(self) -> str:
        parts = [f"[{self.region}] {self.kind}"]
        if self.index is not None:
            parts.append(f"#{self.index}")
        if self.op:
            parts.append(f"{self.op}")
        if self.meta is not None:
            parts.append(str(self.meta))
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
            raise ValueError("CheckpointTrace.count: kind must be one of "
                             f"{', '.join(EVENT_KINDS)}; got {kind!r}.")
        return sum(event.kind == kind for event in self.events)

    def __len__(self) -> int:
        return len(self.events)

    def __str__(self) -> str:
        return "\n".join(map(str, self.events))

    def __repr__(self) -> str:
        kinds = ("pack", "recompute", "early_stop", "unpack", "release")
        return "CheckpointTrace(" + ", ".join(f"{k}={self.count(k)}" for k in kinds) + ")"


# open_traces: the record_trace blocks open now, innermost last (the core reads the list, so it
# lives there; record_trace adds to it and removes from it)


def record_trace(
        on_event: Callable[[TraceEvent], None] | None = None) -> ContextManager[CheckpointTrace]:
    """Record what every checkpoint does inside the block (and in backward passes run in it).

    Args:
        on_event: called with each event as the checkpoint makes it, after it is recorded:
            inside the checkpoint's hook, in the thread that runs it (a backward may run in
            another). Keep it short; an exception it raises ends the checkpointed call.

    >>> import torch, ckptlib
    >>> x = torch.randn(3, requires_grad=True)
    >>> with record_trace() as trace:
    ...     ckptlib.checkpoint(torch.sin, x).sum().backward()
    >>> print(trace.events[0])  # doctest: +ELLIPSIS +NORMALIZE_WHITESPACE
    [sin@...] pack #0 sin 3 float32 on cpu (12 bytes) dropped, but it is an input, a parameter
    or a view of one: frees nothing
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
    open_traces.append(trace)
    try:
        yield trace
    finally:
        open_traces.remove(trace)


def tracing_active() -> bool:
    """Is any :func:`record_trace` block open?"""
    return bool(open_traces)


def publish(event: TraceEvent, echo: bool) -> None:
    """Hand ``event`` to every open trace; print it too if ``echo`` (``checkpoint(debug=True)``)."""
    for trace in list(open_traces):
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


class Tracer(Observer):
    """The trace as an observer of one checkpoint call: one event per step of the core."""

    def __init__(self, echo: bool) -> None:
        self.echo = echo               # checkpoint(debug=True): print each event too
        self.op_names: OpNames | None = None
        self.freed_bytes = 0
        # storage pointer -> (its storage, weakly; bytes counted as freed):
        # saved twice, counted once
        self.counted: dict[int, tuple[StorageWeakRef, int]] = {}

    def emit(self, event: TraceEvent) -> None:
        publish(event, echo=self.echo)

    def before_forward(self, frame: Any) -> ContextManager:
        self.op_names = OpNames()
        return self.op_names

    def on_pack(self, frame: Any, holder: Any, tensor: torch.Tensor) -> None:
        meta = frame.meta(holder.index)
        ptr = storage_ptr(tensor)
        earlier = self.counted.get(ptr) if ptr else None
        shared = holder.frees_memory and earlier is not None and not earlier[0].expired()
        if holder.frees_memory and not shared:
            self.freed_bytes += meta.nbytes
            if ptr:
                self.counted[ptr] = (StorageWeakRef(tensor.untyped_storage()), meta.nbytes)
        op = self.op_names.current if self.op_names is not None else "?"
        self.emit(TraceEvent("pack", frame.region, holder.index, op, meta,
                             frees_memory=holder.frees_memory, shared=shared))

    def on_forward_done(self, frame: Any, output: Any) -> None:
        # A dropped tensor the region also returns (ReLU's output: the next block's input) stays
        # alive; its bytes, counted as freed at its pack, are taken back here.
        self.op_names = None
        returned = {storage_ptr(t) for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)}
        counted = filter(None, (self.counted.get(ptr) for ptr in returned if ptr))
        kept = sum(nbytes for storage, nbytes in counted if not storage.expired())
        self.freed_bytes, self.counted = self.freed_bytes - kept, {}
        self.emit(TraceEvent("forward_done", frame.region, total=len(frame.keys),
                             nbytes=self.freed_bytes, kept_bytes=kept))

    def on_recompute(self, frame: Any, trigger: int, needed: int) -> None:
        self.emit(TraceEvent("recompute", frame.region, trigger, needed=needed,
                             total=len(frame.keys)))

    def on_early_stop(self, frame: Any, index: int) -> None:
        self.emit(TraceEvent("early_stop", frame.region, index, total=len(frame.keys)))

    def on_unpack(self, frame: Any, holder: Any, tensor: torch.Tensor) -> None:
        self.emit(TraceEvent("unpack", frame.region, holder.index, frame.node_name()))

    def on_release(self, frame: Any, task: int, released: int) -> None:
        if released and not (isinstance(task, int) and task < 0):   # not a read by hand
            self.emit(TraceEvent("release", frame.region, count=released))
