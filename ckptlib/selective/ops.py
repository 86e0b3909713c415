"""What kind of aten op a call is, and which tensors it reads and writes: what the modes ask of
every op.

Both dispatch modes, the op graph and the cost model see each op *below*
autograd (``torch.mm``, ``F.linear`` and ``x @ w`` all arrive as ``aten.mm`` or
``aten.addmm``) and must decide, from the op's schema alone (the same in forward
and rerun), what kind it is:

* a *view* (``view``, ``t``, ``expand``, ``detach``): costs nothing, never
  cached or counted; in the rerun it must alias the *recomputed* tensor;
* *mutating* (``relu_``, ``div_``): writes an argument in place;
* *plain*: makes new tensors from its inputs;
* *random* (``randn``, ``native_dropout``), or random *in place*
  (dropout's ``bernoulli_``, which fills a fresh tensor): draws from a generator,
  so replaying it must also move the generator as the op would have.

Autocast. Under autocast, the first use of a parameter in an autocast region
casts it (``aten._to_copy``) and later uses reuse the cast, so forward and
rerun need not issue the same casts: the forward may have cast a weight for an
earlier block, the rerun (a region of its own) casts it again. Casts of leaf
tensors that require grad (what autocast caches) are therefore invisible to the
modes (:func:`is_parameter_cast`): not counted, never cached or skipped, always run.

The helpers below run for every op of every forward pass: they are kept lean
(plain loops instead of ``torch.utils._pytree``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch._ops import OpOverload

from ckptlib.core.checks import storage_ptrs

aten = torch.ops.aten

VIEW, MUTATING, PLAIN, RANDOM, RANDOM_IN_PLACE = (
    "view",
    "mutating",
    "plain",
    "random",
    "random in place",
)
CACHEABLE_KINDS = (PLAIN, RANDOM, RANDOM_IN_PLACE)


@functools.lru_cache(maxsize=None)  # a pure function of an immutable op: memoised for speed
def op_kind(func: OpOverload) -> str:
    if func.is_view:
        return VIEW
    random = torch.Tag.nondeterministic_seeded in func.tags
    if func._schema.is_mutable:
        return RANDOM_IN_PLACE if random and _modifies_only_self(func) else MUTATING
    return RANDOM if random else PLAIN


def _modifies_only_self(func: OpOverload) -> bool:
    """``bernoulli_(self, ...) -> self``: one written argument, the first, returned."""
    arguments = func._schema.arguments
    written = [a for a in arguments if a.alias_info is not None and a.alias_info.is_write]
    return written == [arguments[0]] and len(func._schema.returns) == 1


def tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors in an op's arguments or outputs (tensors, nested in lists and tuples).
    Much faster than ``torch.utils._pytree``, and this runs for every op."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        found = []
        for item in value:
            if isinstance(item, torch.Tensor):
                found.append(item)
            elif isinstance(item, (list, tuple)):
                found.extend(tensors_of(item))
        return found
    return []


# The old name: ckptlib.widgets.policies still imports it from here.
_tensors = tensors_of


def inputs_of(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an op call reads, positional then keyword."""
    return tensors_of((args, tuple(kwargs.values()))) if kwargs else tensors_of(args)


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(map_tensors(fn, item) for item in value)
    return value


def storages_of(value: Any) -> set[int]:
    """The storage pointers of the tensors in ``value`` (those without memory left out)."""
    return storage_ptrs(tensors_of(value))


def shapes_of(args: tuple) -> tuple[torch.Size, ...]:
    return tuple([t.shape for t in tensors_of(args)])


def versions_of(value: Any) -> tuple[int, ...]:
    return tuple(t._version for t in tensors_of(value))


@functools.lru_cache(maxsize=None)
def written_arguments(func: OpOverload) -> tuple[tuple[int, str], ...]:
    """(position, name) of the arguments ``func`` writes to (``self`` of ``relu_``, ``out=``)."""
    return tuple(
        (i, a.name)
        for i, a in enumerate(func._schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    )


def is_parameter_cast(func: OpOverload, args: tuple) -> bool:
    """A cast of a leaf that requires grad (a parameter): what autocast caches per region, so
    forward and rerun need not both issue it. Such calls are left out of the positions."""
    return func is _TO_COPY and args[0].requires_grad and args[0].is_leaf


_TO_COPY = aten._to_copy.default
