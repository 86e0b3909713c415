"""Non-reentrant activation checkpointing, built on saved-tensor hooks.

Design notes
============

Autograd keeps, for every op of the forward pass, the tensors its backward
formula needs ("saved tensors"). ``torch.autograd.graph.saved_tensors_hooks``
lets us intercept that: a *pack* hook is called with each tensor as autograd
saves it and returns whatever should be stored instead; an *unpack* hook is
called when backward needs the tensor and must give it back.

Forward. ``checkpoint(fn, *args)`` runs ``fn`` under a pack hook that stores a
small empty ``_Holder`` instead of the tensor, and records the tensor's
metadata (shape, dtype, device). It also keeps what it needs to run ``fn``
again: the inputs, the RNG state and the autocast state. No activation made
inside ``fn`` outlives the forward pass (unless ``fn`` returns it).

Backward. The first unpack in a backward pass finds its holder empty and
recomputes: it runs ``fn`` again from the kept inputs under a second pack hook
(the *recomputation* hook) that, for the i-th saved tensor, puts a detached
copy into the i-th holder. The i-th save of the rerun is the i-th save of the
forward because the rerun executes the same ops in the same order; the
metadata check turns a violation of that (non-deterministic control flow,
data-dependent shapes, changed global state) into a ``CheckpointError``
instead of a silently wrong gradient.

Early stop. The rerun raises ``_StopRecomputation`` from the hook as soon as
the last holder that backward can still ask for is filled: ops after it would
only produce tensors nobody needs.

One use, then gone. An unpack hands the tensor over and forgets it, so each
recomputed tensor lives from its recomputation until its node has run. Whatever
a backward did not consume (``torch.autograd.grad`` on a subset of inputs) is
dropped by a callback queued on the autograd engine when that backward ends.

Per backward pass. Holders keep recomputed tensors per *graph task* (one call
of ``backward``/``grad``), so ``retain_graph=True`` followed by a second
backward recomputes once more, and an unpack of the same tensor twice in one
backward is an error rather than a stale value.

Nesting. The kept inputs are stored as autograd saved tensors
(``_make_saved_tensor``), so they pass through whatever pack hook is active
when ``checkpoint`` is called. Inside an outer checkpoint, that is the outer
pack hook: the inner inputs are dropped in forward like any other activation
and come back when the outer region is recomputed. The hooks form a stack,
each frame knowing only its own holders. This also works with
``torch.utils.checkpoint`` on either side.

Contexts. ``context_fn`` gives a forward and a recomputation context, as in
``torch.utils.checkpoint``. One extra, optional protocol: if the forward
context has a method ``observe_saved_tensors()``, the frame calls it once and
passes every tensor it packs to the callback it returns (if not ``None``). Selective
checkpointing (``ckptlib.policies``) uses that to know which tensors the
recomputation must produce, and skips the ops nothing needs. And the recompute
context may raise ``RecomputeAgain`` to have the function run once more from
the start (selective checkpointing does, with skipping off, when a skipped
result turns out to be needed); a recomputed saved tensor on the *meta* device
asks the context's ``recompute_again()`` whether to do the same.

This file is the library's version of what notebook 03 builds step by step.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten, tree_unflatten

from ckptlib import rng

__all__ = [
    "checkpoint", "CheckpointError", "RecomputeAgain", "CheckpointTrace", "TraceEvent", "TensorMeta", "PackedInfo",
    "record_trace", "peek_saved", "is_recomputing",
]


class CheckpointError(RuntimeError):
    """A checkpointed region could not give back what autograd saved in forward."""


_MISMATCH_CAUSES = (
    "Usual causes: non-deterministic control flow in the checkpointed function (branches on "
    "random numbers, time or a global flag), data-dependent shapes (e.g. torch.nonzero on values "
    "that changed), global state that changed between forward and backward (a module attribute, "
    "train/eval mode), or an input modified in place after the forward pass. Make the function "
    "depend only on its inputs, or keep its activations by not checkpointing it."
)


# ---------------------------------------------------------------------------
# Metadata and the learner-facing trace
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorMeta:
    """What is checked between forward and recomputation, plus the bytes for the trace."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    nbytes: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TensorMeta":
        return cls.from_key(_key(tensor))

    @classmethod
    def from_key(cls, key: tuple) -> "TensorMeta":
        shape, dtype, device = key
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

    def __init__(self) -> None:
        self.events: list[TraceEvent] = []
        self._lock = threading.Lock()

    def add(self, event: TraceEvent) -> None:
        with self._lock:
            self.events.append(event)

    def count(self, kind: str) -> int:
        return sum(event.kind == kind for event in self.events)

    def __len__(self) -> int:
        return len(self.events)

    def __str__(self) -> str:
        return "\n".join(map(str, self.events))

    def __repr__(self) -> str:
        kinds = ("pack", "recompute", "early_stop", "unpack", "release")
        return "CheckpointTrace(" + ", ".join(f"{k}={self.count(k)}" for k in kinds) + ")"


_active_traces: list[CheckpointTrace] = []
_region_counter = itertools.count()
_outside_backward_keys = itertools.count(start=1)


@contextlib.contextmanager
def record_trace() -> Iterator[CheckpointTrace]:
    """Record what every checkpoint does inside the block (and in backward passes run in it).

    >>> import torch
    >>> x = torch.randn(3, requires_grad=True)
    >>> with record_trace() as trace:
    ...     checkpoint(lambda t: t.sin().cos(), x).sum().backward()
    >>> trace.count("pack"), trace.count("recompute"), trace.count("unpack")
    (2, 1, 2)
    """
    trace = CheckpointTrace()
    _active_traces.append(trace)
    try:
        yield trace
    finally:
        _active_traces.remove(trace)


class _OpNames(torch.overrides.TorchFunctionMode):
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


# ---------------------------------------------------------------------------
# The holder autograd stores, and one checkpoint call's frame
# ---------------------------------------------------------------------------


class _Holder:
    """What autograd keeps instead of a tensor: an index, and per backward pass the
    recomputed tensor until it is unpacked (then ``_USED``)."""

    __slots__ = ("frame", "index", "frees_memory", "recomputed", "unpack_count", "__weakref__")

    def __init__(self, frame: "_Frame", index: int, frees_memory: bool) -> None:
        self.frame = frame
        self.index = index
        self.frees_memory = frees_memory  # False for inputs, parameters and views of them
        self.recomputed: dict[int, Any] = {}
        self.unpack_count = 0


@dataclass(frozen=True)
class PackedInfo:
    """What a checkpoint stored for one saved tensor, as seen through :func:`peek_saved`."""

    region: str
    index: int
    meta: TensorMeta
    unpack_count: int
    recompute_count: int
    frees_memory: bool = True  # False when dropping it freed nothing (an input, a parameter, a view of one)


class _Peek:
    def __init__(self) -> None:
        self.last: PackedInfo | None = None

    def take(self) -> PackedInfo | None:
        info, self.last = self.last, None
        return info


class _ThreadState(threading.local):
    """Per-thread flags; class attributes are the defaults, so reads never miss."""

    peek: "_Peek | None" = None
    recompute_depth = 0


_thread_state = _ThreadState()


@contextlib.contextmanager
def peek_saved() -> Iterator[_Peek]:
    """Read checkpointed saved tensors without recomputing them (for inspection tools).

    Inside the block, reading ``grad_fn._saved_<name>`` of a tensor a checkpoint
    dropped returns an empty tensor on the ``meta`` device with the right shape
    and dtype, and ``peek.take()`` returns its :class:`PackedInfo`; for a tensor
    no checkpoint touched it returns ``None``.

    >>> import torch
    >>> x = torch.randn(3, requires_grad=True)
    >>> y = checkpoint(torch.sin, x)
    >>> with peek_saved() as peek:
    ...     saved = y.grad_fn._saved_self
    ...     info = peek.take()
    >>> saved.device.type, info.index, info.recompute_count
    ('meta', 0, 0)
    """
    previous = _thread_state.peek
    _thread_state.peek = _Peek()
    try:
        yield _thread_state.peek
    finally:
        _thread_state.peek = previous


def is_recomputing() -> bool:
    """True while a ckptlib checkpoint is re-running its function in this thread."""
    return _thread_state.recompute_depth > 0


_USED = object()


class _StopRecomputation(Exception):
    """Raised from the recomputation hook once every needed tensor is back."""


class RecomputeAgain(Exception):
    """Raised by a recompute context (``context_fn``) to have the checkpoint run the function
    again from the start, once. Selective checkpointing raises it when a result its rerun
    skipped turns out to be needed after all, having switched skipping off for the next run.
    The checkpoint also asks for it when a recomputed saved tensor is on the *meta* device
    (a skipped result) and the recompute context has ``recompute_again() -> bool``."""


_make_saved_tensor = getattr(torch._C._autograd, "_make_saved_tensor", None)  # None on older torch


def _save_inputs(tensors: list[torch.Tensor]) -> Callable[[], list[torch.Tensor]]:
    """Hand the inputs to autograd as saved tensors; return how to get them back.

    Saving goes through the active pack hook (see Nesting in the notes above).
    """
    if _make_saved_tensor is not None:
        saved = [_make_saved_tensor(t, is_output=False) for t in tensors]
        return lambda: [s.unpack() for s in saved]
    # Older torch: a do-nothing autograd.Function whose save_for_backward does the same.
    anchor = torch.empty(0, requires_grad=True)
    node = _InputSaver.apply(anchor, *tensors).grad_fn
    return lambda: list(node.saved_tensors)


class _InputSaver(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, *tensors):
        ctx.save_for_backward(*tensors)
        return anchor.new_empty(0)

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover - its output is never used
        return (None,) * (1 + len(ctx.saved_tensors))


class _Frame:
    """Everything one ``checkpoint`` call needs to rerun its function later."""

    def __init__(self, fn, args, kwargs, preserve_rng_state, early_stop, context_fn, debug) -> None:
        self.fn = fn
        self.region_number = next(_region_counter)
        if kwargs or any(isinstance(a, (list, tuple, dict)) for a in args):
            leaves, self.spec = tree_flatten((args, kwargs))
        else:  # the common case, flat positional arguments: skip the pytree machinery
            leaves, self.spec = list(args), None
        self.tensor_positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        tensors = [leaves[i] for i in self.tensor_positions]
        self.other_leaves = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        # The originals, weakly, with their versions: an in-place change to one of them after
        # forward would make the rerun compute from different values. (What comes back from
        # saved_inputs may be a copy made by a pack hook, e.g. CPU offload, with its own version.)
        self.input_versions = [(weakref.ref(t), t._version) for t in tensors]
        self.saved_inputs: Callable[[], list[torch.Tensor]] | None = _save_inputs(tensors)
        self.rng_state = rng.capture(tensors) if preserve_rng_state else None
        self.autocast = _autocast_state()
        self.early_stop = early_stop
        # context_fn is called once: its two contexts may share state (selective checkpointing's
        # cache), and the recompute context is entered again for every rerun.
        self.forward_context, self.recompute_context = (
            context_fn() if context_fn is not None else (contextlib.nullcontext(), contextlib.nullcontext()))
        # A forward context may ask to see every tensor this frame drops (selective
        # checkpointing uses it to rerun only the ops those tensors depend on).
        observe = getattr(self.forward_context, "observe_saved_tensors", None)
        self.saved_observer: Callable[[torch.Tensor], None] | None = observe() if observe is not None else None
        self.debug = debug
        self.weak_holders: list[weakref.ReferenceType[_Holder]] = []
        self.keys: list[tuple] = []  # (shape, dtype, device) of each saved tensor, in pack order
        self.recomputed_in: set[int] = set()
        self.recompute_count = 0
        self.op_names = _OpNames() if self.tracing else None
        # Which saved tensors free no memory when dropped: those sharing storage with the inputs.
        # (Skipped under torch.compile, where data pointers would break the traced graph.)
        self.check_aliases = not torch.compiler.is_compiling()
        self.kept_storages = {t.untyped_storage().data_ptr() for t in tensors} if self.check_aliases else set()
        self.freed_bytes = 0
        self.counted_storages: dict[int, StorageWeakRef] = {}  # a tensor saved twice frees its bytes once

    @property
    def region(self) -> str:
        """A readable name for this checkpoint call, e.g. ``Block.forward@3``."""
        name = getattr(self.fn, "__qualname__", None) or type(self.fn).__name__
        if name.startswith("_VariableFunctions"):  # torch.sin and friends: just "sin"
            name = self.fn.__name__
        return f"{name}@{self.region_number}"

    def meta(self, index: int) -> TensorMeta:
        return TensorMeta.from_key(self.keys[index])

    # -- trace ------------------------------------------------------------
    @property
    def tracing(self) -> bool:
        return self.debug or bool(_active_traces)

    def emit(self, kind: str, index: int | None = None, op: str | None = None,
             meta: TensorMeta | None = None, detail: str = "") -> None:
        if not self.tracing:
            return
        event = TraceEvent(kind, self.region, index, op, meta, detail)
        for trace in list(_active_traces):
            trace.add(event)
        if self.debug:
            print(event)

    # -- forward ----------------------------------------------------------
    def pack(self, tensor: torch.Tensor) -> _Holder:
        if self.saved_observer is not None:
            self.saved_observer(tensor)
        frees_memory = not _aliases_kept_tensor(tensor, self.kept_storages) if self.check_aliases else True
        holder = _Holder(self, len(self.weak_holders), frees_memory)
        self.weak_holders.append(weakref.ref(holder))
        self.keys.append(_key(tensor))
        if self.op_names is not None:
            meta = self.meta(holder.index)
            storage = tensor.untyped_storage()
            earlier = self.counted_storages.get(storage.data_ptr())
            if not holder.frees_memory:
                detail = "dropped, but it is an input, a parameter or a view of one: frees nothing"
            elif earlier is not None and not earlier.expired():
                detail = "dropped (same storage as an earlier saved tensor: counted once)"
            else:
                detail, self.freed_bytes = "dropped", self.freed_bytes + meta.nbytes
                self.counted_storages[storage.data_ptr()] = StorageWeakRef(storage)
            self.emit("pack", holder.index, self.op_names.current, meta, detail)
        return holder

    # -- backward ---------------------------------------------------------
    def unpack(self, holder: _Holder) -> torch.Tensor:
        peek = _thread_state.peek
        if peek is not None:
            meta = self.meta(holder.index)
            peek.last = PackedInfo(self.region, holder.index, meta, holder.unpack_count, self.recompute_count,
                                   holder.frees_memory)
            return torch.empty(meta.shape, dtype=meta.dtype, device="meta")
        graph_task = torch._C._current_graph_task_id()
        if graph_task == -1:
            return self._unpack_outside_backward(holder)
        if graph_task not in self.recomputed_in:
            self.recompute(graph_task, trigger=holder.index)
        value = holder.recomputed.get(graph_task, _USED)
        if value is _USED:
            raise CheckpointError(
                f"checkpoint {self.region}: saved tensor #{holder.index} "
                f"({self.meta(holder.index)}) was unpacked twice in one backward pass. "
                "Each recomputed tensor is handed out once and then released. If a custom "
                "autograd.Function reads ctx.saved_tensors more than once in backward, read it "
                "once into a local variable."
            )
        holder.recomputed[graph_task] = _USED
        holder.unpack_count += 1
        if self.tracing:
            self.emit("unpack", holder.index, _current_node_name(), detail="handed to backward, released")
        return value

    def _unpack_outside_backward(self, holder: _Holder) -> torch.Tensor:
        # Someone read grad_fn._saved_* by hand: recompute just for this read, keep nothing.
        key = -next(_outside_backward_keys)  # negative: never a real graph task id
        try:
            self.recompute(key, trigger=holder.index)
            return holder.recomputed[key]
        finally:
            self._forget(key)

    def recompute(self, graph_task: int, trigger: int) -> None:
        alive = [i for i, ref in enumerate(self.weak_holders) if ref() is not None]
        last_needed = alive[-1] if alive else -1
        self.emit("recompute", trigger, detail=f"rerunning {self.region} for {len(alive)} of "
                  f"{len(self.keys)} saved tensors")
        self.recomputed_in.add(graph_task)
        self.recompute_count += 1
        if graph_task >= 0:
            # Drop whatever this backward did not consume once it finishes. The callback holds
            # the frame weakly: a frame (and the inputs it keeps) must die with its graph nodes,
            # not live on until the end of the whole backward pass.
            frame_ref = weakref.ref(self)
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: _forget_if_alive(frame_ref, graph_task))
        for attempt in (1, 2):
            try:
                self._recompute_once(graph_task, last_needed)
                return
            except RecomputeAgain:
                if attempt == 2:
                    self._forget(graph_task)
                    raise CheckpointError(
                        f"checkpoint {self.region}: the recompute context asked for a second "
                        "recomputation, then for a third; giving up.") from None
                self.emit("recompute", trigger, detail="the recompute context asked to run again")

    def _recompute_once(self, graph_task: int, last_needed: int) -> None:
        counter = itertools.count()

        def pack_recomputed(tensor: torch.Tensor) -> torch.Tensor:
            index = next(counter)
            if not tensor.requires_grad:
                detached = tensor
            elif type(tensor) is torch.Tensor and not torch.compiler.is_compiling():
                # A plain tensor's detach needs no Python dispatch: under a recompute context's
                # dispatch mode (selective checkpointing) it would cost ~15 us per saved tensor.
                with _NO_PYTHON_DISPATCH():
                    detached = tensor.detach()
            else:
                detached = tensor.detach()
            if index >= len(self.keys):
                raise CheckpointError(
                    f"checkpoint {self.region}: the recomputation saved more tensors than the "
                    f"forward pass did (forward saved {len(self.keys)}; extra tensor #{index}: "
                    f"{TensorMeta.of(tensor)}). {_MISMATCH_CAUSES}"
                )
            if _key(tensor) != self.keys[index]:
                again = getattr(self.recompute_context, "recompute_again", None)
                if tensor.device.type == "meta" and self.keys[index][2].type != "meta" and again is not None \
                        and again():
                    raise RecomputeAgain   # a result the context skipped was needed after all
                raise CheckpointError(
                    f"checkpoint {self.region}: saved tensor #{index} differs between forward and "
                    f"recomputation: forward saved {self.meta(index)}, recomputation produced "
                    f"{TensorMeta.of(tensor)}. {_MISMATCH_CAUSES}"
                )
            holder = self.weak_holders[index]()
            if holder is not None:
                holder.recomputed[graph_task] = detached
            if self.early_stop and index == last_needed:
                if index + 1 < len(self.keys):
                    self.emit("early_stop", index, detail=f"all needed tensors back; skipped "
                              f"{len(self.keys) - index - 1} later saves")
                raise _StopRecomputation
            return detached

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack_recomputed, _identity):
                self._rerun()
        except _StopRecomputation:
            pass
        except RecomputeAgain:
            raise          # the holders filled so far are filled again by the next run
        except BaseException:
            self._forget(graph_task)
            raise
        saved = next(counter)
        if saved <= last_needed:
            self._forget(graph_task)
            raise CheckpointError(
                f"checkpoint {self.region}: the recomputation saved fewer tensors than the forward "
                f"pass did (forward saved {len(self.keys)}, recomputation {saved}). "
                f"{_MISMATCH_CAUSES}"
            )

    def _rerun(self) -> None:
        inputs = self.load_inputs()
        leaves = self._leaves_with(inputs)
        args, kwargs = tree_unflatten(leaves, self.spec) if self.spec is not None else (leaves, {})
        rng_context = rng.replay(self.rng_state) if self.rng_state is not None else contextlib.nullcontext()
        _thread_state.recompute_depth += 1
        try:
            with rng_context, torch.enable_grad(), _autocast(self.autocast), self.recompute_context:
                self.fn(*args, **kwargs)
        finally:
            _thread_state.recompute_depth -= 1

    def load_inputs(self) -> list[torch.Tensor]:
        if self.saved_inputs is None:  # pragma: no cover - only when nothing was saved
            raise CheckpointError(f"checkpoint {self.region}: inputs were released")
        inputs = self.saved_inputs()
        for position, (original_ref, version) in enumerate(self.input_versions):
            original = original_ref()
            if original is not None and original._version != version:
                raise CheckpointError(
                    f"checkpoint {self.region}: input tensor #{position} "
                    f"({TensorMeta.of(original)}) was modified in place after the checkpointed "
                    f"forward (version {version} -> {original._version}); recomputing from it would "
                    "give wrong activations. Clone the input before modifying it, or modify a copy."
                )
        return inputs

    def _leaves_with(self, inputs: list[torch.Tensor]) -> list[Any]:
        leaves = list(self.other_leaves)
        for position, tensor in zip(self.tensor_positions, inputs):
            leaves[position] = tensor
        return leaves

    def _forget(self, graph_task: int) -> None:
        released = 0
        for ref in self.weak_holders:
            holder = ref()
            if holder is not None and holder.recomputed.pop(graph_task, _USED) is not _USED:
                released += 1
        self.recomputed_in.discard(graph_task)
        if released and graph_task >= 0:
            self.emit("release", detail=f"{released} recomputed tensors not needed by this backward")


_NO_PYTHON_DISPATCH = torch._C._DisableTorchDispatch


def _identity(x):
    return x


def _aliases_kept_tensor(tensor: torch.Tensor, kept_storages: set[int]) -> bool:
    """Does dropping ``tensor`` free nothing? True for leaves (parameters), views of leaves
    (``weight.t()``) and anything sharing storage with the checkpoint's inputs, which are kept."""
    if tensor.is_leaf or (tensor._base is not None and tensor._base.is_leaf):
        return True
    return tensor.untyped_storage().data_ptr() in kept_storages


def _forget_if_alive(frame_ref: "weakref.ReferenceType[_Frame]", graph_task: int) -> None:
    frame = frame_ref()
    if frame is not None:
        frame._forget(graph_task)


def _key(tensor: torch.Tensor) -> tuple:
    # What must match between forward and recomputation; cheap enough to take at every pack.
    return (tensor.shape, tensor.dtype, tensor.device)


def _current_node_name() -> str | None:
    node = torch._C._current_autograd_node()
    return node.name() if node is not None else None


# ---------------------------------------------------------------------------
# Autocast state: the recomputation must run with the same casting as forward
# ---------------------------------------------------------------------------

_AUTOCAST_DEVICES = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


def _autocast_state() -> tuple[tuple[str, bool, torch.dtype], ...]:
    return tuple(
        (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        for device in _AUTOCAST_DEVICES
    )


def _autocast(state) -> ContextManager:
    stack = contextlib.ExitStack()
    for device, enabled, dtype in state:
        stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
    return stack


# ---------------------------------------------------------------------------
# The public function
# ---------------------------------------------------------------------------


def checkpoint(
    fn: Callable[..., Any],
    *args: Any,
    preserve_rng_state: bool = True,
    early_stop: bool = True,
    debug: bool = False,
    context_fn: Callable[[], tuple[ContextManager, ContextManager]] | None = None,
    use_reentrant: bool | None = None,
    **kwargs: Any,
) -> Any:
    """Run ``fn(*args, **kwargs)`` without keeping its activations; recompute them in backward.

    Args:
        fn: any callable; ``args`` and ``kwargs`` may be nested tuples, lists and
            dicts holding tensors, numbers, strings or ``None``; its return value is
            passed back untouched.
        preserve_rng_state: replay the CPU (and initialised CUDA) RNG state during
            recomputation so dropout draws the same mask. The caller's RNG stream is
            never moved by the recomputation.
        early_stop: stop the recomputation as soon as every needed tensor is back.
        debug: print a trace line for each pack, recompute, early stop and unpack.
        context_fn: returns ``(forward_context, recompute_context)`` to run ``fn``
            under in forward and in recomputation (as in ``torch.utils.checkpoint``).
        use_reentrant: accepted for drop-in compatibility; only ``False``/``None``.

    Gradients equal plain autograd bitwise; under ``torch.no_grad()`` this is a plain call.

    >>> import torch
    >>> x = torch.randn(8, 8, requires_grad=True)
    >>> w = torch.randn(8, 8, requires_grad=True)
    >>> def layer(inp, weight, *, scale):
    ...     return (inp @ weight).relu() * scale
    >>> checkpoint(layer, x, w, scale=2.0).sum().backward()
    >>> expected = torch.autograd.grad(layer(x, w, scale=2.0).sum(), w)[0]
    >>> torch.equal(w.grad, expected)
    True
    """
    if not callable(fn):
        raise TypeError(f"checkpoint: fn must be callable, got {type(fn).__name__}. "
                        "Pass the function or module itself, e.g. checkpoint(block, x).")
    if use_reentrant:
        raise ValueError("ckptlib.checkpoint is always non-reentrant; drop use_reentrant=True "
                         "(or use torch.utils.checkpoint for the reentrant variant).")
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)

    frame = _Frame(fn, args, kwargs, preserve_rng_state, early_stop, context_fn, debug)
    op_names = frame.op_names if frame.op_names is not None else contextlib.nullcontext()
    cuda_was_up = torch.cuda.is_initialized()
    with torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack), frame.forward_context, op_names:
        output = fn(*args, **kwargs)
    if preserve_rng_state and not cuda_was_up and torch.cuda.is_initialized():
        raise CheckpointError(
            f"checkpoint {frame.region}: CUDA was initialised inside the checkpointed function, so "
            "its RNG state could not be saved for the recomputation. Initialise CUDA before "
            "checkpointing (e.g. torch.cuda.init(), or move the model to the GPU first), or pass "
            "preserve_rng_state=False."
        )
    frame.op_names = None
    if not frame.keys:
        # Nothing was saved, so nothing will ever be recomputed: let the inputs go.
        frame.saved_inputs = None
    if frame.tracing:
        frame.emit("forward_done", detail=f"{len(frame.keys)} saved tensors dropped, {frame.freed_bytes} "
                   "bytes of activations freed; kept the inputs, RNG and autocast state")
    return output
