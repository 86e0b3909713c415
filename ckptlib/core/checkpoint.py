"""The checkpoint itself: notebook 03's one-cell checkpoint, grown into the library's.

Autograd keeps, for every op of the forward pass, the tensors its backward formula needs
("saved tensors"). ``torch.autograd.graph.saved_tensors_hooks`` intercepts that: a *pack* hook
gets each tensor as autograd saves it and returns what to store instead; an *unpack* hook gets
that back when backward needs the tensor and must return the tensor. Notebook 03 builds a
checkpoint from these two hooks in one cell, in six steps; this file is the same checkpoint, in
the same steps and names:

1. ``pack`` stores an empty :class:`Holder` instead of the tensor and remembers the tensor's key
   (``Frame.pack``). No activation made inside ``fn`` outlives the forward pass unless ``fn``
   returns it. The inputs are kept, as autograd saved tensors (:func:`save_inputs`).
2. The first ``unpack`` of a backward pass finds its holder empty and calls ``recompute``: it
   runs ``fn`` again from the kept inputs under a second pack hook, :class:`Fill`, that puts the
   i-th tensor the rerun saves into the i-th holder (``Frame.recompute``).
3. The rerun replays the random numbers of the forward (``ckptlib/rng.py``) and its autocast
   state, so dropout draws the same mask.
4. Early stop: ``Fill`` raises :class:`StopRecomputation` as soon as the last holder backward can
   still ask for is filled; ops after it would only make tensors nobody needs.
5. One use, then gone: ``unpack`` hands its tensor over and forgets it; what a backward did not
   use (``torch.autograd.grad`` on a subset) is dropped by ``release`` when that backward ends.
6. The rerun must save what the forward saved: each saved tensor's key is compared, and the
   checks of ``checks.py`` refuse a rerun that would differ (an input changed in place, a
   parameter replaced, an in-place change inside the region, a transform that ended). Their
   messages are in ``errors.py``.

Holders keep recomputed tensors per backward pass (*graph task*), so ``retain_graph=True`` then a
second backward recomputes once more. Inside an outer checkpoint the kept inputs pass through its
pack hook and are dropped too (nesting, also with ``torch.utils.checkpoint`` on either side).

Observers. A frame calls its :class:`Observer` objects at each step, in a plain loop; each method
does nothing unless an observer overrides it. There are two: the trace (``trace.py``), while
``record_trace`` is open or with ``debug=True``, and selective checkpointing, whose
``context_fn`` contexts are observers too (``ckptlib/selective/modes.py``): they see each saved
tensor, and may run the recomputation again (``run_recompute``). Inspection tools read a
checkpoint's holders without recomputing (``peek.py``); ``compile.py`` makes ``checkpoint`` run
eagerly under ``torch.compile``.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import sys
import threading
import weakref
from typing import Any, Callable, ContextManager

import torch
import torch.autograd.forward_ad as forward_ad
from torch.utils._pytree import tree_flatten, tree_is_leaf, tree_unflatten

from ckptlib import rng
from ckptlib._arguments import check_not_reentrant, flag, got
from ckptlib.core import compile as compile_
from ckptlib.core import errors, peek
from ckptlib.core.checks import CONSTANT, Checks, key_mismatch, saved_key, storage_ptr, \
    storage_ptrs
from ckptlib.core.errors import CheckpointError, RegionId, TensorMeta, caller_stacklevel

__all__ = ["checkpoint", "is_recomputing", "Holder", "Frame", "Observer", "StopRecomputation",
           "RegionId", "function_name", "CheckpointError"]

_region_numbers = itertools.count()
_outside_backward_tasks = itertools.count(start=1)


class Holder:
    """What autograd stores instead of a saved tensor (step 1).

    ``recomputed``: backward pass (graph task id) -> (its recomputed tensor, that tensor's version
    when the rerun saved it), until backward takes it. ``frees_memory`` and ``check_version`` are
    set by the checks' ``on_pack``: both are False for a tensor that lives on outside the region
    (an input, a parameter, a buffer): dropping it frees nothing, and its version is checked
    before the rerun instead of at unpack (check 4 of ``checks.py``).
    """

    __slots__ = ("index", "recomputed", "unpack_count", "frees_memory", "check_version",
                 "__weakref__")

    def __init__(self, index: int) -> None:
        self.index = index
        self.recomputed: dict[int, tuple[torch.Tensor, int]] = {}
        self.unpack_count = 0
        self.frees_memory = True
        self.check_version = True


class StopRecomputation(Exception):
    """Raised from ``Fill`` once the last needed tensor is back (step 4)."""


class _ThreadState(threading.local):
    recompute_depth = 0


_thread = _ThreadState()


def is_recomputing() -> bool:
    """True while a ckptlib checkpoint is re-running its function in this thread."""
    return _thread.recompute_depth > 0


class Observer:
    """Sees one checkpoint call step by step; never changes what is computed (it may refuse, by
    raising). Each method does nothing here; the trace and selective checkpointing override some.
    The methods are named after the trace's events: ``pack``, ``forward_done``, ``recompute``,
    ``early_stop``, ``unpack``, ``release``."""

    def before_forward(self, frame: "Frame") -> ContextManager | None:
        """Before the forward runs: a context to run it under, or None."""
        return None

    def on_pack(self, frame: "Frame", holder: Holder, tensor: torch.Tensor) -> None:
        """Autograd saved ``tensor``; ``holder`` is what it stores instead."""

    def on_forward_done(self, frame: "Frame", output: Any) -> None:
        """The forward returned ``output``."""

    def on_recompute(self, frame: "Frame", trigger: int, needed: int) -> None:
        """Holder ``trigger`` asked for the first recomputation of a backward pass; ``needed``
        holders are still alive."""

    def run_recompute(self, frame: "Frame", recompute: Callable[[], None]) -> None:
        """Run the recomputation: ``recompute()`` runs ``fn`` once from the start. (Selective
        checkpointing runs it once more when a result it skipped was needed after all.)"""
        recompute()

    def on_fill(self, frame: "Frame", index: int, tensor: torch.Tensor) -> None:
        """The rerun saved ``tensor`` at ``index``, before its key is compared."""

    def on_early_stop(self, frame: "Frame", index: int) -> None:
        """The rerun stopped at ``index``, the last needed saved tensor."""

    def on_unpack(self, frame: "Frame", holder: Holder, tensor: torch.Tensor) -> None:
        """Backward took ``holder``'s tensor."""

    def on_release(self, frame: "Frame", task: int, released: int) -> None:
        """A backward pass ended; ``released`` recomputed tensors it did not use were dropped."""


open_traces: list = []   # the record_trace blocks open now, innermost last (trace.py's)


def add_tracer(observers: list[Observer], echo: bool) -> None:
    """Add the trace's observer to ``observers`` while a ``record_trace`` block is open, or to
    print (``debug=True``: ``echo``), unless it is there."""
    if not (echo or open_traces):
        return
    from ckptlib.core import trace  # lazy import: an optional observer, a subclass of Observer
    if not any(isinstance(o, trace.Tracer) for o in observers):
        observers.append(trace.Tracer(echo))


def function_name(fn: Any) -> str:
    """How a region names ``fn``: ``Block.forward``, ``sin``, a ``functools.partial`` by what it
    calls, else its type's name. Never raises: a user's callable may answer every attribute (a
    proxy) or raise from a property.

    >>> function_name(torch.sin), function_name(functools.partial(function_name))
    ('sin', 'function_name')
    """
    while type(fn) is functools.partial:
        fn = fn.func
    try:
        name = getattr(fn, "__qualname__", None)
        if isinstance(name, str) and name.startswith("_VariableFunctions"):  # torch.sin: "sin"
            name = getattr(fn, "__name__", None)
    except Exception:
        name = None
    return name if isinstance(name, str) and name else type(fn).__name__


# ---------------------------------------------------------------------------
# What the frame keeps for the rerun: the arguments, the autocast state
# ---------------------------------------------------------------------------

class Arguments:
    """A call's arguments without their tensors (those are kept as saved tensors): each
    positional argument and keyword value is a pytree (a tensor; a list, tuple or dict of them;
    a namedtuple, a registered dataclass ...), kept as its leaves with ``None`` where a tensor
    was; :meth:`rebuild` puts the rerun's tensors back there. The tensors go into ``tensors``,
    not here: the frame keeps them as saved tensors only (an outer checkpoint must be able to
    drop them)."""

    def __init__(self, args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> None:
        self.names = tuple(kwargs)   # the keywords, after the positional arguments
        self.values: list[tuple[list, Any]] = []   # per argument: (leaves, spec; None: a leaf)
        self.tensor_places: list[tuple[int, int]] = []   # (argument, leaf) per tensor
        self.others: list[Any] = []   # the other leaves (where the caller's generators may be)
        for position, value in enumerate((*args, *kwargs.values())):
            if tree_is_leaf(value, is_leaf=_is_leaf):
                leaves, spec = [value], None
            else:
                leaves, spec = tree_flatten(value, is_leaf=_is_leaf)
            for index, leaf in enumerate(leaves):
                if isinstance(leaf, torch.Tensor):
                    self.tensor_places.append((position, index))
                    tensors.append(leaf)
                    leaves[index] = None
                else:
                    self.others.append(leaf)
            self.values.append((leaves, spec))

    def rebuild(self, tensors: list[torch.Tensor]) -> tuple[list, dict]:
        """``(args, kwargs)`` again, with ``tensors`` where the tensors were."""
        leaves = [list(value_leaves) for value_leaves, _ in self.values]
        for (position, index), tensor in zip(self.tensor_places, tensors):
            leaves[position][index] = tensor
        values = [value_leaves[0] if spec is None else tree_unflatten(value_leaves, spec)
                  for value_leaves, (_, spec) in zip(leaves, self.values)]
        split = len(values) - len(self.names)
        return values[:split], dict(zip(self.names, values[split:]))


def _is_leaf(value: Any) -> bool:
    # kept whole: a tensor, and a torch.Size (a pytree node that would unflatten to a tuple)
    return isinstance(value, (torch.Tensor, torch.Size))


def save_inputs(tensors: list[torch.Tensor]) -> list:
    """The inputs as autograd saved tensors (``.unpack()`` gives each back), as torch's own
    checkpoint keeps them: inside an outer checkpoint they pass through its pack hook and are
    dropped too. (A private torch call: the public way, ``ctx.save_for_backward`` in a do-nothing
    ``autograd.Function``, refuses dual tensors under forward-mode AD.)"""
    return [torch._C._autograd._make_saved_tensor(tensor, False) for tensor in tensors]


def input_for_rerun(tensor: torch.Tensor) -> torch.Tensor:
    """An input for the rerun: detached from the forward's graph (a hook the function registers
    on it would otherwise fire twice in backward), requiring grad as it did, a ``Parameter`` if it
    was one; under forward-mode AD it keeps its tangent."""
    if not tensor.requires_grad:
        return tensor
    detached = tensor.detach().requires_grad_()
    if isinstance(tensor, torch.nn.Parameter):   # a Parameter stays one, as in torch
        detached = torch.nn.Parameter(detached)
    if forward_ad._current_level >= 0:
        tangent = forward_ad.unpack_dual(tensor).tangent
        if tangent is not None:
            return forward_ad.make_dual(detached, tangent)
    return detached


_AUTOCAST_DEVICES = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


def autocast_state() -> tuple[tuple[str, bool, torch.dtype], ...]:
    """(device, enabled, dtype) for each device: what a rerun inside backward must run under."""
    return tuple((device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
                 for device in _AUTOCAST_DEVICES)


# ---------------------------------------------------------------------------
# The frame: one checkpoint call
# ---------------------------------------------------------------------------

class Frame:
    """Everything one ``checkpoint`` call needs to run its function again later."""

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict, preserve_rng_state: bool,
                 early_stop: bool, contexts: tuple[ContextManager | None, ContextManager | None],
                 check_keys: bool, observers: list[Observer]) -> None:
        self.fn, self.number = fn, next(_region_numbers)
        tensors: list[torch.Tensor] = []
        self.arguments = Arguments(args, kwargs, tensors)
        self.inputs = save_inputs(tensors)   # None once nothing will be recomputed
        self.checks = Checks(fn, tensors, self.arguments.others)   # step 6, called by name
        self.rng = rng.capture(tensors, self.checks.generators) if preserve_rng_state else None
        # the forward, registered as a user of those generators (threads, rng.py)
        self.rng_forward = rng.ForwardRegistration(self.rng) if self.rng is not None else None
        self.autocast = autocast_state()
        self.early_stop, self.check_keys = early_stop, check_keys
        self.forward_context, self.recompute_context = contexts   # context_fn was called once
        self.observers = observers
        self.holders: list[weakref.ReferenceType[Holder]] = []
        self.keys: list[tuple] = []   # the key of each saved tensor, in pack order
        self.recomputed_in: set = set()   # backward passes (or GraphExecGroups) recomputed for
        self.recompute_count = 0
        # A backward inside fn (torch.autograd.grad) recomputes while the forward still runs: the
        # rerun may then save more than the forward has saved so far (Fill).
        self.forward_running = True

    @property
    def region(self) -> RegionId:
        """This call's name in messages and traces, e.g. ``Block.forward@3``."""
        return RegionId(function_name(self.fn), self.number)

    def meta(self, index: int) -> TensorMeta:
        return TensorMeta.from_key(self.keys[index])

    def node_name(self) -> str | None:
        """The backward node running now (who unpacks), or ``None``."""
        node = torch._C._current_autograd_node()   # no public API tells the running node
        return node.name() if node is not None else None

    # -- forward (step 1) ---------------------------------------------------------------
    def pack(self, tensor: torch.Tensor) -> Holder:
        holder = Holder(len(self.holders))
        self.holders.append(weakref.ref(holder))
        ptr = storage_ptr(tensor)
        self.keys.append(saved_key(tensor, ptr, self.checks.input_ptrs))
        self.checks.on_pack(holder, tensor, ptr)
        for observer in self.observers:
            observer.on_pack(self, holder, tensor)
        return holder

    def forward_done(self, output: Any) -> None:
        self.forward_running = False
        if not self.keys:   # nothing saved, so nothing will be recomputed: let the inputs go
            self.inputs = None
        self.checks.after_forward()
        for observer in self.observers:
            observer.on_forward_done(self, output)

    # -- backward (steps 2 and 5) ---------------------------------------------------------
    def unpack(self, holder: Holder) -> torch.Tensor:
        if peek.state.peek is not None:   # an inspection tool reads it: answer, recompute nothing
            return peek.state.peek.answer(self, holder)
        # What one recomputation serves: the torch.utils.checkpoint.GraphExecGroup open now (its
        # backward calls share one), else the backward pass running now. Torch has no public API
        # that tells either; its own checkpoint reads them the same way.
        task = torch._C._get_graph_exec_group() or torch._C._current_graph_task_id()
        outside = task == -1   # grad_fn._saved_* read by hand: recompute for it, keep nothing
        if outside:
            task = -next(_outside_backward_tasks)
        try:
            if task not in self.recomputed_in:
                self.start_recompute(task, holder.index)
            if task not in holder.recomputed:
                raise CheckpointError(errors.unpacked_twice(
                    self.region, holder.index, self.meta(holder.index),
                    in_group=not isinstance(task, int)))
            tensor, version = holder.recomputed.pop(task)   # handed over: forgotten (step 5)
            if holder.check_version and tensor._version != version:   # check 4 of checks.py
                self.release(task)
                raise CheckpointError(f"checkpoint {self.region}: " + errors.modified_in_place(
                    holder.index, self.meta(holder.index), self.keys[holder.index][3], version,
                    tensor._version, self.node_name()))
            holder.unpack_count += 1
            for observer in self.observers:
                observer.on_unpack(self, holder, tensor)
            return tensor
        finally:
            if outside:
                self.release(task)

    def start_recompute(self, task: int, trigger: int) -> None:
        """The first unpack of backward pass ``task``: recompute every holder still alive."""
        add_tracer(self.observers, echo=False)   # a trace opened after the forward
        last_needed, alive = -1, 0   # holders backward can still ask for, and the last of them
        for index, ref in enumerate(self.holders):
            if ref() is not None:
                alive, last_needed = alive + 1, index
        self.recomputed_in.add(task)
        self.recompute_count += 1
        if isinstance(task, int) and task >= 0:   # released when this backward ends (or fails)
            torch.autograd.Variable._execution_engine.queue_callback(_ReleaseUnused(self, task))

        def run() -> None:   # each run of fn from the start is one "recompute" event
            for observer in self.observers:
                observer.on_recompute(self, trigger, alive)
            self.recompute(task, last_needed)

        for observer in self.observers:
            run = functools.partial(observer.run_recompute, self, run)
        try:
            run()
        except BaseException:
            self.release(task)
            raise

    def recompute(self, task: int, last_needed: int) -> None:
        """Run ``fn`` again from the kept inputs under :class:`Fill` (steps 2 to 4)."""
        rerun_state = self.checks.before_recompute(self)   # the forward's state, the watch
        with torch.enable_grad():   # under forward-mode AD, make_dual then records a view
            tensors = [input_for_rerun(saved.unpack()) for saved in self.inputs]
        args, kwargs = self.arguments.rebuild(tensors)
        fill = Fill(self, task, last_needed, storage_ptrs(tensors))
        failure = None
        try:
            with contextlib.ExitStack() as stack:
                if self.rng is not None:   # step 3: the forward's random numbers
                    replay = stack.enter_context(rng.replay(self.rng))
                if rerun_state is not None:
                    stack.enter_context(rerun_state)
                if torch.is_inference_mode_enabled():   # a backward under it is legal: leave it
                    stack.enter_context(torch.inference_mode(False))
                if autocast_state() != self.autocast:   # step 3: the forward's autocast state
                    for device, enabled, dtype in self.autocast:
                        stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
                if self.recompute_context is not None:
                    stack.enter_context(self.recompute_context)
                # the second pack hook (its unpack gives back what it returned); grad mode is off
                # in backward: the rerun records a graph
                with torch.autograd.graph.saved_tensors_hooks(fill, lambda tensor: tensor), \
                        torch.enable_grad():
                    _thread.recompute_depth += 1
                    try:
                        self.fn(*args, **kwargs)
                    except StopRecomputation:   # step 4, caught here: the contexts exit normally
                        pass
                    finally:
                        _thread.recompute_depth -= 1
        except BaseException as error:
            failure = error
        try:
            self.checks.after_recompute(self, failure)
        except BaseException as refusal:   # a check's refusal takes the failure's place
            failure = refusal
        if failure is not None and not fill.stopped:
            # Code between the hook and here may wrap the early stop in its own exception
            # (TorchScript re-raises it as a RuntimeError): once stopped, every needed holder
            # is filled. The local goes before the exception leaves: its traceback holds this
            # call, which would hold it back (a reference cycle, freed only by gc).
            try:
                lost = self.checks.lost_transform()
                if lost is not None and not isinstance(failure, CheckpointError):
                    raise CheckpointError(f"checkpoint {self.region}: {lost}") from failure
                raise failure
            finally:
                del failure
        shared = None
        if self.rng is not None and (self.rng_forward.overlapped or replay.overlapped):
            shared = rng.shared_with_another_thread(self.rng, self.rng_forward.after,
                                                    self.rng_forward.overlapped | replay.overlapped)
        if shared or fill.count <= last_needed:
            raise CheckpointError(f"checkpoint {self.region}: " + (shared or errors.saved_fewer(
                len(self.keys), fill.count, self.checks.mismatch_causes())))

    def release(self, task: int) -> None:
        """Drop the recomputed tensors of backward pass ``task`` that nobody took (step 5)."""
        released = 0
        for ref in self.holders:
            holder = ref()
            if holder is not None and holder.recomputed.pop(task, None) is not None:
                released += 1
        self.recomputed_in.discard(task)
        for observer in self.observers:
            observer.on_release(self, task, released)


class Fill:
    """The rerun's pack hook (step 2): the i-th tensor the rerun saves goes into the i-th holder,
    its key compared with the forward's (step 6); early stop after the last needed one (step 4).
    ``recompute`` installs it with ``saved_tensors_hooks`` around the rerun."""

    def __init__(self, frame: Frame, task: int, last_needed: int, input_ptrs: set[int]) -> None:
        self.frame, self.task, self.last_needed, self.input_ptrs = frame, task, last_needed, \
            input_ptrs
        self.count = 0                  # tensors the rerun saved so far
        self.stop_at_next_pack = False  # the last needed tensor is an op's buffer, filled later
        self.stopped = False            # StopRecomputation was raised (it may come out wrapped)

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        frame, keys = self.frame, self.frame.keys
        if self.stop_at_next_pack:   # the buffer next to the last needed tensor is filled now
            return self.stop(self.last_needed)
        index = self.count
        self.count += 1
        if index >= len(keys):
            if frame.forward_running:   # a backward inside fn: the forward saved less so far
                return tensor.detach()
            raise CheckpointError(errors.saved_more(frame.region, len(keys), index,
                                                    TensorMeta.of(tensor),
                                                    frame.checks.mismatch_causes()))
        for observer in frame.observers:
            observer.on_fill(frame, index, tensor)
        ptr = storage_ptr(tensor)
        if frame.check_keys:
            key = saved_key(tensor, ptr, self.input_ptrs)
            if key != keys[index]:
                raise CheckpointError(f"checkpoint {frame.region}: " + (
                    frame.checks.lost_transform() or key_mismatch(index, keys[index], key)))
            frame.checks.on_fill(frame, index, tensor, ptr)
        detached = tensor.detach()
        holder = frame.holders[index]()
        if holder is not None:   # with its version, as autograd keeps a saved tensor's
            holder.recomputed[self.task] = (detached, detached._version)
        if not frame.early_stop or index != self.last_needed:
            return detached
        # Next to a saved constant (a tensor without history made inside), wait for the next
        # save: it may be a buffer its op fills after saving it (``rrelu`` saves its ``noise``
        # buffer, then fills it), and a rerun stopped right here would hand back an unfilled one.
        if keys[index][3] is CONSTANT or (index > 0 and keys[index - 1][3] is CONSTANT):
            self.stop_at_next_pack = True
            return detached
        return self.stop(index)

    def stop(self, index: int) -> torch.Tensor:
        """Early stop (step 4): every tensor backward can still ask for is back."""
        frame = self.frame
        if index + 1 < len(frame.keys):
            for observer in frame.observers:
                observer.on_early_stop(frame, index)
        self.stopped = True
        raise StopRecomputation


class _ReleaseUnused:
    """Queued on the autograd engine for one backward: ``frame.release`` when it ends.

    If the backward fails, the engine drops its callbacks unrun, and the deletion does the same
    work. It holds the frame weakly: a frame (and the inputs it keeps) must die with its graph
    nodes, not live on until the whole backward pass ends.
    """

    __slots__ = ("frame", "task")

    def __init__(self, frame: Frame, task: int) -> None:
        self.frame, self.task = weakref.ref(frame), task

    def __call__(self) -> None:
        frame, self.frame = self.frame, None
        frame = frame() if frame is not None else None
        if frame is not None:
            frame.release(self.task)

    __del__ = __call__   # a failed backward drops its callbacks unrun: release then


# ---------------------------------------------------------------------------
# checkpoint()
# ---------------------------------------------------------------------------

def check_arguments(fn: Any, flags: dict[str, Any], context_fn: Any, use_reentrant: Any,
                    determinism_check: Any) -> None:
    """``checkpoint``'s own arguments, refused at the call before anything runs."""
    if not callable(fn):
        raise TypeError(f"checkpoint: fn must be callable, got {type(fn).__name__}. "
                        "Pass the function or module itself, e.g. checkpoint(block, x).")
    for name, value in flags.items():
        if not isinstance(value, bool):
            flag(value, name, where="checkpoint")   # raises, with the library's wording
    if not isinstance(determinism_check, str) or determinism_check not in ("default", "none"):
        raise (ValueError if isinstance(determinism_check, str) else TypeError)(
            "checkpoint: determinism_check must be 'default' (compare every saved tensor of the "
            "recomputation with the forward's) or 'none' (compare none), "
            f"{got(determinism_check)}.")
    if use_reentrant is not None and use_reentrant is not False:
        check_not_reentrant("checkpoint", use_reentrant,
                            "torch.utils.checkpoint for the reentrant variant")
    if context_fn is not None and not callable(context_fn):
        raise TypeError("checkpoint: context_fn must be None or a function returning two context "
                        "managers (forward_context, recompute_context), got "
                        f"{type(context_fn).__name__}.")


def checkpoint_contexts(context_fn: Callable[[], Any] | None
                        ) -> tuple[ContextManager | None, ContextManager | None]:
    """The (forward, recompute) pair ``context_fn`` returns, checked; ``(None, None)`` for None
    (nothing to enter)."""
    if context_fn is None:
        return None, None
    contexts = context_fn()
    if not (isinstance(contexts, (tuple, list)) and len(contexts) == 2
            and all(hasattr(c, "__enter__") and hasattr(c, "__exit__") for c in contexts)):
        shown = repr(contexts) if len(repr(contexts)) < 80 else type(contexts).__name__
        raise TypeError("checkpoint: context_fn must return two context managers "
                        "(forward_context, recompute_context), e.g. lambda: "
                        f"(contextlib.nullcontext(), my_context()); it returned {shown}.")
    return contexts[0], contexts[1]


def checkpoint(
    fn: Callable[..., Any],
    *args: Any,
    preserve_rng_state: bool = True,
    early_stop: bool = True,
    debug: bool = False,
    context_fn: Callable[[], tuple[ContextManager, ContextManager]] | None = None,
    use_reentrant: bool | None = None,
    determinism_check: str = "default",
    **kwargs: Any,
) -> Any:
    """Run ``fn(*args, **kwargs)`` without keeping its activations; recompute them in backward.

    Args:
        fn: any callable; ``args`` and ``kwargs`` may be nested tuples, lists,
            dicts (any pytree) holding tensors, numbers, strings, ``None``, dtypes or
            sizes; its return value is passed back untouched.
        preserve_rng_state: replay the CPU (and initialised CUDA) RNG state during
            recomputation so dropout draws the same mask. The caller's RNG stream is
            never moved by the recomputation. A ``torch.Generator`` of the caller's
            (``torch.rand(..., generator=g)``) is replayed too where ``fn`` or the arguments
            reach it (``checks.reachable``: closures, defaults, globals, partials, modules
            and their attributes). One held by a plain object is not replayed, silently: pass
            it as an argument. Python's ``random`` and NumPy are never replayed; the first
            call of each function warns (``NotReplayedRandomWarning``) if it drew from them.
        early_stop: stop the recomputation as soon as every needed tensor is back
            (``torch.utils.checkpoint.set_checkpoint_early_stop`` overrides it, as in torch).
        debug: print a trace line for each pack, recompute, early stop and unpack.
        context_fn: returns ``(forward_context, recompute_context)`` to run ``fn``
            under in forward and in recomputation (as in ``torch.utils.checkpoint``).
        use_reentrant: accepted for drop-in compatibility; only ``False``/``None``.
        determinism_check: ``"default"`` compares each saved tensor of the recomputation
            with the forward's (shape, dtype, device, the kind of op that made it, and that
            a saved parameter is the same tensor); ``"none"`` compares none, as in torch.
            Either way an in-place change of a saved tensor inside ``fn`` raises, as in plain
            autograd.

    Gradients equal plain autograd bitwise; under ``torch.no_grad()`` this is a plain
    call. Under ``torch.compile`` it runs eagerly between compiled graphs (``compile.py``).

    >>> x = torch.randn(8, 8, requires_grad=True)
    >>> w = torch.randn(8, 8, requires_grad=True)
    >>> def layer(inp, weight, *, scale):
    ...     return (inp @ weight).relu() * scale
    >>> checkpoint(layer, x, w, scale=2.0).sum().backward()
    >>> expected = torch.autograd.grad(layer(x, w, scale=2.0).sum(), w)[0]
    >>> torch.equal(w.grad, expected)
    True
    """
    if torch.compiler.is_compiling():   # Dynamo is tracing this call: run it eagerly
        return compile_.outside_dynamo(checkpoint)(
            fn, *args, preserve_rng_state=preserve_rng_state, early_stop=early_stop, debug=debug,
            context_fn=context_fn, use_reentrant=use_reentrant, determinism_check=determinism_check,
            **kwargs)
    check_arguments(fn, {"preserve_rng_state": preserve_rng_state, "early_stop": early_stop,
                         "debug": debug}, context_fn, use_reentrant, determinism_check)
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    contexts = checkpoint_contexts(context_fn)
    # torch.utils.checkpoint.set_checkpoint_early_stop(...) overrides early_stop, as in torch
    override = getattr(sys.modules.get("torch.utils.checkpoint"), "_enable_checkpoint_early_stop",
                       None)
    # The observers: selective checkpointing's contexts, and the trace while one is recorded.
    observers = [context for context in contexts if isinstance(context, Observer)]
    add_tracer(observers, echo=debug)
    frame = Frame(fn, args, kwargs, preserve_rng_state,
                  early_stop if override is None else override, contexts,
                  determinism_check == "default", observers)
    foreign_draws = rng.ForeignDraws.for_first_call(fn) if preserve_rng_state else None
    cuda_was_up = torch.cuda.is_initialized()
    returned = False
    forward_contexts = [frame.rng_forward, frame.forward_context, frame.checks.during_forward(),
                        *[observer.before_forward(frame) for observer in observers]]
    # Under the pack and unpack hooks (step 1): the registration as a user of the region's
    # generators (threads, rng.py), context_fn's forward context, the checks' (which modules ran,
    # on a module's first call), the observers' (the trace's).
    with torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack), \
            contextlib.ExitStack() as stack:
        for context in forward_contexts:
            if context is not None:
                stack.enter_context(context)
        try:
            output = fn(*args, **kwargs)
            returned = True
        except BaseException as error:
            # for the message below, should a forward context swallow it (words, not the
            # exception: a local holding it would hold its own traceback, a reference cycle)
            failure = f"{type(error).__name__}: {error}"
            raise
    if not returned:
        raise RuntimeError(errors.context_swallowed(frame.region, failure))
    if foreign_draws is not None:
        foreign_draws.warn_if_moved(frame.region, stacklevel=caller_stacklevel() + 1)
    if preserve_rng_state and not cuda_was_up and torch.cuda.is_initialized():
        raise CheckpointError(errors.cuda_initialised_inside(frame.region))
    frame.forward_done(output)
    return output


compile_.run_eagerly_under_dynamo(checkpoint)
