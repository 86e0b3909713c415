"""The op graph of one forward pass, and which op calls a recomputation can skip.

Design notes
============

Skipping what nothing needs. Replaying the softmax's output spares the
softmax, but not the ``q @ k^T``, scaling and masking that only fed it: a
rerun that runs every op it does not replay computes them and throws them away
(PyTorch's SAC does). So the forward mode also records which op call read and
created which *values* (a value: the contents of one block of memory between
two writes; views read their base's), and ``ckptlib.checkpoint`` tells it
which tensors autograd saved (the ``observe_saved_tensors`` protocol in
``ckptlib.checkpoint``). When forward ends, a sweep from the last call back to
the first marks what the rerun must produce: the saved values, and the inputs
of every call that runs. A call is skipped when none of its outputs is marked
and it has no effect beyond them.

Never skipped: random ops (the generator must advance as in forward; a
replayed one sets it), in-place ops, ops whose result is not a tensor
(``.item()``: a value leaves for Python), ops writing memory the function did
not create, and ops on tensor subclasses or unusual layouts.

Stand-ins. A skipped call hands back empty tensors of the forward's sizes and
strides on the *meta* device: they cost no memory, and the plan guarantees only
views and other skipped calls read them, so a wrong plan fails loudly (an op
that runs cannot mix meta and real tensors; the checkpoint refuses a recomputed
tensor on the wrong device) instead of computing from garbage. The plan is used
only while every cache entry it counted on is still there and unmodified;
otherwise the rerun runs every op it does not replay, as before. With
``torch.utils.checkpoint`` (``selective_contexts`` as its ``context_fn``) nobody
reports the saved tensors, so nothing is skipped.

The same graph, with each call's time, is what the cost model
(:mod:`ckptlib.selective.costs`) counts a choice of kept outputs on.
"""

from __future__ import annotations

from typing import Any, Collection, NamedTuple

import torch
from torch._ops import OpOverload

from ckptlib.selective.ops import (
    MUTATING,
    RANDOM,
    RANDOM_IN_PLACE,
    inputs_of,
    tensors_of,
    written_arguments,
)
from ckptlib.selective.signatures import fingerprint
from ckptlib.core.checks import storage_ptr


class Skip(NamedTuple):
    """A call the recomputation skips: what to hand back instead (empty tensors of the
    forward's sizes and strides, in the output's structure) and the input shapes to check."""

    template: Any
    input_shapes: tuple[torch.Size, ...]


class _Placeholder(NamedTuple):
    size: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype

    def make(self) -> torch.Tensor:
        # On the meta device: no memory, no time, and any use by an op that does run (which
        # the plan rules out) fails loudly instead of reading garbage.
        return torch.empty_strided(self.size, self.stride, dtype=self.dtype, device="meta")


def _template(output: Any) -> Any:
    """The output's structure with each tensor replaced by a :class:`_Placeholder`, or
    ``None`` where empty stand-ins would not do (non-tensor values, subclasses, odd layouts)."""
    if isinstance(output, torch.Tensor):
        if (
            type(output) is not torch.Tensor
            or output.layout is not torch.strided
            or output.storage_offset()
            or output.is_conj()
            or output.is_neg()
            or _extent_bytes(output) != output.untyped_storage().nbytes()
        ):
            return None  # the last: a view into a larger buffer, which a stand-in would not cover
        return _Placeholder(output.shape, output.stride(), output.dtype)
    if isinstance(output, (list, tuple)):
        items = [_template(item) for item in output]
        return None if any(item is None for item in items) else type(output)(items)
    return None


def _extent_bytes(tensor: torch.Tensor) -> int:
    """Bytes from the first to the last element of ``tensor`` (what ``empty_strided`` allocates)."""
    if tensor.numel() == 0:
        return 0
    return (
        1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    ) * tensor.element_size()


def from_template(template: Any) -> Any:
    if isinstance(template, _Placeholder):
        return template.make()
    return type(template)(from_template(item) for item in template)


class _OpCall(NamedTuple):
    key: tuple[OpOverload, int]  # (op, call position): how the rerun finds it
    inputs: frozenset[int]  # values it reads
    outputs: tuple[int, ...]  # values it creates (new memory, or a new version after a write)
    must_run: bool  # side effects, non-tensor results, or no stand-in possible
    random: bool  # draws random numbers: rerun unless replayed
    in_place: bool  # writes an argument (a replay copies into it: it must be real)
    skip: Skip | None
    seconds: float = 0.0  # (measure_op_costs only) time of the call
    reached: bool = True  # (measure_op_costs only) does a full rerun run it (early stop)?


class OpGraph:
    """Which op calls read and create which values, recorded during forward.

    A *value* is the contents of one block of memory between two writes: each new
    output storage is a value, and an in-place op creates a new value in the memory
    it writes. Views read and make no values: a view reads the memory of its base.
    Values are numbered; a memory address maps to its current value, so an address
    reused after a free is a new value.
    """

    def __init__(self) -> None:
        self.calls: list[_OpCall] = []
        self.current: dict[int, int] = {}  # storage address -> the value in it now
        self.saved_values: set[int] = set()  # values autograd saved (what a rerun must rebuild)
        self.saved_bytes_of: dict[int, int] = {}  # their storages' bytes, and the total
        self.saved_bytes = 0
        self.next_value = 0
        # (recording a reusable plan only) per saved tensor, in pack order: its value and
        # fingerprint
        self.packs: list[tuple[int | None, tuple]] | None = None
        self.input_storages: frozenset[int] = frozenset()
        self.first_node = 0

    def _new_value(self, pointer: int) -> int:
        value = self.next_value
        self.next_value += 1
        self.current[pointer] = value
        return value

    def note_saved(self, tensor: torch.Tensor) -> None:
        pointer = storage_ptr(tensor)
        value = self.current.get(pointer) if pointer is not None else None
        if value is not None:
            self.saved_values.add(value)
            if value not in self.saved_bytes_of:
                self.saved_bytes_of[value] = tensor.untyped_storage().nbytes()
                self.saved_bytes += self.saved_bytes_of[value]
        if self.packs is not None:
            self.packs.append((value, fingerprint(tensor, self.input_storages, self.first_node)))

    def record(
        self,
        func: OpOverload,
        position: int,
        kind: str,
        args: tuple,
        kwargs: dict,
        output: Any,
        seconds: float = 0.0,
        reached: bool = True,
    ) -> None:
        """Note one (non-view) op call. Runs for every op of the forward pass: kept lean."""
        current = self.current
        reads = inputs_of(args, kwargs)
        input_pointers = [storage_ptr(t) for t in reads]
        inputs = frozenset([current[p] for p in input_pointers if p in current])
        in_place = kind is MUTATING or kind is RANDOM_IN_PLACE
        if in_place:
            # Always rerun (in-place ops are cheap, and skipping one would need its aliasing
            # outputs rebuilt); it reads its inputs, and makes a new value where it writes.
            written = [
                args[i] if i < len(args) else kwargs.get(name)
                for i, name in written_arguments(func)
            ]
            pointers = [storage_ptr(t) for t in tensors_of(written)]
            outputs = tuple([self._new_value(p) for p in pointers if p is not None])
            must_run, skip = True, None
        elif type(output) is torch.Tensor:  # the common case, one plain tensor
            pointer = storage_ptr(output)
            if pointer in input_pointers:
                return  # returns (a view of) an input, like a view: always rerun, no new value
            template = _template(output)
            must_run = template is None
            outputs = (self._new_value(pointer),) if pointer is not None else ()
        else:
            output_pointers = [storage_ptr(t) for t in tensors_of(output)]
            if output_pointers and all(p in input_pointers for p in output_pointers):
                return  # returns (views of) its inputs, like a view: always rerun, no new values
            # No tensor out (a Python number: a value leaves for Python), or some outputs alias
            # inputs, or no stand-in possible: always rerun.
            template = _template(output) if output_pointers else None
            must_run = template is None or any(p in input_pointers for p in output_pointers)
            outputs = tuple([self._new_value(p) for p in output_pointers if p is not None])
        if not in_place:
            skip = None if must_run else Skip(template, tuple([t.shape for t in reads]))
        self.calls.append(
            _OpCall(
                (func, position),
                inputs,
                outputs,
                must_run,
                kind is RANDOM or kind is RANDOM_IN_PLACE,
                in_place,
                skip,
                seconds,
                reached,
            )
        )

    def unneeded_calls(
        self, cached: Collection[tuple[OpOverload, int]]
    ) -> dict[tuple[OpOverload, int], Skip]:
        """The calls a rerun can skip when the ``cached`` calls are replayed: those whose values
        neither autograd saved nor any call that does run reads (a backward sweep)."""
        return {call.key: call.skip for call in self._sweep(cached)[0] if call.skip is not None}

    def unused_replays(
        self, cached: Collection[tuple[OpOverload, int]]
    ) -> list[tuple[OpOverload, int]]:
        """The ``cached`` calls whose outputs the rerun never reads and autograd did not save:
        a rerun could skip them instead of replaying them, so keeping them buys nothing.
        (Random and in-place calls are not among them: their replay moves the generator or
        writes an argument.)"""
        return [call.key for call in self._sweep(cached)[1]]

    def _sweep(
        self, cached: Collection[tuple[OpOverload, int]]
    ) -> tuple[list[_OpCall], list[_OpCall]]:
        """A backward sweep: the calls the rerun can skip, and the cached calls it replays for
        nothing. A replayed call reads no inputs, so leaving one out of the cache to be skipped
        instead changes what nothing else needs."""
        needed = set(self.saved_values)
        skipped, unused = [], []
        for call in reversed(self.calls):
            if call.key in cached:
                if call.in_place:  # replayed by copying into its argument
                    needed |= call.inputs
                elif call.skip is not None and not call.random and needed.isdisjoint(call.outputs):
                    unused.append(call)
                continue  # replayed: its inputs are not read
            if call.must_run or call.random or not needed.isdisjoint(call.outputs):
                needed |= call.inputs
            else:
                skipped.append(call)
        return skipped, unused

    def rerun_seconds(self, cached: Collection[tuple[OpOverload, int]]) -> float:
        """(measure_op_costs graphs) Time of the calls a rerun runs: not replayed, not
        skipped, and before the early stop."""
        skipped = {call.key for call in self._sweep(cached)[0]}
        return sum(
            call.seconds
            for call in self.calls
            if call.reached and call.key not in cached and call.key not in skipped
        )
