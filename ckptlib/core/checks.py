"""The checks that refuse a rerun which would differ from its forward: one object per checkpoint
call, owned by its frame and called by name at the frame's steps.

Design notes
============

A rerun gives the right gradients only if it computes the values the forward computed. Those
values were dropped (that is the point), so they cannot be compared. What is cheap to keep is
compared instead, and every check errs towards a loud ``CheckpointError`` rather than a silently
wrong gradient.

1. **Keys** (notebook 03's step 6). The rerun hands its i-th saved tensor to the i-th holder, so it
   must be the tensor the forward saved i-th. Each save's :class:`SavedKey` holds shape, dtype,
   device and its *producer*: the kind of autograd node that made it (``ExpBackward0``), or "an
   input of the region" (it shares storage with one), or a leaf that requires grad (a parameter)
   or not (a constant). Equal shapes are not enough: a global flag that turns ``t.exp()`` into
   ``t.sin()`` saves a tensor of the same shape, but ``exp`` saves its *result* and ``sin`` its
   *input*. The key cannot see an op swapped for another that saves the same tensor, nor other
   numbers made by the same kind of node (``t * 2`` against ``t * 3``).
2. **The same parameter.** A parameter replaced between forward and backward
   (``torch.func.functional_call`` swaps them only while its call runs) has the same key. The
   rerun checks that each saved parameter is the tensor the forward saved, or has its storage
   (FSDP2 gathers a parameter anew; the rerun's own inputs are detached aliases).
3. **Versions of what the region reads.** Autograd checks at every unpack that a saved tensor
   was not modified in place since it was saved. A rerun *reads* tensors instead, so it checks
   them itself: the inputs and the leaves an op saved (``weight.t()``'s weight) before it starts;
   the other tensors ``fn`` reaches (:func:`reachable`) during it, by a dispatch mode pushed only
   when one of them changed since the forward (an optimizer step before backward; a BatchNorm that
   a later segment ran), which refuses the first op that reads a changed one. A function that
   changed its own input in place (``u.mul_(2)``) destroyed the values the rerun starts from:
   refused too, with that cause.
4. **In-place changes inside the region.** Saved-tensor hooks switch off autograd's own version
   check, and a recomputed tensor is a detached alias of the rerun's tensor: in
   ``h = a.exp(); h.mul_(3); h.sin()`` the rerun's ``mul_`` changes what ``exp`` saved. The frame
   keeps each recomputed tensor's version and refuses a changed one at unpack, as autograd
   would. ``on_pack`` sets the holder's ``check_version`` flag for that: on for a tensor made
   inside the region, off for one that lives on outside it (an input, a parameter, a buffer),
   whose version the reads' check (3) already covers and which a recompute context may put back.
5. **State the forward updates.** The rerun is a second forward pass: a module that updates its
   own buffers in place (BatchNorm's running statistics, ``spectral_norm``'s power iteration on
   ``u``, ``v``) would update them again, and one that also computes with them
   (``spectral_norm``) would compute another weight, so other gradients. So the rerun runs with
   the state the forward saw, and the buffers end as the forward left them, as in plain autograd:
   before the forward, the buffers a module updates are copied; before each rerun their values
   then are put aside and the copies put in; after it (also when it raises) the values put aside
   go back. Which buffers a module updates is learned on its first checkpointed call in training
   mode: every buffer of it (but boolean ones, masks) is copied, and the ones that then moved
   (their version, or their values: BatchNorm's kernel writes its statistics without a version
   bump) are remembered, weakly, for the module's later calls, which copy only those (and learn
   one more whose version moves later, for the calls after). A module
   that does not update state (GPT-2's blocks) pays nothing after its first call. A module counts
   as learned only if it ran (a global forward pre-hook, installed during first calls only): one
   that ``fn`` reaches but did not call is asked again on a later call. The copies and restores
   go through ``.data``: they are ckptlib's, not modifications the version checks (3) should see.
   State written that was not copied (a captured tensor, a parameter updated in place such as
   ``Embedding(max_norm)``'s, a buffer of a module in eval mode) cannot be put back as it was: if
   the rerun changes it again, the rerun computed from a value the forward had not seen, and a
   ``CheckpointError`` says so (its value is put back first). State ``fn`` cannot reach
   (:func:`reachable`) is neither copied nor checked. ``StateUpdatedTwiceWarning`` is no longer
   emitted; it stays importable for code that filters it.
6. **Transforms that ended.** A forward under forward-mode AD or ``torch.func.vmap`` saves
   tensors a backward outside it cannot rebuild: :meth:`Checks.lost_transform` names that cause.

What can fn reach? One walk, :func:`reachable`, answers it for these checks and for the RNG
replay (the caller's ``torch.Generator`` objects). Its rule is in its docstring and in the
README's table of where ckptlib differs from ``torch.utils.checkpoint``.
"""
from __future__ import annotations

import contextlib
import functools
import types
import weakref
from typing import Any, ContextManager, Iterable, Iterator, NamedTuple

import torch
import torch.autograd.forward_ad as forward_ad
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ckptlib.core import errors
from ckptlib.core.errors import CheckpointError, TensorMeta

__all__ = ["Checks", "reachable", "StateUpdatedTwiceWarning", "SavedKey", "saved_key",
           "storage_ptr", "storage_ptrs", "INPUT", "PARAMETER", "CONSTANT", "VIEW"]


class StateUpdatedTwiceWarning(UserWarning):
    """Once warned that a rerun updated module state (BatchNorm's running statistics) a second
    time. No longer emitted: the rerun now runs with the state the forward saw and leaves it as
    the forward did (note 5), or a ``CheckpointError`` says why it cannot. Importable still, for
    code that filters it."""


# ---------------------------------------------------------------------------
# Storage identity: which memory a tensor lives in (every module of ckptlib asks it here)
# ---------------------------------------------------------------------------

def storage_ptr(tensor: torch.Tensor) -> int | None:
    """Where ``tensor``'s storage starts: shared by its views and aliases (``detach()``).

    ``None`` where there is no memory to compare: layouts without a storage (sparse, mkldnn,
    jagged nested), wrapper subclasses without one of their own (FSDP2's sharded parameters),
    and empty or meta tensors (pointer 0).

    >>> a = torch.zeros(4)
    >>> storage_ptr(a) == storage_ptr(a[1:]) == storage_ptr(a.detach())
    True
    >>> storage_ptr(torch.empty(0)) is None
    True
    """
    try:
        return tensor.untyped_storage().data_ptr() or None
    except (RuntimeError, NotImplementedError):
        return None


def storage_ptrs(tensors: Iterable[torch.Tensor]) -> set[int]:
    """The storage pointers of ``tensors`` (those without memory left out)."""
    ptrs = set(map(storage_ptr, tensors))
    ptrs.discard(None)
    return ptrs


# ---------------------------------------------------------------------------
# What can fn reach: one walk, one rule
# ---------------------------------------------------------------------------

MAX_STEPS = 4   # an object more steps than this away from fn is not looked at


def reachable(fn: Any, arguments: Iterable[Any] = ()) -> Iterator[tuple[str, Any]]:
    """``(label, object)`` for each module, tensor and ``torch.Generator`` that ``fn`` can reach.

    The rule: from ``fn`` (and each of ``arguments``, the checkpoint's arguments that are not
    tensors), follow a function's closure cells, its defaults and the global names its code reads;
    a bound method's object and function; a ``functools.partial``'s function and arguments; the
    submodules, parameters and buffers of a module (they are part of it: no step), and the other
    attributes of a module whose class is not torch's own; one level into a list, tuple or dict.
    Each of these is one step; nothing more than four steps from ``fn`` is looked at. Other
    objects are not looked into (a plain object's attributes are not followed: pass what it holds
    as an argument instead), and one that raises while being looked at is left out: a user's
    object may answer every attribute (a proxy) or raise from a property.

    >>> scale = torch.ones(2)
    >>> [label for label, _ in reachable(lambda t: t * scale)]
    ['scale']
    """
    seen: set[int] = set()
    found: list[tuple[str, Any]] = []

    def visit(label: str, obj: Any, steps: int, in_container: bool = False,
              named: bool = False) -> None:
        if steps > MAX_STEPS or id(obj) in seen:
            return
        seen.add(id(obj))
        try:
            look_into(label, obj, steps, in_container, named)
        except Exception:
            pass

    def look_into(label: str, obj: Any, steps: int, in_container: bool, named: bool) -> None:
        if isinstance(obj, (torch.Tensor, torch.Generator)):
            found.append((label, obj))
        elif isinstance(obj, nn.Module):
            found.append((label, obj))
            for name, child in obj.named_children():   # part of the module: no step
                visit(f"{label}.{name}", child, steps)
            if not type(obj).__module__.startswith("torch."):
                for name, value in vars(obj).items():
                    if not name.startswith("_"):
                        visit(f"{label}.{name}", value, steps + 1)
        elif isinstance(obj, functools.partial):
            visit(label, obj.func, steps + 1)
            for position, arg in enumerate(obj.args):
                visit(f"{label}.args[{position}]", arg, steps + 1)
            for name, arg in obj.keywords.items():
                visit(f"{label}.keywords[{name!r}]", arg, steps + 1)
        elif isinstance(obj, types.MethodType):
            visit(label if named else type(obj.__self__).__name__, obj.__self__, steps + 1)
            visit(label, obj.__func__, steps + 1)
        elif isinstance(obj, types.FunctionType):
            code = obj.__code__
            # A function renamed after what it runs (apply_checkpointing names a region's function
            # by the module's path, ``blocks.3``) lends that name to the methods it closes over.
            renamed = obj.__qualname__ != code.co_qualname
            for name, cell in zip(code.co_freevars, obj.__closure__ or ()):
                try:
                    value = cell.cell_contents
                except ValueError:      # a cell not filled yet
                    continue
                if renamed and isinstance(value, types.MethodType):
                    visit(obj.__qualname__, value, steps + 1, named=True)
                else:
                    visit(name, value, steps + 1)
            defaults = obj.__defaults__ or ()
            names = code.co_varnames[code.co_argcount - len(defaults):code.co_argcount]
            for name, default in zip(names, defaults):
                visit(name, default, steps + 1)
            for name, default in (obj.__kwdefaults__ or {}).items():
                visit(name, default, steps + 1)
            module_globals = obj.__globals__
            for name in code.co_names:
                if name in module_globals:
                    visit(name, module_globals[name], steps + 1)
        elif not in_container and isinstance(obj, (list, tuple)):
            for position, item in enumerate(obj):
                visit(f"{label}[{position}]", item, steps + 1, in_container=True)
        elif not in_container and isinstance(obj, dict):
            for key, item in obj.items():
                visit(f"{label}[{key!r}]", item, steps + 1, in_container=True)

    visit(function_label(fn), fn, 0)
    for position, argument in enumerate(arguments):
        visit(f"argument[{position}]", argument, 1)
    return iter(found)


def function_label(fn: Any) -> str:
    """How messages name what ``fn`` reaches from: a module's class, else the function's name."""
    if isinstance(fn, nn.Module):
        return type(fn).__name__
    name = getattr(fn, "__qualname__", None) if isinstance(fn, types.FunctionType) else None
    return name or type(fn).__name__


def _own_tensors(module: nn.Module) -> Iterator[tuple[str, str, torch.Tensor]]:
    """``(kind, name, tensor)`` for a module's own parameters and buffers (not its children's).
    A TorchScript module keeps no such dicts: it lists them itself."""
    parameters, buffers = module.__dict__.get("_parameters"), module.__dict__.get("_buffers")
    if parameters is None or buffers is None:
        for name, tensor in (*module.named_parameters(), *module.named_buffers()):
            yield "parameter" if isinstance(tensor, nn.Parameter) else "buffer", name, tensor
        return
    for name, tensor in parameters.items():
        if tensor is not None:
            yield "parameter", name, tensor
    for name, tensor in buffers.items():
        if tensor is not None:
            yield "buffer", name, tensor


# ---------------------------------------------------------------------------
# Keys (check 1)
# ---------------------------------------------------------------------------

INPUT = "an input of the region"
PARAMETER = "a parameter (a leaf that requires grad)"
CONSTANT = "a constant (a leaf that does not require grad)"
VIEW = "view"


class SavedKey(NamedTuple):
    """What the forward saved at one index, compared at the same index of every rerun.
    ``producer``: the autograd node class that made it, ``INPUT``, ``PARAMETER``, ``CONSTANT``,
    or ``(VIEW, <that>)`` for a view.

    >>> x = torch.randn(3, requires_grad=True)
    >>> saved_key(x.exp(), None, set()).producer.__name__
    'ExpBackward0'
    """

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    producer: Any


def saved_key(tensor: torch.Tensor, ptr: int | None, input_ptrs: set[int]) -> SavedKey:
    """The key of a saved tensor; ``ptr`` is its ``storage_ptr``.

    A view's producer is its base's, marked as a view: which node makes a view depends on the
    dispatch path (``reshape`` is a ``ReshapeAliasBackward0`` normally, a ``ViewBackward0`` under
    a dispatch mode such as selective checkpointing's rerun).
    """
    if ptr and ptr in input_ptrs:
        return SavedKey(tensor.shape, tensor.dtype, tensor.device, INPUT)
    base = tensor._base
    source = tensor if base is None else base
    node = source.grad_fn
    made_by: Any = (type(node) if node is not None
                    else PARAMETER if source.requires_grad else CONSTANT)
    return SavedKey(tensor.shape, tensor.dtype, tensor.device,
                    made_by if base is None else (VIEW, made_by))


def producer_words(key: tuple) -> str:
    """How a key's tensor was made, in words that follow "a tensor" or "one"."""
    made_by = key[3]
    is_view = isinstance(made_by, tuple)
    made_by = made_by[1] if is_view else made_by
    if isinstance(made_by, str):
        return f"that is a view of {made_by}" if is_view else f"that is {made_by}"
    made = f"made by {made_by.__name__}"
    return f"that is a view of a tensor {made}" if is_view else made


def key_mismatch(index: int, forward: tuple, rerun: tuple) -> str:
    return errors.key_mismatch(index, TensorMeta.from_key(forward), TensorMeta.from_key(rerun),
                               producer_words(forward), producer_words(rerun))


def _leaf_of(tensor: torch.Tensor) -> torch.Tensor | None:
    """The leaf a saved tensor is, or is a view of (a parameter, ``weight.t()``); None otherwise."""
    if tensor.is_leaf:
        return tensor
    base = tensor._base
    return base if base is not None and base.is_leaf else None


# ---------------------------------------------------------------------------
# The checks of one checkpoint call
# ---------------------------------------------------------------------------

class Checks:
    """The checks of one checkpoint call (see the notes), in the order the frame calls them:
    ``during_forward``, ``on_pack``, ``after_forward``, ``before_recompute``, ``on_fill``,
    ``after_recompute``."""

    def __init__(self, fn: Any, inputs: list[torch.Tensor], arguments: Iterable[Any] = ()) -> None:
        self.input_ptrs = storage_ptrs(inputs)
        self.inputs = [(weakref.ref(t), t._version) for t in inputs]   # versions at the call
        self.named: list[tuple[str, Any]] = []   # (label, module or tensor) for messages
        self.generators: list[torch.Generator] = []   # the caller's, for the RNG replay
        # (buffer, its value before the forward) for the state the forward updates (note 5);
        # modules being learned: id -> (module, [(name, buffer, version, value before)])
        self.state: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.probed: dict[int, tuple[nn.Module, list[tuple[str, torch.Tensor, int,
                                                           torch.Tensor]]]] = {}
        self.ran: set[int] = set()
        # learned modules' other buffers, with versions: one updated now is learned for next time
        self.unlearned: list[tuple[nn.Module, frozenset[str], list[tuple[str, torch.Tensor,
                                                                          int]]]] = []
        tensors: list[torch.Tensor] = []
        for label, obj in reachable(fn, arguments):
            if isinstance(obj, torch.Generator):
                self.generators.append(obj)
                continue
            self.named.append((label, obj))
            if isinstance(obj, torch.Tensor):
                tensors.append(obj)
                continue
            own = list(_own_tensors(obj))
            tensors.extend(tensor for _, _, tensor in own)
            if obj.training:
                self._copy_state(obj, own)
        self.outside_ptrs = storage_ptrs(tensors)   # saved tensors sharing these free nothing
        self.read = [(t, t._version) for t in tensors]   # sorted from `written` after_forward
        self.written: list[torch.Tensor] = []   # updated by the forward and not copied before it
        # leaves (or bases of views) an op saved, weakly, with their versions
        self.saved_leaves: list[tuple[weakref.ReferenceType, int]] = []
        # index -> (id, storage) of a saved leaf that requires grad: the rerun must save it again
        self.leaf_ids: dict[int, tuple[int, int | None]] = {}
        self.transforms = _transform_levels()
        self.input_modified_by_fn: str | None = None
        # one rerun's: the stale tensors' ids, the watch, state it updated that was not copied
        self._keep: set[int] = set()
        self._watch: _StaleReads | None = None
        self._updated_again: str | None = None

    # -- state the forward updates (note 5) ---------------------------------------------
    def _copy_state(self, module: nn.Module, own: list[tuple[str, str, torch.Tensor]]) -> None:
        """Copy the buffers ``module`` (in training mode) updates, or on its first call all of
        them, to learn which those are."""
        learned = _updates.get(module)
        buffers = [(name, tensor) for kind, name, tensor in own
                   if kind == "buffer" and tensor.dtype != torch.bool]
        if learned is None and buffers:
            self.probed[id(module)] = (module, [(name, tensor, tensor._version, tensor.clone())
                                                for name, tensor in buffers])
        elif learned is not None:
            self.state.extend((tensor, tensor.clone()) for name, tensor in buffers
                              if name in learned)
            others = [(name, tensor, tensor._version) for name, tensor in buffers
                      if name not in learned]
            if others:
                self.unlearned.append((module, learned, others))

    def during_forward(self) -> ContextManager | None:
        """On a module's first call: which of the modules being learned the forward ran (a
        global forward pre-hook, removed when the forward ends). ``None``: nothing to learn."""
        return self._noting_ran() if self.probed else None

    @contextlib.contextmanager
    def _noting_ran(self) -> Iterator[None]:
        with nn.modules.module.register_module_forward_pre_hook(self._note_ran):
            yield

    def _note_ran(self, module: nn.Module, args: Any) -> None:
        if id(module) in self.probed:
            self.ran.add(id(module))

    # -- forward ------------------------------------------------------------------------
    def on_pack(self, holder: Any, tensor: torch.Tensor, ptr: int | None) -> None:
        """Note a saved leaf, and set the holder's ``frees_memory`` and ``check_version``."""
        if ptr and ptr in self.input_ptrs:   # an input or a view of one: checked as an input
            holder.frees_memory = holder.check_version = False
            return
        leaf = _leaf_of(tensor)
        if leaf is None:
            return
        self.saved_leaves.append((weakref.ref(leaf), leaf._version))
        if leaf.requires_grad:
            self.leaf_ids[holder.index] = (id(leaf), ptr)
        # A leaf *without* grad may be made inside (dropout's mask): that one frees memory.
        outside = leaf.requires_grad or bool(ptr and ptr in self.outside_ptrs)
        holder.frees_memory = holder.check_version = not outside

    def after_forward(self) -> None:
        """Tell what the forward wrote (BatchNorm's statistics) from what it read; note an input
        the function changed itself."""
        for position, (ref, version) in enumerate(self.inputs):
            tensor = ref()
            if tensor is not None and tensor._version != version:
                self.input_modified_by_fn = errors.input_modified_by_fn(
                    position, TensorMeta.of(tensor), version, tensor._version)
                break
        for module_id, (module, buffers) in self.probed.items():
            updated = [(name, tensor, before) for name, tensor, version, before in buffers
                       if tensor._version != version or not torch.equal(tensor, before)]
            self.state.extend((tensor, before) for _, tensor, before in updated)
            if module_id in self.ran:
                _updates[module] = frozenset(name for name, _, _ in updated)
        for module, learned, others in self.unlearned:
            updated = {name for name, tensor, version in others if tensor._version != version}
            if updated:   # not copied this time (the rerun will say so if it matters): next time
                _updates[module] = learned | updated
        self.probed, self.ran, self.unlearned = {}, set(), []
        copied = {id(tensor) for tensor, _ in self.state}
        read = []
        for tensor, version in self.read:
            if id(tensor) in copied:
                continue
            if tensor._version == version:
                read.append((tensor, version))
            else:
                self.written.append(tensor)
        self.read = read

    # -- rerun --------------------------------------------------------------------------
    def before_recompute(self, frame: Any) -> ContextManager | None:
        """Refuse a rerun from changed inputs or saved leaves; return the context to run the rerun
        under: the forward's state put in and back (note 5) and the watch over the other reads
        (``None`` when there is no state and none of the reads changed: nothing to enter)."""
        message = self.input_modified_by_fn
        for position, (ref, version) in enumerate(self.inputs):
            tensor = ref()
            if message is None and tensor is not None and tensor._version != version:
                message = errors.input_modified_after(position, TensorMeta.of(tensor), version,
                                                      tensor._version)
        for ref, version in self.saved_leaves:
            leaf = ref()
            if message is None and leaf is not None and leaf._version != version:
                message = errors.read_modified(self.name_of(leaf), version, leaf._version)
        if message is not None:
            raise CheckpointError(f"checkpoint {frame.region}: {message}")
        stale = [(t, version) for t, version in self.read if t._version != version]
        self._keep = {id(t) for t, _ in stale}
        self._watch = _StaleReads(self, frame, stale) if stale else None
        if not (self.state or self.written):
            return self._watch
        return self._forward_state(frame, self._watch)

    @contextlib.contextmanager
    def _forward_state(self, frame: Any, watch: TorchDispatchMode | None) -> Iterator[None]:
        """Run the rerun with the state the forward saw, then put back what was there (note 5).
        Through ``.data``: a restore moves no version counter, so no check takes it for a
        change made from outside."""
        now = [(tensor, tensor.clone()) for tensor, _ in self.state]
        written_now = [(tensor, tensor.clone()) for tensor in self.written]
        try:
            for tensor, before in self.state:
                tensor.data.copy_(before)
            with watch if watch is not None else contextlib.nullcontext():
                yield
        finally:
            for tensor, value in now:
                tensor.data.copy_(value)
            for tensor, value in written_now:
                if not torch.equal(tensor, value):
                    tensor.data.copy_(value)
                    if self._updated_again is None:
                        self._updated_again = errors.state_updated_twice(
                            frame.region, self.owner_of(tensor)[1])

    def on_fill(self, frame: Any, index: int, tensor: torch.Tensor, ptr: int | None) -> None:
        """The rerun's saved parameter must be the forward's (check 2)."""
        forward_leaf = self.leaf_ids.get(index)
        if forward_leaf is not None and forward_leaf[1] != ptr \
                and forward_leaf[0] != id(_leaf_of(tensor)):
            meta = TensorMeta.of(tensor)
            raise CheckpointError(
                f"checkpoint {frame.region}: {errors.replaced_parameter(index, meta)}")

    def after_recompute(self, frame: Any, error: BaseException | None) -> None:
        """The next rerun's baselines; a stale read refused as itself; state the rerun updated
        again that was not copied before the forward (note 5)."""
        # What the rerun wrote is the next rerun's start; a tensor changed since the forward
        # (`_keep`: the next rerun must still not read it) keeps the forward's version.
        self.read = [(t, version if id(t) in self._keep else t._version)
                     for t, version in self.read]
        self.saved_leaves = [(ref, ref()._version if ref() is not None else version)
                             for ref, version in self.saved_leaves]
        watch, self._watch = self._watch, None
        updated_again, self._updated_again = self._updated_again, None
        if watch is not None and watch.message is not None:
            # Raised inside an op (a TorchScript interpreter wraps it): raise it as itself.
            if not (isinstance(error, RuntimeError) and str(error) == watch.message):
                raise CheckpointError(watch.message) from error
            return
        if updated_again is not None:
            raise CheckpointError(updated_again) from error

    # -- words for messages -------------------------------------------------------------
    def mismatch_causes(self) -> str:
        """The likely causes of a rerun that saved other tensors."""
        return self.lost_transform() or errors.MISMATCH_CAUSES

    def lost_transform(self) -> str | None:
        """The real cause when a rerun fails because its forward's transform has ended."""
        forward_level, functorch_level = self.transforms
        now_forward_level, now_functorch_level = _transform_levels()
        if functorch_level is not None and now_functorch_level != functorch_level:
            return errors.LOST_FUNCTORCH
        if forward_level >= 0 and now_forward_level != forward_level:
            return errors.LOST_FORWARD_AD
        return None

    def name_of(self, tensor: torch.Tensor) -> str:
        """``parameter `Block.fc1.weight` (8x8 float32 ...)`` where fn reaches it, else its
        metadata."""
        meta = TensorMeta.of(tensor)
        for label, obj in self.named:
            if obj is tensor:
                return f"captured tensor `{label}` ({meta})"
            if isinstance(obj, nn.Module):
                for kind, name, candidate in _own_tensors(obj):
                    if candidate is tensor:
                        return f"{kind} `{label}.{name}` ({meta})"
        kind = "a parameter" if tensor.requires_grad else "a constant"
        return (f"a tensor the region reads ({meta}, a leaf that "
                f"{'requires' if tensor.requires_grad else 'does not require'} grad: {kind})")

    def owner_of(self, tensor: torch.Tensor) -> tuple[Any, str]:
        """(module or tensor, description) of what owns written state ``tensor``."""
        for label, obj in self.named:
            if obj is tensor:
                return tensor, f"captured tensor `{label}`"
            if isinstance(obj, nn.Module):
                for kind, name, candidate in _own_tensors(obj):
                    if candidate is tensor and kind == "buffer":
                        return obj, f"{type(obj).__name__} `{label}` (buffer {name})"
        return tensor, f"a tensor ({TensorMeta.of(tensor)})"


# module -> the names of the buffers its forward updates in training mode (note 5), learned
_updates: "weakref.WeakKeyDictionary[nn.Module, frozenset[str]]" = weakref.WeakKeyDictionary()


def _transform_levels() -> tuple[int, int | None]:
    """(forward-mode AD level, -1 outside; innermost torch.func level, ``None`` outside)."""
    return forward_ad._current_level, torch._C._functorch.maybe_current_level()


class _StaleReads(TorchDispatchMode):
    """During a rerun: refuses the first op that reads a tensor modified in place since the
    forward, matched by identity or by storage (a view of it made before the forward). Pushed
    only when such a tensor exists, so a rerun without one runs with no per-op Python code."""

    def __init__(self, checks: Checks, frame: Any, stale: list[tuple[torch.Tensor, int]]) -> None:
        super().__init__()
        self.checks, self.frame = checks, frame
        self.by_id = {id(tensor): (tensor, version) for tensor, version in stale}
        self.by_storage = {ptr: (tensor, version) for tensor, version in stale
                           if (ptr := storage_ptr(tensor))}
        self.message: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.message is None:
            for arg in tree_flatten((args, kwargs))[0]:
                if isinstance(arg, torch.Tensor):
                    hit = self.by_id.get(id(arg)) or self.by_storage.get(storage_ptr(arg))
                    if hit is not None:
                        tensor, version = hit
                        self.message = (f"checkpoint {self.frame.region}: " + errors.read_modified(
                            self.checks.name_of(tensor), version, tensor._version))
                        raise CheckpointError(self.message)
        return func(*args, **(kwargs or {}))

