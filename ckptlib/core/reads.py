"""What a checkpointed region reads from outside, and the checks on it before and during a rerun.

Design notes
============

Versions of what the region reads from outside. Autograd checks at every
unpack that a saved tensor was not modified in place since it was saved
(``tensor._version``). A rerun *reads* tensors instead of unpacking them, so it
checks them itself. Two kinds of tensors are certainly read, and checked before
the rerun starts:

* the region's inputs (their versions at the call);
* leaves saved by an op in forward, and views of leaves (``weight.t()``): the
  leaf's version at the pack.

The others are tensors the region *may* read: the parameters and buffers of the
modules reachable from ``fn`` (``fn`` itself, ``fn.__self__`` of a bound method,
a ``functools.partial``'s function and arguments, closure cells and default
arguments, one level into lists, tuples and dicts, functions found there followed
the same way), and tensors found the same way (a captured weight). Their versions
are noted at the call, and compared before the rerun. Most reruns find none
changed and run as they are. One that finds some changed (an optimizer step before
backward; a BatchNorm that a later segment, or the rest of a model the function
closes over, ran after this region) runs under a dispatch mode that refuses the
first op that reads one of them, matched by identity or by storage: a changed
tensor the region does not read (that other BatchNorm) is no reason to refuse,
and one it reads (the stepped weight) is, however deep inside a module or a
TorchScript function it is read. An op after the last tensor backward needs is
never run (early stop), so its reads are not checked either: they change nothing
backward uses.

A tensor that the region itself modifies during its forward (BatchNorm's
``num_batches_tracked``) is state it *writes*, not an input: it is not checked,
and what a rerun leaves behind is the next rerun's baseline. An optimizer step
between forward and backward bumps the weights' versions and the rerun refuses,
where plain autograd raises too (it saved the weights). The check is conservative:
it also refuses when the changed tensor is read but would not have changed what
the rerun saves (a bias whose layer's output nobody saves), where plain autograd is
silent and right; a rerun after an in-place update of its weights is suspect either way.

What the version check cannot see: tensors reached through a global variable,
through an attribute of an object that is not a module (``checkpoint(obj.method,
x)`` with a plain class), or deeper than one container level; a parameter
*replaced* rather than modified (``module.weight = nn.Parameter(...)``); writes
through ``.data`` (invisible to autograd too); values read without an aten op
(``tensor.numpy()``); and state that is no tensor (a
Python float, a global flag: the key check sees those only when they change
what is saved). The walk looks into functions, bound methods and partials only
(by their type: a user's object may answer every attribute, or raise from one),
and leaves out what raises while it looks. It costs time in proportion to what
it reaches: checkpoint a block (``checkpoint(block, x)``), not a lambda that
closes over the whole model.

Which saved tensors free memory. The same walk, this time also through the
global names a function's code reads (a notebook's ``lambda t: model(t)``), gives
the storages the region reads from outside (:meth:`OutsideReads.holds_storage`):
a saved tensor without grad that shares one of them (a buffer, a captured
constant) frees nothing when dropped, while one made inside (dropout's mask)
does. It is walked once per call, and only when a tensor without grad is saved;
the version check stays with the cheaper walk it runs at every call.

State written twice. The rerun is a second forward pass, so a region's in-place
updates of module state happen twice: BatchNorm in train mode moves its running
statistics twice per step (``torch.utils.checkpoint`` too). The tensors the
forward wrote are copied before each rerun; one the rerun leaves with another
value raises :class:`StateUpdatedTwiceWarning`, once per module. A rerun that
puts the state back (a ``context_fn`` that restores it, notebook 04) is not
warned about; BatchNorm in eval mode or without running statistics writes nothing.
"""
from __future__ import annotations

import functools
import types
import warnings
import weakref
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ckptlib.core.errors import CheckpointError, caller_stacklevel
from ckptlib.core.keys import TensorMeta
from ckptlib.core.region import function_name
from ckptlib.storage import storage_ptr

__all__ = ["OutsideReads", "StateUpdatedTwiceWarning"]


class StateUpdatedTwiceWarning(UserWarning):
    """A checkpoint's rerun updated module state (BatchNorm running statistics) its forward had
    updated."""


def _roots(fn: Callable[..., Any], through_globals: bool = False) -> list[tuple[str, Any]]:
    """(label, module or tensor) for everything reachable from ``fn`` (see the notes); with
    ``through_globals``, also through the global names a function's code reads.

    Only real functions, bound methods and ``functools.partial`` objects are looked into, by
    their type: a user's object may answer every attribute (a proxy) or raise from one, and
    one that raises while being looked at is left out rather than failing the checkpoint.
    """
    found: list[tuple[str, Any]] = []
    seen: set[int] = set()

    def visit(label: str, obj: Any, depth: int) -> None:
        if id(obj) in seen or depth > 4:
            return
        seen.add(id(obj))
        try:
            look_into(label, obj, depth)
        except Exception:
            pass

    def look_into(label: str, obj: Any, depth: int) -> None:
        if isinstance(obj, (nn.Module, torch.Tensor)):
            found.append((label, obj))
        elif isinstance(obj, functools.partial):
            visit(label, obj.func, depth + 1)
            for position, arg in enumerate(obj.args):
                visit(f"{label}.args[{position}]", arg, depth + 1)
            for name, arg in obj.keywords.items():
                visit(f"{label}.keywords[{name!r}]", arg, depth + 1)
        elif isinstance(obj, types.MethodType):                            # a bound method
            visit(type(obj.__self__).__name__, obj.__self__, depth + 1)
            visit(label, obj.__func__, depth + 1)
        elif isinstance(obj, types.FunctionType):                          # a Python function
            cells = zip(obj.__code__.co_freevars, obj.__closure__ or ())
            for name, cell in cells:
                try:
                    visit(name, cell.cell_contents, depth + 1)
                except ValueError:      # a cell not filled yet
                    pass
            defaults = obj.__defaults__ or ()
            names = obj.__code__.co_varnames[
                obj.__code__.co_argcount - len(defaults):obj.__code__.co_argcount]
            for name, default in zip(names, defaults):
                visit(name, default, depth + 1)
            for name, default in (obj.__kwdefaults__ or {}).items():
                visit(name, default, depth + 1)
            if through_globals:
                for name in obj.__code__.co_names:
                    if name in obj.__globals__:
                        visit(name, obj.__globals__[name], depth + 1)
        elif isinstance(obj, (list, tuple)) and depth > 0:
            for position, item in enumerate(obj):
                visit(f"{label}[{position}]", item, depth + 2)   # one level only
        elif isinstance(obj, dict) and depth > 0:
            for key, item in obj.items():
                visit(f"{label}[{key!r}]", item, depth + 2)

    visit(type(fn).__name__ if isinstance(fn, nn.Module) else function_name(fn), fn, 0)
    return found


def _add_tensors(obj: Any, found: list[torch.Tensor], modules_seen: set[int]) -> None:
    """Add a tensor, or a module's parameters and buffers (its submodules' too), to ``found``.

    (Reads the module's dicts itself: ``module.modules()`` costs more than the whole walk,
    and this runs at every checkpoint call. A TorchScript module keeps no such dicts: its
    tensors come from ``parameters()`` and ``buffers()``.)"""
    if isinstance(obj, torch.Tensor):
        found.append(obj)
        return
    if id(obj) in modules_seen:
        return
    modules_seen.add(id(obj))
    attributes = obj.__dict__
    parameters, buffers = attributes.get("_parameters"), attributes.get("_buffers")
    children = attributes.get("_modules")
    if parameters is None or buffers is None or children is None:
        try:
            found.extend(tensor for tensor in (*obj.parameters(), *obj.buffers())
                         if tensor is not None)
        except Exception:     # a module that cannot list its tensors: nothing of it is checked
            pass
        return
    for tensor in parameters.values():
        if tensor is not None:
            found.append(tensor)
    for tensor in buffers.values():
        if tensor is not None:
            found.append(tensor)
    for child in children.values():
        if child is not None:
            _add_tensors(child, found, modules_seen)


def input_modified_by_fn(inputs: list[tuple[weakref.ReferenceType, int]]) -> str | None:
    """After the forward: the message for the first input (weakly kept, with its version at the
    call) whose version moved, i.e. that the function itself changed in place; ``None`` if none
    did."""
    for position, (ref, version) in enumerate(inputs):
        tensor = ref()
        if tensor is not None and tensor._version != version:
            return (f"the checkpointed function itself modified its input tensor #{position} "
                    f"({TensorMeta.of(tensor)}) in place during the forward pass (version "
                    f"{version} -> {tensor._version}), so the values the forward started from are "
                    "gone and the recomputation cannot start from them (plain autograd runs this, "
                    "as it keeps every activation). Make the function leave its inputs alone: "
                    "u = u * 2 instead of u.mul_(2), or u = u.clone() as its first line.")
    return None


class OutsideReads:
    """The tensors a checkpointed region reads from outside, with their versions (see the notes):
    an observer of the core, made with the guards before the forward runs.

    :meth:`after_forward` sorts what the forward wrote from what it read; :meth:`before_rerun`
    refuses a rerun of what was modified in place since;  it also returns the
    watch over the rerun's reads of the rest, and :meth:`after_rerun` warns about state the rerun
    updated again.
    """

    def __init__(self, fn: Callable[..., Any], inputs: list[torch.Tensor]) -> None:
        self.fn = fn
        if isinstance(fn, nn.Module):
            self.roots = [(type(fn).__name__, fn)]
        elif type(fn) is types.BuiltinFunctionType:   # torch.sin: nothing to look into
            self.roots = []
        else:
            self.roots = _roots(fn)
        self.inputs = []   # (weakly, version at the call) of each input
        for tensor in inputs:
            self.inputs.append((weakref.ref(tensor), tensor._version))
        self.read: list[tuple[torch.Tensor, int]] = []   # read-only until after_forward
        if self.roots:
            reached: list[torch.Tensor] = []
            modules_seen: set[int] = set()
            for _, obj in self.roots:
                _add_tensors(obj, reached, modules_seen)
            self.read = [(t, t._version) for t in reached]
        self.written: list[torch.Tensor] = []
        # leaves (or bases of views) an op saved in forward, weakly, with their versions; the
        # guards add them at each pack
        self.saved_leaves: list[tuple[weakref.ReferenceType, int]] = []
        self.inputs_modified_by_fn: str | None = None   # after the forward: why it cannot rerun
        self._storages: set[int] | None = None   # made on first need by holds_storage
        # one rerun's: the written state's copies, the stale tensors' ids, the mode watching them
        self._before: list[torch.Tensor] | tuple = ()
        self._keep: set[int] | frozenset = frozenset()
        self._watch: _StaleReads | None = None

    def holds_storage(self, ptr: int) -> bool:
        """Does a tensor reached from ``fn`` (a parameter, a buffer, a captured tensor) own
        storage ``ptr``?

        Asked to tell whether dropping a saved tensor frees memory, so it also follows the global
        names ``fn``'s code reads (a notebook's ``lambda t: model(t)``), which the version check
        does not.
        """
        if self._storages is None:
            reached = [tensor for tensor, _ in self.read] + self.written
            if not isinstance(self.fn, nn.Module):
                modules_seen: set[int] = set()
                for _, obj in _roots(self.fn, through_globals=True):
                    _add_tensors(obj, reached, modules_seen)
            self._storages = {p for p in map(storage_ptr, reached) if p}
        return ptr in self._storages


    def after_forward(self, frame: Any, output: Any) -> None:
        """Tell what the forward wrote from what it read; note an input it changed itself."""
        for ref, version in self.inputs:
            tensor = ref()
            if tensor is not None and tensor._version != version:
                self.inputs_modified_by_fn = input_modified_by_fn(self.inputs)
                break
        read = []
        for tensor, version in self.read:
            if tensor._version == version:
                read.append((tensor, version))
            else:
                self.written.append(tensor)
        self.read = read

    def before_rerun(self, frame: Any) -> Any:
        """Refuse a rerun whose function changed its own input, or that certainly reads something
        modified in place since the forward (or the last rerun): an input, or a leaf an op saved.
        The other tensors ``fn`` reaches are watched during the rerun: the returned context (or
        ``None``) refuses the first op that reads one changed since; :meth:`after_rerun` ends it.
        (``frame``: anything with a ``region``, read only for messages.)"""
        message = self.inputs_modified_by_fn
        for position, (ref, version) in enumerate(self.inputs):
            tensor = ref()
            if message is None and tensor is not None and tensor._version != version:
                message = (f"input tensor #{position} ({TensorMeta.of(tensor)}) was modified in "
                           f"place after the checkpointed forward (version {version} -> "
                           f"{tensor._version}); recomputing from it would give wrong activations. "
                           "Clone the input before modifying it, or modify a copy.")
        for ref, version in self.saved_leaves:
            leaf = ref()
            if message is None and leaf is not None and leaf._version != version:
                message = self.modified_message(leaf, version)
        if message is not None:
            raise CheckpointError(f"checkpoint {frame.region}: {message}")
        # Then the watch over this rerun: copies of the state the forward wrote, and the mode that
        # refuses a read of a tensor changed since (None when none changed: nothing to enter).
        written = self.written
        self._before = [t.clone() for t in written] if written else ()
        stale = None
        for tensor, version in self.read:
            if tensor._version != version:
                stale = stale or []
                stale.append((tensor, version))
        self._keep = {id(tensor) for tensor, _ in stale} if stale else frozenset()
        self._watch = _StaleReads(self, frame, stale) if stale else None
        return self._watch

    def modified_message(self, tensor: torch.Tensor, version: int) -> str:
        return (f"{self.name_of(tensor)} was modified in place between the forward pass and this "
                f"recomputation (version {version} -> {tensor._version}), and the recomputation "
                "reads it. The rerun would compute with the new values, not the ones the forward "
                "used, and give wrong gradients (plain autograd raises here too when it saved the "
                "tensor). Usual cause: an optimizer step, or another in-place update, before "
                "backward: call backward first, then step; or clone the tensor before changing it.")

    def name_of(self, tensor: torch.Tensor) -> str:
        """``parameter `Block.fc1.weight` (8x8 float32 ...)`` where a root leads to it, else its
        metadata."""
        meta = TensorMeta.of(tensor)
        for label, obj in self.roots:
            if obj is tensor:
                return f"captured tensor `{label}` ({meta})"
            if isinstance(obj, nn.Module):
                for kind, named in (("parameter", obj.named_parameters),
                                    ("buffer", obj.named_buffers)):
                    try:
                        for name, candidate in named(remove_duplicate=False):
                            if candidate is tensor:
                                return f"{kind} `{label}.{name}` ({meta})"
                    except Exception:   # the module cannot name its tensors: described by metadata
                        pass
        kind = "a parameter" if tensor.requires_grad else "a constant"
        return (f"a tensor the region reads ({meta}, a leaf that "
                f"{'requires' if tensor.requires_grad else 'does not require'} grad: {kind})")

    def after_rerun(self, frame: Any, error: BaseException | None) -> None:
        """After a rerun (``error``: what it raised, if anything): the next rerun's baseline; the
        refusal of a stale read as itself; a warning for state the rerun wrote again."""
        # what the rerun wrote is the next rerun's starting point; tensors changed since the
        # forward (``_keep``: the next rerun must still not read them) keep the forward's version
        keep = self._keep
        if keep:
            self.read = [(tensor, version if id(tensor) in keep else tensor._version)
                         for tensor, version in self.read]
        elif self.read:
            self.read = [(tensor, tensor._version) for tensor, _ in self.read]
        leaves = self.saved_leaves
        for position, (ref, version) in enumerate(leaves):
            leaf = ref()
            if leaf is not None and leaf._version != version:
                leaves[position] = (ref, leaf._version)
        watch, self._watch = self._watch, None   # let go of the frame and the copies
        before, self._before = self._before, ()
        if watch is not None and watch.message is not None:
            # Raised from inside an op (a TorchScript interpreter wraps it): raise it as itself.
            if not (isinstance(error, RuntimeError) and str(error) == watch.message):
                raise CheckpointError(watch.message) from error
            return
        for tensor, copy in zip(self.written, before):
            if torch.equal(tensor, copy):
                continue
            owner, description = self.owner_of(tensor)
            if owner in _warned:
                continue
            _warned.add(owner)
            warnings.warn(
                f"checkpoint {frame.region}: the recomputation updated {description} again "
                "after the forward pass had updated it: a checkpointed region runs twice, so its "
                "in-place state updates happen twice (BatchNorm's running statistics move twice "
                "per step; torch.utils.checkpoint does the same). Fixes: checkpoint the layers "
                "around the module instead of it, put it in eval mode, or put its state back "
                "during the recomputation (a context_fn that restores the buffers, or a forward "
                "pre-hook that sets momentum to 0 while ckptlib.is_recomputing(), as in "
                "notebook 04). Warned once per module.",
                StateUpdatedTwiceWarning, stacklevel=caller_stacklevel())

    def owner_of(self, tensor: torch.Tensor) -> tuple[Any, str]:
        """(module or tensor, description) of the thing that owns written state ``tensor``."""
        for label, obj in self.roots:
            if obj is tensor:
                return tensor, f"captured tensor `{label}`"
            if isinstance(obj, nn.Module):
                try:
                    for path, module in obj.named_modules(remove_duplicate=False):
                        for name, buffer in module._buffers.items():
                            if buffer is tensor:
                                where = f"{label}.{path}" if path else label
                                return module, f"{type(module).__name__} `{where}` (buffer {name})"
                except Exception:   # the module cannot list its submodules: described by metadata
                    pass
        return tensor, f"a tensor ({TensorMeta.of(tensor)})"


_warned: "weakref.WeakSet[Any]" = weakref.WeakSet()


class _StaleReads(TorchDispatchMode):
    """During a rerun: refuses the first op that reads a tensor modified in place since the forward.

    Pushed only when such a tensor exists (an optimizer step before backward, a BatchNorm that
    ran after this region), so a rerun without one runs with no per-op Python code. A tensor is
    matched by identity or by its storage (a view of it made before the forward)."""

    def __init__(self, reads: OutsideReads, frame: Any,
                 stale: list[tuple[torch.Tensor, int]]) -> None:
        super().__init__()
        self.reads, self.frame = reads, frame
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
                        self.message = (f"checkpoint {self.frame.region}: "
                                        f"{self.reads.modified_message(*hit)}")
                        raise CheckpointError(self.message)
        return func(*args, **(kwargs or {}))

