"""Non-reentrant activation checkpointing, built on saved-tensor hooks.

Design notes
============

Autograd keeps, for every op of the forward pass, the tensors its backward
formula needs ("saved tensors"). ``torch.autograd.graph.saved_tensors_hooks``
lets us intercept that: a *pack* hook is called with each tensor as autograd
saves it and returns whatever should be stored instead; an *unpack* hook is
called when backward needs the tensor and must give it back.

Forward. ``checkpoint(fn, *args)`` runs ``fn`` under a pack hook that stores a
small empty ``_Holder`` instead of the tensor, and records the tensor's key
(shape, dtype, device and which kind of node made it). It also keeps what it
needs to run ``fn`` again: the inputs, the RNG state and the autocast state. No
activation made inside ``fn`` outlives the forward pass (unless ``fn`` returns it).

Backward. The first unpack in a backward pass finds its holder empty and
recomputes: it runs ``fn`` again from the kept inputs under a second pack hook
(the *recomputation* hook) that, for the i-th saved tensor, puts a detached
copy into the i-th holder. The i-th save of the rerun is the i-th save of the
forward because the rerun executes the same ops in the same order. The guards
(``ckptlib.guards``) turn a violation of that into a ``CheckpointError`` instead
of a silently wrong gradient: each key is compared at every pack of the rerun,
and before the rerun the versions of everything the region reads from outside
(inputs, parameters, captured tensors) are compared with the forward's.
``ckptlib.rerun_checks`` holds what those keys cannot show: an in-place change of
a saved tensor inside ``fn``, an input ``fn`` changed itself, a replaced parameter,
an op that fills a buffer after saving it (early stop waits for it), a transform
(vmap, forward-mode AD) that ended before backward.

Early stop. The rerun raises ``_StopRecomputation`` from the hook as soon as
the last holder that backward can still ask for is filled: ops after it would
only produce tensors nobody needs.

One use, then gone. An unpack hands the tensor over and forgets it, so each
recomputed tensor lives from its recomputation until its node has run. Whatever
a backward did not consume (``torch.autograd.grad`` on a subset of inputs) is
dropped by a callback queued on the autograd engine for that backward; if the
backward fails, the engine drops the callback unrun, and its deletion does the
same work, so a failed backward releases the recomputed tensors too.

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

torch.compile. Dynamo cannot trace Python saved-tensor hooks: a traced forward
would save the compiled graph's tensors while the eager rerun saves others, and
hand them over by position. So ``checkpoint`` is disabled for Dynamo (as by
``torch.compiler.disable``; the end of this file says how): inside a compiled
function Dynamo breaks the graph at the call, runs the checkpoint eagerly, hooks
and all, and compiles the code before and after it. With ``fullgraph=True`` the
break is an error that says so. A compiled function *inside* a checkpoint runs
compiled in forward and in the rerun alike.

Extension points (only selective checkpointing, ``ckptlib.selective``, uses them).
``context_fn`` gives a forward and a recomputation context, as in
``torch.utils.checkpoint``. If the forward context has a method
``observe_saved_tensors()``, the frame calls it once and passes every tensor it
packs to the callback it returns (if not ``None``). The recompute context may
raise ``RecomputeAgain`` to have the function run once more from the start; a
recomputed saved tensor on the *meta* device asks the context's
``recompute_again()`` whether to do the same.

The learner-facing trace (``record_trace``) lives in ``ckptlib.trace``. This
file is the library's version of what notebook 03 builds step by step.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten, tree_unflatten

from ckptlib import guards, rerun_checks, rng
from ckptlib._arguments import check_checkpoint_arguments, checkpoint_contexts, torch_early_stop
from ckptlib.guards import StateUpdatedTwiceWarning
from ckptlib.rng import NotReplayedRandomWarning
from ckptlib.trace import CheckpointTrace, OpNames, TensorMeta, TraceEvent, publish, record_trace, tracing_active

__all__ = [
    "checkpoint", "CheckpointError", "RecomputeAgain", "CheckpointTrace", "TraceEvent", "TensorMeta", "PackedInfo",
    "StateUpdatedTwiceWarning", "NotReplayedRandomWarning", "record_trace", "peek_saved", "is_recomputing",
]


class CheckpointError(RuntimeError):
    """A checkpointed region could not give back what autograd saved in forward."""


_region_counter = itertools.count()
_outside_backward_keys = itertools.count(start=1)


# ---------------------------------------------------------------------------
# The holder autograd stores, and what inspection tools may see of it
# ---------------------------------------------------------------------------


class _Holder:
    """What autograd keeps instead of a tensor: an index, and per backward pass the
    recomputed tensor until it is unpacked (then ``_USED``)."""

    __slots__ = ("frame", "index", "frees_memory", "recomputed", "unpack_count", "__weakref__")

    def __init__(self, frame: "_Frame", index: int, frees_memory: bool) -> None:
        self.frame = frame
        self.index = index
        self.frees_memory = frees_memory  # False for inputs, parameters, buffers and views of them
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
    frees_memory: bool = True  # False when dropping it freed nothing (an input, a parameter, a buffer, a view of one)


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


# -- extension point (selective checkpointing) -------------------------------
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


def _is_size(value: Any) -> bool:
    # torch.Size is a registered pytree node that unflattens to a plain tuple: keep it whole.
    return isinstance(value, torch.Size)


# ---------------------------------------------------------------------------
# One checkpoint call's frame
# ---------------------------------------------------------------------------


def _leaf_of(tensor: torch.Tensor) -> torch.Tensor | None:
    """The leaf a saved tensor is, or is a view of (a parameter, ``weight.t()``); None otherwise."""
    if tensor.is_leaf:
        return tensor
    base = tensor._base
    return base if base is not None and base.is_leaf else None


class _Frame:
    """Everything one ``checkpoint`` call needs to rerun its function later."""

    def __init__(self, fn, args, kwargs, preserve_rng_state, early_stop, contexts, debug,
                 check_keys=True) -> None:
        self.fn = fn
        self.region_number = next(_region_counter)
        if kwargs or not all(isinstance(a, torch.Tensor) for a in args):
            leaves, self.spec = tree_flatten((args, kwargs), is_leaf=_is_size)
        else:  # the common case, tensors only: skip the pytree machinery
            leaves, self.spec = list(args), None
        self.tensor_positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        tensors = [leaves[i] for i in self.tensor_positions]
        self.other_leaves = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        self.reads = guards.OutsideReads(fn, tensors)
        self.saved_inputs: Callable[[], list[torch.Tensor]] | None = _save_inputs(tensors)
        self.input_ptrs = guards.input_ptrs(tensors)  # saved tensors sharing these free nothing
        self.rng_state = rng.capture(tensors, rng.generators_reachable(
            fn, self.other_leaves if self.spec is not None else ())) if preserve_rng_state else None
        self.rng_after: rng.RNGState | None = None
        self.rng_overlap: set = set()   # generators another thread's checkpoint used during forward
        self.autocast = _autocast_state()
        self.early_stop = early_stop
        self.check_keys = check_keys           # determinism_check="default"; "none" compares no keys
        self.transforms = rerun_checks.transform_levels()  # forward-mode AD and torch.func levels the forward ran under
        self.inputs_modified_by_fn: str | None = None
        # context_fn was called once: its two contexts may share state (selective checkpointing's
        # cache), and the recompute context is entered again for every rerun.
        self.forward_context, self.recompute_context = contexts
        observe = getattr(self.forward_context, "observe_saved_tensors", None)  # extension point
        self.saved_observer: Callable[[torch.Tensor], None] | None = observe() if observe is not None else None
        self.debug = debug
        self.weak_holders: list[weakref.ReferenceType[_Holder]] = []
        self.keys: list[tuple] = []  # guards.saved_key of each saved tensor, in pack order
        # index -> (id, storage) of a saved leaf that requires grad (a parameter or an input). The
        # rerun must save the same tensor or the same storage: FSDP2 gathers a parameter anew (same
        # tensor, new storage); the rerun's inputs are detached (new tensor, same storage).
        self.leaf_ids: dict[int, tuple[int, int | None]] = {}
        self.recomputed_in: set[int] = set()
        self.recompute_count = 0
        self.op_names = OpNames() if self.tracing else None
        self.freed_bytes = 0
        # storage pointer -> (its storage, weakly; bytes counted as freed): saved twice, counted once
        self.counted_storages: dict[int, tuple[StorageWeakRef, int]] = {}

    @property
    def region(self) -> str:
        """A readable name for this checkpoint call, e.g. ``Block.forward@3``."""
        return f"{guards.function_name(self.fn, through_partials=True)}@{self.region_number}"

    def meta(self, index: int) -> TensorMeta:
        return TensorMeta.from_key(self.keys[index])

    # -- trace ------------------------------------------------------------
    @property
    def tracing(self) -> bool:
        return self.debug or tracing_active()

    def emit(self, kind: str, index: int | None = None, op: str | None = None,
             meta: TensorMeta | None = None, detail: str = "") -> None:
        if self.tracing:
            publish(TraceEvent(kind, self.region, index, op, meta, detail), echo=self.debug)

    # -- forward ----------------------------------------------------------
    def pack(self, tensor: torch.Tensor) -> _Holder:
        if self.saved_observer is not None:
            self.saved_observer(tensor)
        ptr = guards.storage_ptr(tensor)
        leaf = _leaf_of(tensor)
        if leaf is not None:   # its version is checked before a rerun (one made inside dies first: skipped)
            self.reads.add_saved_leaf(leaf)
            if leaf.requires_grad:   # the rerun must save this very parameter (rerun_checks.replaced_parameter)
                self.leaf_ids[len(self.weak_holders)] = (id(leaf), ptr)
        holder = _Holder(self, len(self.weak_holders), self._frees_memory(leaf, ptr))
        self.weak_holders.append(weakref.ref(holder))
        self.keys.append(guards.saved_key(tensor, ptr, self.input_ptrs))
        if self.op_names is not None:
            self._trace_pack(holder, tensor, ptr)
        return holder

    def _frees_memory(self, leaf: torch.Tensor | None, ptr: int | None) -> bool:
        """Does dropping a saved tensor free memory? Not if it lives on outside the region: an
        input's storage, a leaf that requires grad (or a view of one), a buffer or captured tensor
        ``fn`` reaches. A leaf *without* grad may be made inside (dropout's mask): that one does."""
        if ptr and ptr in self.input_ptrs:
            return False
        if leaf is None:
            return True
        return not (leaf.requires_grad or (ptr and self.reads.holds_storage(ptr)))

    def _trace_pack(self, holder: _Holder, tensor: torch.Tensor, ptr: int | None) -> None:
        meta = self.meta(holder.index)
        earlier = self.counted_storages.get(ptr) if ptr else None
        if not holder.frees_memory:
            detail = "dropped, but it is an input, a parameter or a view of one: frees nothing"
        elif earlier is not None and not earlier[0].expired():
            detail = "dropped (same storage as an earlier saved tensor: counted once)"
        else:
            detail, self.freed_bytes = "dropped", self.freed_bytes + meta.nbytes
            if ptr:
                self.counted_storages[ptr] = (StorageWeakRef(tensor.untyped_storage()), meta.nbytes)
        self.emit("pack", holder.index, self.op_names.current, meta, detail)

    def forward_done(self, rng_use: rng.in_use | None, output: Any) -> None:
        self.op_names = None
        self.inputs_modified_by_fn = rerun_checks.input_modified_by_fn(self.reads.inputs)
        self.reads.after_forward()
        if rng_use is not None:
            self.rng_after = rng.capture_devices(self.rng_state.cuda_devices)
            self.rng_overlap = rng_use.overlapped
        if not self.keys:
            # Nothing was saved, so nothing will ever be recomputed: let the inputs go.
            self.saved_inputs = None
        if self.tracing:
            self._emit_forward_done(output)

    def _emit_forward_done(self, output: Any) -> None:
        # A dropped tensor the region also returns (ReLU's output: the next block's input) stays
        # alive; its bytes, counted as freed at its pack, are taken back here.
        returned = {guards.storage_ptr(t) for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)}
        counted = filter(None, (self.counted_storages.get(ptr) for ptr in returned if ptr))
        kept_bytes = sum(nbytes for storage, nbytes in counted if not storage.expired())
        self.freed_bytes, self.counted_storages = self.freed_bytes - kept_bytes, {}
        output_note = f" ({kept_bytes} more are the region's output, alive while it is)" if kept_bytes else ""
        self.emit("forward_done", detail=f"{len(self.keys)} saved tensors dropped, {self.freed_bytes} "
                  f"bytes of activations freed{output_note}; kept the inputs, RNG and autocast state")

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
        if value is not _USED:
            value = self._unmodified(holder, *value)
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
            return self._unmodified(holder, *holder.recomputed[key])
        finally:
            self._forget(key)

    def _unmodified(self, holder: _Holder, tensor: torch.Tensor, version: int | None) -> torch.Tensor:
        """``tensor``, recomputed at ``version``, unless an in-place op of the rerun changed it since.

        Saved-tensor hooks switch off autograd's own check (a saved tensor's version at its save
        against its version at its use), and a recomputed tensor is a detached alias of the rerun's
        tensor: ``h = a.exp(); h.mul_(3)`` changes it after ``exp`` saved it. Plain autograd raises there.
        """
        if version is None or tensor._version == version:
            return tensor
        self._forget(torch._C._current_graph_task_id())
        raise CheckpointError(f"checkpoint {self.region}: " + rerun_checks.modified_in_place(
            holder.index, self.keys[holder.index], version, tensor._version, _current_node_name()))

    def recompute(self, graph_task: int, trigger: int) -> None:
        if self.inputs_modified_by_fn is not None:
            raise CheckpointError(f"checkpoint {self.region}: {self.inputs_modified_by_fn}")
        changed = self.reads.changed()
        if changed is not None:
            raise CheckpointError(f"checkpoint {self.region}: {changed}")
        alive = [i for i, ref in enumerate(self.weak_holders) if ref() is not None]
        last_needed = alive[-1] if alive else -1
        self.emit("recompute", trigger, detail=f"rerunning {self.region} for {len(alive)} of "
                  f"{len(self.keys)} saved tensors")
        self.recomputed_in.add(graph_task)
        self.recompute_count += 1
        if graph_task >= 0:
            torch.autograd.Variable._execution_engine.queue_callback(_ReleaseUnused(self, graph_task))
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
        rerun_input_ptrs: set[int] = set()   # filled by _rerun once it has the inputs back
        rng_uses: list[rng.in_use] = []
        stop_at_next_pack = False   # the last needed tensor is an op's buffer, filled after its save
        stopped = False             # _StopRecomputation was raised (it may come out wrapped, see below)

        def stop(index: int) -> None:
            nonlocal stopped
            if index + 1 < len(self.keys):
                self.emit("early_stop", index, detail=f"all needed tensors back; skipped "
                          f"{len(self.keys) - index - 1} later saves")
            stopped = True
            raise _StopRecomputation

        def pack_recomputed(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal stop_at_next_pack
            if stop_at_next_pack:
                stop(last_needed)
            index = next(counter)
            if not tensor.requires_grad:
                detached = tensor
            elif type(tensor) is torch.Tensor:
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
                    f"{TensorMeta.of(tensor)}). {self._mismatch_causes()}"
                )
            if self.check_keys:
                self._check_key(index, tensor, rerun_input_ptrs)
            holder = self.weak_holders[index]()
            if holder is not None:
                # Its version now, for _unmodified. Not for what lives on outside the region (an input, a
                # parameter, a buffer): a recompute context may put a buffer back after the rerun.
                holder.recomputed[graph_task] = (detached, detached._version if holder.frees_memory else None)
            if self.early_stop and index == last_needed:
                if rerun_checks.may_be_filled_later(self.keys, index):
                    stop_at_next_pack = True
                else:
                    stop(index)
            return detached

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack_recomputed, _identity), \
                    self.reads.around_rerun(self.region):
                self._rerun(rerun_input_ptrs, rng_uses)
        except _StopRecomputation:
            pass
        except RecomputeAgain:
            raise          # the holders filled so far are filled again by the next run
        except BaseException as error:
            # Code between the hook and here may wrap the early stop in its own exception (TorchScript's
            # interpreter re-raises it as a RuntimeError): once stopped, every needed holder is filled.
            if not stopped:
                self._forget(graph_task)
                lost = rerun_checks.lost_transform(self.transforms)
                if lost is not None and not isinstance(error, CheckpointError):
                    raise CheckpointError(f"checkpoint {self.region}: {lost}") from error
                raise
        shared = self._generators_shared(rng_uses)
        saved = next(counter)
        if shared or saved <= last_needed:
            self._forget(graph_task)
            raise CheckpointError(f"checkpoint {self.region}: " + (shared or (
                f"the recomputation saved fewer tensors than the forward pass did (forward saved "
                f"{len(self.keys)}, recomputation {saved}). {self._mismatch_causes()}")))

    def _check_key(self, index: int, tensor: torch.Tensor, rerun_input_ptrs: set[int]) -> None:
        """Refuse a rerun whose ``index``-th saved tensor is not the one the forward saved ``index``-th."""
        ptr = guards.storage_ptr(tensor)
        key = guards.saved_key(tensor, ptr, rerun_input_ptrs)
        if key != self.keys[index]:
            again = getattr(self.recompute_context, "recompute_again", None)  # extension point
            if tensor.device.type == "meta" and self.keys[index][2].type != "meta" and again is not None \
                    and again():
                raise RecomputeAgain   # a result the context skipped was needed after all
            lost = rerun_checks.lost_transform(self.transforms)
            raise CheckpointError(f"checkpoint {self.region}: " + (
                lost or guards.key_mismatch(index, self.keys[index], key)))
        forward_leaf = self.leaf_ids.get(index)
        if forward_leaf is not None and forward_leaf[1] != ptr and forward_leaf[0] != id(_leaf_of(tensor)):
            raise CheckpointError(f"checkpoint {self.region}: {rerun_checks.replaced_parameter(index, self.meta(index))}")

    def _mismatch_causes(self) -> str:
        return rerun_checks.lost_transform(self.transforms) or guards.MISMATCH_CAUSES

    def _rerun(self, rerun_input_ptrs: set[int], rng_uses: list[rng.in_use]) -> None:
        inputs = [rerun_checks.rerun_input(t) if t.requires_grad else t for t in self.saved_inputs()]
        rerun_input_ptrs.update(guards.input_ptrs(inputs))
        leaves = self._leaves_with(inputs)
        args, kwargs = tree_unflatten(leaves, self.spec) if self.spec is not None else (leaves, {})
        rng_context = rng.replay(self.rng_state) if self.rng_state is not None else contextlib.nullcontext()
        _thread_state.recompute_depth += 1
        try:
            with rng_context as rng_use, torch.enable_grad(), rerun_checks.outside_inference_mode(), _autocast(self.autocast), \
                    self.recompute_context:
                if rng_use is not None:
                    rng_uses.append(rng_use)
                self.fn(*args, **kwargs)
        finally:
            _thread_state.recompute_depth -= 1

    def _generators_shared(self, rng_uses: list[rng.in_use]) -> str | None:
        """Did another thread's checkpoint use a generator this region draws from meanwhile?"""
        overlap = self.rng_overlap.union(*(use.overlapped for use in rng_uses))
        drawn = rng.drawn_from(self.rng_state, self.rng_after) & overlap if overlap else set()
        if not drawn:
            return None
        return (f"another thread's checkpoint used the random number generator ({', '.join(map(str, drawn))}) "
                "while this region's forward or recomputation ran, and this region draws random numbers "
                "(dropout): the generator is shared by all threads, so the recomputation cannot replay the "
                "forward's draws and its gradients would be wrong. Run checkpointed steps that draw random "
                "numbers in one thread at a time (a lock around forward and backward), or use processes "
                "instead of threads.")

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


class _ReleaseUnused:
    """Queued on the autograd engine for one backward: drops the recomputed tensors it did not use.

    The engine calls it when that backward ends. If the backward fails, the engine drops its
    callbacks unrun, and the deletion does the same work. It holds the frame weakly: a frame
    (and the inputs it keeps) must die with its graph nodes, not live on until the whole
    backward pass ends.
    """

    __slots__ = ("frame_ref", "graph_task")

    def __init__(self, frame: _Frame, graph_task: int) -> None:
        self.frame_ref, self.graph_task = weakref.ref(frame), graph_task

    def __call__(self) -> None:
        frame = self.frame_ref()
        if frame is not None:
            frame._forget(self.graph_task)

    __del__ = __call__


_NO_PYTHON_DISPATCH = torch._C._DisableTorchDispatch


def _identity(x):
    return x


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
    call. Under ``torch.compile`` it runs eagerly between compiled graphs (see the notes).

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
    if torch.compiler.is_compiling():   # Dynamo is tracing this call: run it eagerly (see the notes)
        return _checkpoint_outside_dynamo()(fn, *args, preserve_rng_state=preserve_rng_state, early_stop=early_stop,
                                            debug=debug, context_fn=context_fn, use_reentrant=use_reentrant,
                                            determinism_check=determinism_check, **kwargs)
    check_checkpoint_arguments(fn, {"preserve_rng_state": preserve_rng_state, "early_stop": early_stop, "debug": debug},
                     context_fn, use_reentrant, determinism_check)
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)

    frame = _Frame(fn, args, kwargs, preserve_rng_state, torch_early_stop(early_stop), checkpoint_contexts(context_fn), debug,
                   check_keys=determinism_check == "default")
    op_names = frame.op_names if frame.op_names is not None else contextlib.nullcontext()
    rng_context = rng.in_use(frame.rng_state) if preserve_rng_state else contextlib.nullcontext()
    foreign_draws = rng.ForeignDraws.first_time(fn) if preserve_rng_state else None
    cuda_was_up = torch.cuda.is_initialized()
    returned = False
    with torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack), frame.forward_context, op_names, \
            rng_context as rng_use:
        try:
            output = fn(*args, **kwargs)
            returned = True
        except BaseException as error:
            failure = error   # kept for the message below, should the forward context swallow it
            raise
    if not returned:
        raise RuntimeError(
            f"checkpoint {frame.region}: the forward context from context_fn suppressed the exception the "
            f"checkpointed function raised ({type(failure).__name__}: {failure}), so there is no output to "
            "return. Let the context's __exit__ return None or False (do not swallow exceptions), or catch "
            "the exception inside the function.") from failure
    if foreign_draws is not None:
        foreign_draws.warn_if_moved(frame.region, stacklevel=guards._caller_stacklevel() + 1)
    if preserve_rng_state and not cuda_was_up and torch.cuda.is_initialized():
        raise CheckpointError(
            f"checkpoint {frame.region}: CUDA was initialised inside the checkpointed function, so "
            "its RNG state could not be saved for the recomputation. Initialise CUDA before "
            "checkpointing (e.g. torch.cuda.init(), or move the model to the GPU first), or pass "
            "preserve_rng_state=False."
        )
    frame.forward_done(rng_use, output)
    return output


# torch.compile: ``checkpoint`` must run eagerly, never traced (see the notes). Decorating it with
# ``torch.compiler.disable`` would import Dynamo, a second, at every ``import ckptlib``. So the function
# carries the two marks that decorator sets, which Dynamo reads where it meets a call (it then breaks the
# graph there, and ``fullgraph=True`` reports the reason); should Dynamo trace into it anyway, the first
# line hands over to the real decorated function, made when first needed.
_COMPILE_REASON = ("ckptlib.checkpoint runs eagerly under torch.compile (Python saved-tensor hooks cannot be "
                   "traced): drop fullgraph=True, or use torch.utils.checkpoint, which the compiler traces, "
                   "inside a fullgraph region.")
checkpoint._torchdynamo_disable = True   # type: ignore[attr-defined]
checkpoint._torchdynamo_disable_msg = _COMPILE_REASON   # type: ignore[attr-defined]
_disabled_checkpoint: Callable[..., Any] | None = None


def _checkpoint_outside_dynamo() -> Callable[..., Any]:
    global _disabled_checkpoint
    if _disabled_checkpoint is None:
        try:
            _disabled_checkpoint = torch.compiler.disable(checkpoint, reason=_COMPILE_REASON)
        except TypeError:   # torch before 2.6: no reason= (the graph break is the same)
            _disabled_checkpoint = torch.compiler.disable(checkpoint)
    return _disabled_checkpoint
