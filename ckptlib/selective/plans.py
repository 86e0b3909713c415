"""Reusing plans: after a function's first call per input signature, forward runs with no
dispatch mode.

Design notes
============

Reusing plans. The forward mode runs Python for every op of every forward pass,
about 25 us per op on a CPU: on a Transformer block, as much as the rest of a
selective policy's overhead. A training loop calls each block with inputs of the
same shapes every step, so ``SelectivePlans`` records, in the first call of a
function per input signature, a plan: the counted ops in order, a fingerprint of
every tensor autograd saves (shape, dtype, device, and the autograd node that
made it with that node's place among the call's nodes), which saved tensors hold
the cached outputs (a cached output a sensible policy keeps is one autograd
saves anyway), and the skips planned for exactly those. A later call runs
forward with *no* dispatch mode (:class:`_PlannedForward`): ``ckptlib.checkpoint``
reports each saved tensor, the call compares its fingerprint and keeps the ones
the plan names, as views of the same memory. Its rerun is an ordinary
:class:`ReplaySavedOps` that also checks each op against the plan's sequence.
Every check errs towards more work, never a wrong value: a fingerprint that
differs makes the call rerun every op (plain, as full checkpointing) and stops
plans for that signature; an op the plan does not have, or a skipped result that
an op needs after all, makes the checkpoint run the function again from the
start (``RecomputeAgain``) without the cache or without skipping.

What a plan is keyed on. Plans live per function, and die with it (a weak
reference). A bound method (``block.forward``) is a new object at every
attribute access, so it is keyed on its function and the instance it is bound
to: the plans follow the instance. Within a function, plans are per signature
(:mod:`ckptlib.selective.signatures`). Where no plan can be kept (a builtin
cannot be weakly referenced; an unhashable argument gives no signature) the call
runs as without ``plans``, and a warning says so once.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
import weakref
from collections import Counter
from typing import Any, Callable, Mapping, NamedTuple

import torch
from torch._ops import OpOverload

from ckptlib._arguments import qualname
from ckptlib.core.checkpoint import Observer, is_recomputing
from ckptlib.core.checks import storage_ptrs as input_ptrs
from ckptlib.selective.cache import OpCache, Saved
from ckptlib.selective.modes import ReplaySavedOps, selective_contexts
from ckptlib.selective.opgraph import OpGraph, Skip
from ckptlib.selective.ops import inputs_of
from ckptlib.selective.policy import Policy
from ckptlib.selective.signatures import call_signature, fingerprint, next_node_number, underlying


class _Plan(NamedTuple):
    """What a recording call learned, for later calls with the same signature.

    Every cached output a plan keeps is rebuilt from a tensor autograd saves anyway (the
    softmax's output is saved by the softmax, a clone by the ``bmm`` that reads it), so a
    later call needs no dispatch mode in forward: the checkpoint reports each saved tensor,
    and the ones the plan names become the cache. Outputs that no saved tensor holds are
    not kept by a reused plan (the rerun recomputes them; the skips are planned for that).
    """

    packs: tuple[tuple, ...]  # fingerprint of each saved tensor, in pack order
    rebuild: Mapping[
        int, tuple[tuple[tuple[OpOverload, int], int, torch.Size, tuple[int, ...], int], ...]
    ]
    # saved tensor index -> (entry key, output slot, size, stride, storage offset) it holds
    entries: Mapping[tuple[OpOverload, int], tuple[type | None, int, tuple[torch.Size, ...]]]
    # entry key -> (tuple/list type, or None for one tensor; number of tensors; input shapes)
    skippable: Mapping[tuple[OpOverload, int], Skip]
    calls: Mapping[OpOverload, int]
    sequence: tuple[OpOverload, ...]  # the counted ops, in order: what the rerun must run

    @classmethod
    def learn(cls, cache: OpCache, graph: OpGraph, sequence: tuple[OpOverload, ...]) -> "_Plan":
        first_pack: dict[int, int] = {}
        for index, (value, _) in enumerate(graph.packs):
            if value is not None:
                first_pack.setdefault(value, index)
        outputs = {call.key: call.outputs for call in graph.calls}
        rebuild: dict[int, list] = {}
        entries = {}
        for func, by_position in cache.saved.items():
            for position, saved in by_position.items():
                key, value = (func, position), saved.value
                if saved.in_place or saved.generator is not None:
                    continue  # random: its replay sets the generator, which needs the forward mode
                if type(value) is torch.Tensor:
                    container, tensors = None, [value]
                elif (
                    isinstance(value, (tuple, list))
                    and value
                    and all(type(t) is torch.Tensor for t in value)
                ):
                    container, tensors = type(value), list(value)
                else:
                    continue
                values = outputs.get(key)
                if values is None or len(values) != len(tensors):
                    continue
                picks = [first_pack.get(v) for v in values]
                if None in picks or any(
                    graph.packs[i][1][1] != t.dtype for i, t in zip(picks, tensors)
                ):
                    continue
                entries[key] = (container, len(tensors), saved.input_shapes)
                for slot, (index, tensor) in enumerate(zip(picks, tensors)):
                    rebuild.setdefault(index, []).append(
                        (key, slot, tensor.shape, tensor.stride(), tensor.storage_offset())
                    )
        return cls(
            tuple(key for _, key in graph.packs),
            {index: tuple(items) for index, items in rebuild.items()},
            entries,
            graph.unneeded_calls(set(entries)),
            dict(cache.calls),
            sequence,
        )


class _PlannedForward(Observer):
    """Forward context of a call that reuses a plan: no dispatch mode. Each tensor autograd
    saves (reported by ``ckptlib.checkpoint``) is checked against the plan's fingerprint, and
    those holding cached outputs fill the cache. If the saved tensors differ from the plan's
    in any way, the call forgets the plan and reruns every op, like full checkpointing."""

    def __init__(self, plan: _Plan, cache: OpCache, on_fallback: Callable[[], None]) -> None:
        self.plan, self.cache, self.on_fallback = plan, cache, on_fallback
        self.count = 0
        self.matches = True
        self.parts: dict[tuple[OpOverload, int], list] = {}
        self.first_node = 0

    def on_pack(self, frame: Any, holder: Any, tensor: torch.Tensor) -> None:
        index = self.count
        self.count = index + 1
        if not self.matches:
            return
        packs = self.plan.packs
        if (
            index >= len(packs)
            or fingerprint(tensor, self.cache.input_storages, self.first_node) != packs[index]
        ):
            self.matches = False
            self.parts.clear()
            return
        for key, slot, size, stride, offset in self.plan.rebuild.get(index, ()):
            view = tensor.detach()  # shares the version counter: a later in-place change shows
            if view.shape != size or view.stride() != stride or view.storage_offset() != offset:
                view = view.as_strided(size, stride, offset)
            slots = self.parts.get(key)
            if slots is None:
                slots = self.parts[key] = [None] * self.plan.entries[key][1]
            slots[slot] = (view, view._version)

    def __enter__(self) -> "_PlannedForward":
        self.first_node = next_node_number()
        return self

    def __exit__(self, exc_type: Any, *exc_info: Any) -> bool:
        if exc_type is not None:
            return False
        cache, plan = self.cache, self.plan
        if not self.matches or self.count != len(plan.packs):
            self.parts.clear()
            cache.passthrough = True
            self.on_fallback()
            return False
        complete = len(self.parts) == len(plan.entries)
        for key, slots in self.parts.items():
            if any(slot is None or slot[0]._version != slot[1] for slot in slots):
                complete = False  # modified in place after it was saved: not the op's output
                continue
            container, _, input_shapes = plan.entries[key]
            tensors = [t for t, _ in slots]
            value = tensors[0] if container is None else container(tensors)
            cache.saved.setdefault(key[0], {})[key[1]] = Saved(
                value, tuple(version for _, version in slots), input_shapes, False
            )
        self.parts.clear()
        cache.calls = Counter(plan.calls)
        cache.sequence = plan.sequence
        # Skips were planned with every entry present; without one, its op reruns, from
        # inputs the plan would have skipped: then skip nothing (replays stay correct).
        cache.skippable = plan.skippable if complete else None
        return False


_NO_PLAN = "no plan"  # SelectivePlans' mark for a signature given up on (a fallback or a mismatch)


class SelectivePlans:
    """Plans of :func:`selective_checkpoint`, learned once per function and input signature and
    reused by later calls (``selective_checkpoint(..., plans=plans)``).

    The first call with a given signature runs as usual: the forward dispatch mode caches the
    chosen outputs and records the op graph, from which the end of forward plans the rerun's
    skips. It also records a *plan*: the ops in order, a fingerprint of every tensor autograd
    saves (shape, dtype, device, the node that made it and its place), and which saved tensors hold
    the cached outputs. A later call with the same signature (see below) runs forward with no
    dispatch mode at all, so its forward costs what full checkpointing's does: the checkpoint
    reports each saved tensor, the call checks it against the plan's fingerprint and keeps the
    ones that hold cached outputs. Its rerun replays and skips as the plan says, and checks that
    it runs the plan's ops in the plan's order.

    The contract: for inputs of the same signature, the function runs the same ops on the same
    arguments every call (true of a Transformer block in training; not of a function that
    branches on a counter or on the data). What is checked:

    * the signature: the policy, each input tensor's type, shape, strides, dtype, device and
      ``requires_grad``, the other arguments (hashable ones; otherwise no reuse), the train/eval
      flags of a module's submodules, autocast, deterministic algorithms, and the caller's
      dispatch modes and global module hooks (``FlopCounterMode``, a memory meter: they change
      which autograd nodes a call makes, so a call under one gets its own plan);
    * in forward, each saved tensor's fingerprint. A difference (another branch taken) makes
      the call rerun every op, like full checkpointing, and gives up on plans for that
      signature: later calls run as without ``plans`` (``fallbacks`` counts these);
    * in the rerun, the sequence of ops, and the input shapes of each replayed or skipped
      call. A different op makes the checkpoint run the function again as full checkpointing
      would (the cached outputs may belong to other calls), and gives up on plans for that
      signature (``mismatches`` counts these, and reruns that needed a skipped result).

    The fingerprint includes each saved tensor's producing node's place in the call, so a
    cached output cannot be rebuilt from a tensor another op made. What no check sees is a
    call whose unsaved intermediate results flow differently with the same ops and the same
    saved tensors; the rerun then fails loudly or runs again (see :class:`ReplaySavedOps`).

    Outputs that autograd does not save (the policy chose an op whose output only feeds
    unsaved ops) are not kept by a reused call; the plan's skips are made for that. Inside the
    rerun of an enclosing checkpoint (``is_recomputing()``) plans are neither recorded nor
    reused: there the inputs may be stand-ins for results that rerun skips. Cached
    random ops are rerun rather than replayed (the checkpoint's RNG replay makes them draw the
    same numbers). Plans hold no tensors, only shapes and ops, and a function that is garbage
    collected takes its plans with it (a bound method such as ``block.forward``: its instance).

    >>> from ckptlib.selective import save_matmuls, selective_checkpoint
    >>> plans = SelectivePlans()
    >>> x = torch.randn(4, 8, requires_grad=True)
    >>> w = torch.randn(8, 8, requires_grad=True)
    >>> def block(inp):
    ...     return (inp @ w).tanh() @ w
    >>> for step in range(3):
    ...     selective_checkpoint(block, x, policy=save_matmuls, plans=plans).sum().backward()
    >>> plans
    SelectivePlans(1 plan: 1 recorded, 2 reused, 0 fallbacks, 0 mismatches)
    """

    def __init__(self) -> None:
        self._tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.recorded = 0  # calls that recorded a plan
        self.reused = 0  # calls that ran forward with a recorded plan (fallbacks included)
        self.fallbacks = 0  # of those, calls whose saved tensors differed from the plan's
        self.mismatches = 0  # reruns that ran other ops than the plan's, or needed a skipped result
        self._warned: set[str] = set()  # why some calls could not use plans, said once each
        self._forgotten = 0  # plans dropped by clear(), still counted in recorded

    def __reduce__(self) -> tuple:
        # A copy (a copied or pickled model checkpointed with plans=) starts empty: plans are kept
        # per function, and the copy's functions are its own.
        return (SelectivePlans, ())

    def __len__(self) -> int:
        """The number of plans held (signatures given up on are not counted)."""
        return sum(
            plan is not _NO_PLAN for table in self._tables.values() for plan in table.values()
        )

    def clear(self) -> None:
        """Forget every plan (the counters stay)."""
        self._forgotten += sum(len(plans) for plans in self._tables.values())
        self._tables.clear()

    def __repr__(self) -> str:
        count = len(self)
        return (
            f"SelectivePlans({count} plan{'s' if count != 1 else ''}: {self.recorded} recorded, "
            f"{self.reused} reused, {self.fallbacks} fallbacks, {self.mismatches} mismatches)"
        )

    def contexts(
        self,
        fn: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        policy: Policy,
        *,
        replay_random: bool = True,
        early_stop: bool = True,
    ) -> tuple[Any, ReplaySavedOps]:
        """The ``(forward_context, recompute_context)`` for one call of ``fn``: a recorded
        plan's (no forward mode) if one fits, else :func:`selective_contexts` recording one."""
        # Inside the rerun of an enclosing checkpoint the inputs may be stand-ins for skipped
        # results: neither record nor reuse plans there.
        if is_recomputing():
            return selective_contexts(policy, replay_random=replay_random)
        signature = call_signature(fn, args, kwargs, policy, replay_random, early_stop)
        table = None
        if signature is None:
            self._warn_once(
                "signature",
                f"SelectivePlans: a call of {qualname(fn)} has an argument (or a "
                "policy) that is not hashable, so it has no signature to find its plan by; such "
                "calls run as without plans. Pass tensors, numbers, strings, tuples or None.",
            )
        else:
            table, function = self._table(fn)
            key = (function, signature)
        plan = table.get(key) if table is not None else None
        if plan is _NO_PLAN:
            return selective_contexts(policy, replay_random=replay_random)
        inputs = frozenset(input_ptrs(inputs_of(args, kwargs)))
        if plan is None:
            forward, recompute = selective_contexts(policy, replay_random=replay_random)
            if table is not None:
                forward.cache.plan_sink = functools.partial(self._learned, table, key, qualname(fn))
                forward.cache.input_storages = inputs
            return forward, recompute
        self.reused += 1
        cache = OpCache(replay_random)
        cache.input_storages = inputs
        cache.on_mismatch = functools.partial(self._mismatched, table, key)
        return _PlannedForward(
            plan, cache, functools.partial(self._fell_back, table, key)
        ), ReplaySavedOps(cache)

    def _table(self, fn: Callable[..., Any]) -> tuple[dict | None, Any]:
        """The plans of ``fn`` (an empty table at first) and the key of its function in them, or
        ``(None, None)`` where ``fn`` cannot be weakly referenced. A bound method or a
        ``functools.partial`` is a new object at every call: its plans follow the instance it
        runs on, keyed by the function (see :func:`~ckptlib.selective.signatures._underlying`)."""
        owner, function, _, _ = underlying(fn)
        try:
            return self._tables.setdefault(owner, {}), function
        except TypeError:  # no weak reference (a builtin), or not hashable
            self._warn_once(
                "weakref",
                f"SelectivePlans cannot keep plans for {qualname(fn)}: plans follow "
                "their function through a weak reference, and it has none (a builtin) or is not "
                "hashable, so every call runs as without plans. Pass a Python function or a "
                "module instead, e.g. `def f(t): return torch.sin(t)` defined once.",
            )
            return None, None

    def _warn_once(self, reason: str, message: str) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(message, stacklevel=_first_frame_outside_ckptlib())

    def _learned(
        self,
        table: dict,
        key: tuple,
        name: str,
        cache: OpCache,
        graph: OpGraph,
        sequence: tuple[OpOverload, ...],
    ) -> None:
        table[key] = _Plan.learn(cache, graph, sequence)
        self.recorded += 1
        # Every recorded plan stays in a table while its function lives: fewer held than recorded,
        # and none ever reused, means the functions die after one call.
        held = sum(len(plans) for plans in self._tables.values()) + self._forgotten
        if self.reused == 0 and self.recorded >= 2 and held < self.recorded:
            self._warn_once(
                "lost",
                f"SelectivePlans: {self.recorded} calls recorded a plan and none reused "
                f"one: each plan died with its function ({name}), a new object at every call "
                "(a lambda or a functools.partial made per call), so every call pays for "
                "recording. Define the function once and pass that same function (or the "
                "module, or its bound method) at every call.",
            )

    def _fell_back(self, table: dict, key: tuple) -> None:
        table[key] = _NO_PLAN  # this signature's saved tensors vary: stop trying to reuse
        self.fallbacks += 1

    def _mismatched(self, table: dict, key: tuple) -> None:
        table[key] = _NO_PLAN
        self.mismatches += 1


def _first_frame_outside_ckptlib() -> int:
    """The ``stacklevel`` that points a warning at the caller's line (the first frame whose code
    is not in ckptlib), however deep in the checkpoint the warning is raised."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(root + os.sep):
        frame, level = frame.f_back, level + 1
    return level
