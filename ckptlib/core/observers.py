"""The observers of a checkpoint: the named points the core calls, and how a frame binds them.

An observer is any object with some of these methods; the frame (``checkpoint.py``) calls each
at its point, in the order the observers were added, and an observer never changes what is
computed (it may refuse, by raising). Every point receives the frame first. The guards and their
reads have these methods too and are always there: the frame calls them by name, before the
others, so a frame without other observers (the common case) binds nothing.

=================  ======================================================  ====================
point              when, and what else it receives                          who has it
=================  ======================================================  ====================
``around_forward`` entered around the forward (no frame): returns a context  the trace
``on_pack``        each tensor autograd saves: ``holder, tensor, ptr``     guards, trace,
                   (``ptr``: its storage)                                   selective's callback
``after_forward``  the forward returned: ``output``                        reads, trace
``before_rerun``   first unpack of a backward, before each run of the      reads
                   rerun: may refuse, and returns a context to run it
                   under (or None)
``on_recompute``   the rerun starts: ``trigger`` (the holder that asked),  trace
                   ``needed`` (holders alive), ``again`` (a second run)
``on_fill``        each tensor the rerun saves: ``task, index, tensor,     guards
                   detached, holder, ptr``
``on_early_stop``  the rerun stops at ``index``                            trace
``after_rerun``    the rerun ended: ``error`` (what it raised, or None)    reads
``on_unpack``      backward takes a tensor: ``task, holder, tensor``       trace
``on_release``     a backward's unused tensors dropped: ``task, released``  trace
=================  ======================================================  ====================

(guards: :class:`~ckptlib.core.guards.Guards`; reads: its
:class:`~ckptlib.core.reads.OutsideReads`; trace: :class:`~ckptlib.core.trace.Tracer`.)

Which observer has which method is looked up once per combination of observer classes
(:func:`plan`), so a frame binds only the methods that exist and a point with none costs one
loop over an empty tuple.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager

import torch

__all__ = ["POINTS", "plan", "PLANS", "one_context", "AllOf", "SavedTensorsCallback"]

POINTS = ("on_pack", "after_forward", "before_rerun", "on_recompute", "on_fill", "on_early_stop",
          "after_rerun", "on_unpack", "on_release", "around_forward")
# observer classes -> (point, positions of the observers that have a method for it)
PLANS: dict[tuple[type, ...], tuple[tuple[str, tuple[int, ...]], ...]] = {}


def plan(kinds: tuple[type, ...]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(point, positions of the observers that have a method for it), for observers of these
    classes: looked up once per combination of classes (the frame reads ``PLANS`` first)."""
    found = PLANS.get(kinds)
    if found is None:
        found = PLANS[kinds] = tuple(
            (point, positions) for point in POINTS
            if (positions := tuple(i for i, kind in enumerate(kinds)
                                   if callable(getattr(kind, point, None)))))
    return found


class SavedTensorsCallback:
    """Selective checkpointing's ``observe_saved_tensors()`` callback, as an observer."""

    def __init__(self, callback: Callable[[torch.Tensor], None]) -> None:
        self.callback = callback

    def on_pack(self, frame: Any, holder: Any, tensor: torch.Tensor, ptr: int | None) -> None:
        self.callback(tensor)


class AllOf:
    """Several contexts as one: entered in order at ``__enter__``, exited in reverse (each sees the
    exception, as in one ``with a, b:``). The frame uses it only where there are two or more."""

    __slots__ = ("contexts", "stack")

    def __init__(self, contexts: list[ContextManager]) -> None:
        self.contexts = contexts

    def __enter__(self) -> None:
        with contextlib.ExitStack() as stack:
            for context in self.contexts:
                stack.enter_context(context)
            self.stack = stack.pop_all()

    def __exit__(self, *exc_info: Any) -> bool:
        return self.stack.__exit__(*exc_info)


def one_context(contexts: list[ContextManager]) -> ContextManager:
    """One or more ``contexts`` as one context to enter: the context itself for one, :class:`AllOf`
    for more. (The frame enters nothing at all where there are none.)"""
    return contexts[0] if len(contexts) == 1 else AllOf(contexts)
