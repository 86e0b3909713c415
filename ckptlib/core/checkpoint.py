"""The checkpoint itself: notebook 03's one-cell checkpoint, grown into the library's.

Autograd keeps, for every op of the forward pass, the tensors its backward formula needs
("saved tensors"). ``torch.autograd.graph.saved_tensors_hooks`` lets us intercept that: a
*pack* hook is called with each tensor as autograd saves it and returns whatever should be
stored instead; an *unpack* hook is called when backward needs the tensor and must give it back.
This file reads in the order of notebook 03:

1. ``pack`` stores a small empty :class:`Holder` instead of the tensor and remembers the
   tensor's key (shape, dtype, device, which node made it: ``keys.py``). No activation made
   inside ``fn`` outlives the forward pass (unless ``fn`` returns it).
2. The first ``unpack`` of a backward pass finds its holder empty and calls ``recompute``: it
   runs ``fn`` again from the kept inputs under a second pack hook, ``fill``, that puts the
   i-th saved tensor of the rerun into the i-th holder, its key compared with the forward's.
3. The rerun replays the random numbers (``ckptlib/rng.py``) and the autocast state of the
   forward, so dropout draws the same mask.
4. Early stop: ``fill`` raises :class:`StopRecomputation` as soon as the last holder backward
   can still ask for is filled; ops after it would only make tensors nobody needs.
5. One use, then gone: an unpack hands its tensor over and forgets it. It first checks the
   tensor's version, as autograd checks a saved tensor's (saved-tensor hooks switch that off):
   an in-place op of the rerun that changed it after an op saved it (``h = a.exp();
   h.mul_(3)``) is refused, as plain autograd refuses it. (Not for tensors that live on outside
   the region, which free no memory: a recompute context may put a buffer back.) What a backward did
   not use (``torch.autograd.grad`` on a subset) is dropped by ``release``, queued on the
   autograd engine for that backward (run when it ends, or when a failed one drops it).

Holders keep recomputed tensors per backward pass (*graph task*), so ``retain_graph=True``
then a second backward recomputes once more. The inputs are kept as autograd saved tensors
(``inputs.py``): inside an outer checkpoint they pass through its pack hook and are dropped
too (nesting, also with ``torch.utils.checkpoint`` on either side).

Guards and observers. The guards (``guards.py``: what a rerun must reproduce beyond the keys,
and its ``reads``, ``reads.py``: versions of what the region reads) are always there and called
by name where they check: ``self.guards.on_pack``, ``self.reads.before_rerun`` and so on. At the
same named points (``on_pack``, ``after_forward``, ``before_rerun``, ``on_recompute``,
``on_fill``, ``on_early_stop``, ``after_rerun``, ``on_unpack``, ``on_release``) the frame calls
its other observers, when it has any: :class:`~ckptlib.core.trace.Tracer` while a trace is
recorded, selective checkpointing's forward context when it has ``observe_saved_tensors()``. It
enters what ``around_forward()`` returns around the forward and what ``before_rerun`` returns
around the rerun. None of them changes what is computed (a guard may refuse, by raising).
Inspection (``peek.py``) answers unpacks without recomputing; ``compile.py`` makes
``checkpoint`` run eagerly under ``torch.compile``.

Extension points (selective checkpointing uses them). ``context_fn`` gives a forward and a
recompute context, as in ``torch.utils.checkpoint``. The recompute context may raise
:class:`RecomputeAgain` to have the function run once more from the start; a recomputed saved
tensor on the *meta* device asks the context's ``recompute_again()`` whether to do the same.
"""
from __future__ import annotations

import contextlib
import itertools
import sys
import threading
import weakref
from typing import Any, Callable, ContextManager

import torch

from ckptlib import rng
from ckptlib._arguments import check_checkpoint_arguments, checkpoint_contexts
from ckptlib.core import autocast, errors, guards, inputs, observers, peek, trace
from ckptlib.core import compile as compile_
from ckptlib.core.errors import CheckpointError, RecomputeAgain, caller_stacklevel
from ckptlib.core.keys import TensorMeta, key_mismatch, saved_key
from ckptlib.core.region import RegionId, function_name
from ckptlib.storage import storage_ptr, storage_ptrs

__all__ = ["checkpoint", "is_recomputing", "Holder", "Frame", "StopRecomputation",
           "CheckpointError", "RecomputeAgain"]

_region_numbers = itertools.count()
_outside_backward_tasks = itertools.count(start=1)
_NOTHING = contextlib.nullcontext()       # stateless: one for every call
_NO_PYTHON_DISPATCH = torch._C._DisableTorchDispatch
_dispatch_modes = torch._C._len_torch_dispatch_stack   # Python dispatch modes now active
_NO_CONTEXTS = (_NOTHING, _NOTHING)   # no context_fn: stateless, shared
# What `with torch.autograd.graph.saved_tensors_hooks(pack, unpack):` does, as two calls (its
# Python-level object costs more than they do, twice per region).
_push_hooks = torch._C._autograd._push_saved_tensors_default_hooks
_pop_hooks = torch._C._autograd._pop_saved_tensors_default_hooks
_DETERMINISM_CHECKS = ("default", "none")
_USED = object()   # a holder's entry once its tensor was handed to backward


class Holder:
    """What autograd stores instead of a saved tensor (step 1)."""

    __slots__ = ("index", "recomputed", "unpack_count", "frees_memory", "__weakref__")

    def __init__(self, index: int) -> None:
        self.index = index
        # backward pass (graph task id) -> (its recomputed tensor, that tensor's version then)
        self.recomputed: dict[int, Any] = {}
        self.unpack_count = 0
        self.frees_memory = True   # set by the guards: False for inputs, parameters, views of them


class StopRecomputation(Exception):
    """Raised from ``fill`` once the last needed tensor is back (step 4)."""


class _ThreadState(threading.local):
    recompute_depth = 0


_thread = _ThreadState()


def is_recomputing() -> bool:
    """True while a ckptlib checkpoint is re-running its function in this thread."""
    return _thread.recompute_depth > 0


class Frame:
    """Everything one ``checkpoint`` call needs to rerun its function later."""

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict, preserve_rng_state: bool,
                 early_stop: bool, contexts: tuple[ContextManager, ContextManager], debug: bool,
                 check_keys: bool) -> None:
        self.fn, self.number = fn, next(_region_numbers)
        tensors_only = not kwargs
        for arg in args:
            if not isinstance(arg, torch.Tensor):
                tensors_only = False
                break
        if tensors_only:   # the common case: the inputs are the arguments, no pytree
            self.arguments: inputs.Arguments | None = None
            tensors = list(args)
        else:
            self.arguments = inputs.Arguments(args, kwargs)
            tensors = self.arguments.tensors
        self.saved_inputs: list | None = inputs.save_inputs(tensors)   # each with .unpack()
        self.input_ptrs = storage_ptrs(tensors)
        self.rng = rng.capture_for(fn, tensors, self.arguments.leaves if self.arguments else ()) \
            if preserve_rng_state else None
        self.rng_after: rng.RNGState | None = None
        self.rng_overlap: set = set()   # generators another thread's checkpoint used meanwhile
        self.autocast = autocast.state() if autocast.any_enabled() else None
        self.early_stop, self.check_keys = early_stop, check_keys
        self.forward_context, self.recompute_context = contexts   # context_fn was called once
        self.holders: list[weakref.ReferenceType[Holder]] = []
        self.keys: list[tuple] = []   # the key of each saved tensor, in pack order
        self.recomputed_in: set[int] = set()
        self.recompute_count = 0
        self.guards = guards.Guards(fn, tensors, self.input_ptrs)   # called by name, always
        self.reads = self.guards.reads   # what fn reads from outside, and its versions
        self.observers: list[Any] = []   # the others, called at the named points
        if self.forward_context is not _NOTHING:   # extension point: selective checkpointing's
            observe = getattr(self.forward_context, "observe_saved_tensors", None)
            callback = observe() if observe is not None else None
            if callback is not None:
                self.observers.append(observers.SavedTensorsCallback(callback))
        if debug or trace.open_traces:
            self.observers.append(trace.Tracer(echo=debug))
        if self.observers:
            self._hooks()

    # The named points: each holds the bound methods of the observers that have one (the
    # common case: no observers, nothing to call).
    on_pack = after_forward = before_rerun = on_recompute = on_fill = on_early_stop = \
        after_rerun = on_unpack = on_release = around_forward = ()

    def _hooks(self) -> None:
        """Bind each named point to the methods of the observers that have one
        (``observers.py``: the points, and what each receives)."""
        watchers = self.observers
        kinds = tuple(map(type, watchers))
        for point, positions in observers.PLANS.get(kinds) or observers.plan(kinds):
            hooks = []
            for position in positions:
                hooks.append(getattr(watchers[position], point))
            setattr(self, point, hooks)

    @property
    def region(self) -> RegionId:
        """This call's name in messages and traces, e.g. ``Block.forward@3``."""
        return RegionId(function_name(self.fn, through_partials=True), self.number)

    def meta(self, index: int) -> TensorMeta:
        return TensorMeta.from_key(self.keys[index])

    def node_name(self) -> str | None:
        """The backward node running now (who unpacks), or ``None``."""
        node = torch._C._current_autograd_node()
        return node.name() if node is not None else None

    # -- forward (step 1) ---------------------------------------------------------------
    def pack(self, tensor: torch.Tensor) -> Holder:
        holder = Holder(len(self.holders))
        self.holders.append(weakref.ref(holder))
        ptr = storage_ptr(tensor)
        self.keys.append(saved_key(tensor, ptr, self.input_ptrs))
        self.guards.on_pack(self, holder, tensor, ptr)
        for hook in self.on_pack:
            hook(self, holder, tensor, ptr)
        return holder

    def forward_done(self, output: Any, rng_use: rng.in_use | None) -> None:
        if rng_use is not None:   # what the forward left: did this region draw at all?
            self.rng_after = rng_use.after
            self.rng_overlap = rng_use.overlapped
        if not self.keys:   # nothing saved, so nothing will be recomputed: let the inputs go
            self.saved_inputs = None
        self.reads.after_forward(self, output)
        for hook in self.after_forward:
            hook(self, output)

    # -- backward (steps 2 and 5) ---------------------------------------------------------
    def unpack(self, holder: Holder) -> torch.Tensor:
        peeking = peek.state.peek
        if peeking is not None:
            return peeking.answer(self, holder)
        task = torch._C._current_graph_task_id()
        outside = task == -1   # grad_fn._saved_* read by hand: recompute for it, keep nothing
        if outside:
            task = -next(_outside_backward_tasks)
        try:
            if task not in self.recomputed_in:
                self.recompute(task, holder.index)
            entry = holder.recomputed.get(task, _USED)
            if entry is _USED:
                raise CheckpointError(
                    errors.unpacked_twice(self.region, holder.index, self.meta(holder.index)))
            tensor, version = entry
            if version >= 0 and tensor._version != version:   # changed since its rerun saved it
                self.release(task)
                raise CheckpointError(f"checkpoint {self.region}: " + guards.modified_in_place(
                    holder.index, self.keys[holder.index], version, tensor._version,
                    self.node_name()))
            for hook in self.on_unpack:
                hook(self, task, holder, tensor)
            holder.recomputed[task] = _USED   # handed over: forgotten (step 5)
            holder.unpack_count += 1
            return tensor
        finally:
            if outside:
                self.release(task)

    def recompute(self, task: int, trigger: int) -> None:
        if trace.open_traces and not any(isinstance(o, trace.Tracer) for o in self.observers):
            self.observers.append(trace.Tracer(echo=False))   # a trace opened after the forward
            self._hooks()
        alive = 0   # holders backward can still ask for, and the last of them
        last_needed = -1
        for again in (False, True):   # a second run only if the recompute context asks for it
            # the contexts to run it under, from the reads and the observers (each may refuse it)
            watch = self.reads.before_rerun(self)
            watches = [watch] if watch is not None else []
            for hook in self.before_rerun:
                watch = hook(self)
                if watch is not None:
                    watches.append(watch)
            if not again:
                for index, ref in enumerate(self.holders):
                    if ref() is not None:
                        alive += 1
                        last_needed = index
            for hook in self.on_recompute:
                hook(self, trigger, alive, again)
            if not again:
                self.recomputed_in.add(task)
                self.recompute_count += 1
                if task >= 0:
                    torch.autograd.Variable._execution_engine.queue_callback(
                        _ReleaseUnused(self, task))
            try:
                return self.rerun(task, last_needed, watches)
            except RecomputeAgain:   # selective checkpointing: a skipped result was needed
                if again:
                    self.release(task)
                    raise CheckpointError(errors.asked_again_twice(self.region)) from None

    def rerun(self, task: int, last_needed: int, watches: list) -> None:
        """Run ``fn`` again under ``fill``, the second pack hook (steps 2 to 4), and under
        ``watches`` (the contexts ``before_rerun`` gave)."""
        keys = self.keys
        count = 0                   # tensors the rerun saved so far
        stop_at_next_pack = False   # the last needed tensor is an op's buffer, filled after saving
        stopped = False             # StopRecomputation was raised (it may come out wrapped)

        def fill(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal count, stop_at_next_pack, stopped
            if stop_at_next_pack:   # the buffer next to the last needed tensor is filled by now
                index = last_needed
            else:
                index = count
                count += 1
                if not tensor.requires_grad:
                    detached = tensor
                elif type(tensor) is torch.Tensor and _dispatch_modes():
                    with _NO_PYTHON_DISPATCH():   # a plain detach, not through the mode (~15 us)
                        detached = tensor.detach()
                else:
                    detached = tensor.detach()
                if index >= len(keys):
                    raise CheckpointError(errors.saved_more(self.region, len(keys), index,
                                                            TensorMeta.of(tensor),
                                                            self.guards.mismatch_causes()))
                ptr = None
                if self.check_keys:
                    ptr = storage_ptr(tensor)
                    key = saved_key(tensor, ptr, rerun_input_ptrs)
                    if key != keys[index]:
                        self._refuse(index, tensor, key)
                holder = self.holders[index]()
                if holder is not None:   # with its version, as autograd keeps a saved tensor's
                    holder.recomputed[task] = (detached, detached._version if holder.frees_memory
                                               else -1)
                self.guards.on_fill(self, task, index, tensor, detached, holder, ptr)
                for hook in self.on_fill:
                    hook(self, task, index, tensor, detached, holder, ptr)
                if not self.early_stop or index != last_needed:
                    return detached
                if guards.may_be_filled_later(keys, index):
                    stop_at_next_pack = True
                    return detached
            # Early stop (step 4): every tensor backward can still ask for is back.
            if index + 1 < len(keys):
                for hook in self.on_early_stop:
                    hook(self, index)
            stopped = True
            raise StopRecomputation

        tensors = []
        for saved in self.saved_inputs:
            tensor = saved.unpack()
            tensors.append(guards.rerun_input(tensor) if tensor.requires_grad else tensor)
        rerun_input_ptrs = storage_ptrs(tensors)   # what fill's keys mark as an input
        args, kwargs = self.arguments.rebuild(tensors) if self.arguments else (tensors, {})
        # What the rerun runs under, each only where it is needed (the common case: the replay
        # alone): the forward's random numbers, the watches, inference mode left (a backward
        # under it is legal; the rerun records a graph), the forward's autocast state where
        # backward's differs, context_fn's.
        random = rng.replay(self.rng) if self.rng is not None else None
        contexts = [random, *watches] if random is not None else watches
        if torch.is_inference_mode_enabled():
            contexts.append(torch.inference_mode(False))
        if self.autocast != (autocast.state() if autocast.any_enabled() else None):
            contexts.extend(autocast.contexts(self.autocast))
        if self.recompute_context is not _NOTHING:
            contexts.append(self.recompute_context)
        failure = None
        try:
            grad_was = torch.is_grad_enabled()   # off in backward: the rerun records a graph
            _push_hooks(fill, _identity)   # with saved_tensors_hooks(fill, _identity):
            _thread.recompute_depth += 1
            try:
                torch._C._set_grad_enabled(True)
                with observers.one_context(contexts) if contexts else _NOTHING:
                    try:
                        self.fn(*args, **kwargs)
                    except StopRecomputation:   # caught here: the contexts exit normally
                        pass
            finally:
                torch._C._set_grad_enabled(grad_was)
                _thread.recompute_depth -= 1
                _pop_hooks()
        except BaseException as error:
            failure = error
        try:
            self.reads.after_rerun(self, failure)
            for hook in self.after_rerun:
                hook(self, failure)
        except BaseException as refusal:   # an observer's refusal takes the failure's place
            failure = refusal
        if failure is not None and not isinstance(failure, RecomputeAgain) and not stopped:
            # (RecomputeAgain: the holders filled so far are filled again by the next run.) Code
            # between the hook and here may wrap the early stop in its own exception
            # (TorchScript re-raises it as a RuntimeError): once stopped, every needed holder is
            # filled.
            self.release(task)
            lost = self.guards.lost_transform()
            if lost is not None and not isinstance(failure, CheckpointError):
                raise CheckpointError(f"checkpoint {self.region}: {lost}") from failure
            raise failure
        if isinstance(failure, RecomputeAgain):
            raise failure
        shared = None
        if random is not None and (self.rng_overlap or random.overlapped):
            shared = rng.shared_with_another_thread(self.rng, self.rng_after, self.rng_overlap,
                                                    [random])
        if shared or count <= last_needed:
            self.release(task)
            raise CheckpointError(f"checkpoint {self.region}: " + (shared or errors.saved_fewer(
                len(keys), count, self.guards.mismatch_causes())))

    def _refuse(self, index: int, tensor: torch.Tensor, key: tuple) -> None:
        """The rerun's ``index``-th saved tensor is not the forward's: ask again, or raise."""
        again = getattr(self.recompute_context, "recompute_again", None)   # extension point
        if tensor.device.type == "meta" and self.keys[index][2].type != "meta" \
                and again is not None and again():
            raise RecomputeAgain   # a result the context skipped was needed after all
        raise CheckpointError(f"checkpoint {self.region}: " + (
            self.guards.lost_transform() or key_mismatch(index, self.keys[index], key)))

    def release(self, task: int) -> None:
        """Drop the recomputed tensors of backward pass ``task`` that nobody took (step 5)."""
        released = 0
        for ref in self.holders:
            holder = ref()
            if holder is not None and holder.recomputed.pop(task, _USED) is not _USED:
                released += 1
        self.recomputed_in.discard(task)
        for hook in self.on_release:
            hook(self, task, released)


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


def _identity(x):
    return x


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
            (``torch.rand(..., generator=g)``) is replayed too where the checkpoint can
            find it: among the arguments, in ``fn``'s closure or defaults, as a global name
            its code reads, in a ``functools.partial``'s arguments, or as an attribute of a
            module ``fn`` is, is bound to or closes over, and of its submodules. One reached
            any other way (an attribute of a plain object, of a module that is a global) is
            not replayed, silently: pass it as an argument. Python's ``random`` and
            NumPy are never replayed; the first call of each function warns
            (``NotReplayedRandomWarning``) if it drew from them.
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
    if torch.compiler.is_compiling():   # Dynamo is tracing this call: run it eagerly
        return compile_.outside_dynamo(checkpoint)(
            fn, *args, preserve_rng_state=preserve_rng_state, early_stop=early_stop, debug=debug,
            context_fn=context_fn, use_reentrant=use_reentrant, determinism_check=determinism_check,
            **kwargs)
    if not (type(preserve_rng_state) is bool and type(early_stop) is bool and type(debug) is bool
            and context_fn is None and (use_reentrant is None or use_reentrant is False)
            and type(determinism_check) is str and determinism_check in _DETERMINISM_CHECKS
            and callable(fn)):   # not the common case: check all, each with its own message
        check_checkpoint_arguments(fn, {"preserve_rng_state": preserve_rng_state,
                                        "early_stop": early_stop, "debug": debug},
                                   context_fn, use_reentrant, determinism_check)
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    contexts = checkpoint_contexts(context_fn) if context_fn is not None else _NO_CONTEXTS
    override = getattr(sys.modules.get("torch.utils.checkpoint"), "_enable_checkpoint_early_stop",
                       None)   # torch.utils.checkpoint.set_checkpoint_early_stop(...), as in torch
    frame = Frame(fn, args, kwargs, preserve_rng_state,
                  early_stop if override is None else override, contexts,
                  debug, check_keys=determinism_check == "default")
    foreign_draws = rng.ForeignDraws.first_time(fn) if preserve_rng_state else None
    cuda_was_up = torch.cuda.is_initialized()
    returned = False
    # The forward runs under: this region's registration as a user of its generators (threads,
    # rng.py), context_fn's forward context, the observers' (the trace's).
    rng_use = rng.in_use(frame.rng) if frame.rng is not None else None
    contexts = [rng_use] if rng_use is not None else []
    if frame.forward_context is not _NOTHING:
        contexts.append(frame.forward_context)
    for hook in frame.around_forward:
        contexts.append(hook())
    _push_hooks(frame.pack, frame.unpack)   # with saved_tensors_hooks(frame.pack, frame.unpack):
    try:
        with observers.one_context(contexts) if contexts else _NOTHING:
            try:
                output = fn(*args, **kwargs)
                returned = True
            except BaseException as error:
                failure = error   # kept for the message below, should a forward context swallow it
                raise
    finally:
        _pop_hooks()
    if not returned:
        raise RuntimeError(errors.context_swallowed(frame.region, failure)) from failure
    if foreign_draws is not None:
        foreign_draws.warn_if_moved(frame.region, stacklevel=caller_stacklevel() + 1)
    if preserve_rng_state and not cuda_was_up and torch.cuda.is_initialized():
        raise CheckpointError(errors.cuda_initialised_inside(frame.region))
    frame.forward_done(output, rng_use)
    return output


compile_.run_eagerly_under_dynamo(checkpoint)
