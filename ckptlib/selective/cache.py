"""The cache of one selective checkpoint call: op outputs kept from forward, handed back in the
rerun.

Design notes
============

Keys. Outputs are kept per op overload and call position: the 3rd
``aten.mm`` of the rerun is handed the output of the 3rd ``aten.mm`` of the
forward (if the policy chose that call). Keying on the op as well as the
position means that an op which the checkpoint machinery itself adds in only
one of the two runs (``aten.detach``) cannot shift the others. A replayed
entry also checks that its inputs have the shapes the forward saw, so a rerun
that took another path raises ``CheckpointError`` instead of handing out the
wrong tensor. ``ckptlib.checkpoint`` calls ``context_fn`` once per call, as
``torch.utils.checkpoint`` does, so each call gets its own cache, shared by its
two modes (the recomputation mode is entered again for every rerun).

What is never cached, whatever the policy says:

* views (``view``, ``t``, ``expand``, ``detach`` ...) and ops whose output
  shares an input's storage (``_unsafe_view``): they cost nothing to redo, and
  in the rerun they must alias the *recomputed* tensor, not the forward's;
* ops that modify a tensor in place (``relu_``, ``div_``), unless random (below):
  replaying one means copying its result into the tensor, as costly as the op,
  and skipping it would leave the tensor unmodified.

Random ops (``bernoulli_`` in dropout, ``randn``, ``native_dropout``). The
checkpoint replays the RNG state, so a random op *rerun* draws the same numbers
as in forward. A random op *replayed* from the cache draws nothing, which would
shift the generator for every later random op of the rerun. So a cached random
op also stores the generator's state right after it, and the replay sets the
generator to that state: every later draw is as in forward. An in-place random
op (dropout's ``bernoulli_`` fills a fresh tensor, then ``div_`` scales it in
place) caches a private copy of the filled tensor and replays by copying it
back. Random ops are rerun instead when there is no RNG replay to rely on
(``preserve_rng_state=False``), when the op uses an explicit ``generator=`` or
a device whose generator we do not handle (other than CPU and CUDA).

Modified after saving. Each cached tensor remembers its version counter. If
something later modifies it in place (``y = x @ w; y.relu_()``), the cached
value is not the op's output any more: the forward mode drops such entries when
the forward pass ends, and a replay that finds a changed version reruns the op.

Never more than plain autograd. A policy may choose outputs autograd itself would
not keep (a residual sum, a scores matrix that only feeds the softmax: results no
backward formula needs). Kept, they could make a selective checkpoint hold *more*
than no checkpoint at all. So when forward ends, the cached outputs that autograd
did not save and that the function no longer holds (only the cache keeps their
memory) may use at most the bytes the checkpoint dropped (saved by autograd, not
cached); beyond that the largest are forgotten, and the rerun recomputes such a
call if anything needs it (checking its input shapes still), or skips it. Outputs
autograd saved cost what plain autograd spends on them, so they always stay.

A policy with ``cap_every_op = True`` (``megatron_attention``, which chooses by
shape and so picks many such outputs) has the same count made before every op of
the forward pass, so not even the forward holds more than plain autograd would.
This needs the checkpoint to report what autograd saves (ckptlib's does, with
``skip_unneeded=True``); a random in-place op's private copy (dropout's mask) counts only there.

The count alone is not enough for such a policy: it bounds what the cache holds
*between* forward and backward, but the rerun rebuilds every tensor autograd saved
while the cache still holds the outputs autograd did not save, and then the call
holds the two together, more than plain autograd ever held for it (GPT-2 with
``megatron_attention`` peaked up to 1.12x plain autograd, Hugging Face's
``gelu_new`` intermediates, dropout products and block outputs held through the
attention core's rerun). Most of those outputs are replayed for nothing: no op
the rerun runs reads them (the op after them is replayed too, or the rerun ends
first) and autograd did not save them. So when forward ends such a policy also
lets go of every cached output the rerun would not read
(:meth:`~ckptlib.selective.opgraph.OpGraph.unused_replays`): the rerun skips
those calls instead, so this costs no recomputation. What stays are outputs
autograd saves, and outputs a call that does rerun reads (the ``qkv`` projection
the per-head copies are made from), within the count above.

When the cache is freed. The cache holds what autograd would otherwise keep as
saved tensors, so it follows their lifetime:

* a backward that frees the graph (the default, ``retain_graph=False``) empties
  the cache when its rerun ends: the replayed tensors now belong to the
  recomputed saved tensors, each released after its single use, and whatever
  the rerun did not reach (early stop) is dropped;
* a backward with ``retain_graph=True`` leaves the cache whole, so the next
  backward replays it again (``torch``'s SAC raises an error here instead);
* a graph dropped without any backward frees the cache with it: only the
  checkpoint's frame, which the graph owns, refers to the cache.

A replay that finds its entry gone (``torch.autograd.grad`` on part of a graph
without ``retain_graph``, then another backward through the rest) reruns the
op, which is correct because the rerun's inputs are correct: the cache only
ever saves time, it is never the only source of a value.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch._ops import OpOverload

from ckptlib.core.errors import CheckpointError
from ckptlib.selective.opgraph import OpGraph, Skip
from ckptlib.selective.ops import (
    PLAIN,
    RANDOM_IN_PLACE,
    map_tensors,
    shapes_of,
    storages_of,
    tensors_of,
    versions_of,
)
from ckptlib.memory.allocations import storage_bytes


def _shares_input_storage(output: Any, args: tuple) -> bool:
    return not storages_of(output).isdisjoint(storages_of(args))


def _default_generator(tensor: torch.Tensor) -> torch.Generator | None:
    if tensor.device.type == "cpu":
        return torch.default_generator
    if tensor.device.type == "cuda":
        index = (
            tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
        )
        return torch.cuda.default_generators[index]
    return None


def _held_by_cache_only(tensor: torch.Tensor) -> bool:
    """Is the cache's alias the only tensor on this memory? (The storage's strong uses are that
    alias and the storage's Python object.)"""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata) <= 2


def _detached(tensor: torch.Tensor) -> torch.Tensor:
    """A new tensor object on the same memory, with no autograd history.

    The cache must not hold the op's output object itself: autograd attaches
    the output's ``grad_fn`` to it, and the graph owns the cache, a reference
    cycle. We run below autograd, where ``detach`` would not share the version
    counter; re-enabling the ADInplaceOrView key makes it share, so in-place
    changes to the output stay visible to the cache (as in torch's SAC).
    """
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return tensor.detach()


@dataclass
class Saved:
    """The output of one op call, kept from forward to recomputation."""

    value: Any  # the output, detached; a private copy for an in-place op
    versions: tuple[int, ...]  # version counters when saved; a change = modified since
    input_shapes: tuple[torch.Size, ...]
    in_place: bool
    generator: torch.Generator | None = None  # for a random op: its generator, and the
    generator_state: torch.Tensor | None = None  # generator's state right after the op

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in tensors_of(self.value))

    def is_stale(self) -> bool:
        return versions_of(self.value) != self.versions

    def replay(self, args: tuple) -> Any:
        if self.generator is not None:
            self.generator.set_state(self.generator_state)
        if self.in_place:
            return args[0].copy_(self.value)
        return map_tensors(_detached, self.value)


def make_entry(
    func: OpOverload, kind: str, args: tuple, kwargs: dict, output: Any, replay_random: bool
) -> Saved | None:
    """Make the cache entry for one op call, or ``None`` where caching it would be wrong
    or useless (see "What is never cached" in the module notes). ``kind`` is cacheable."""
    if kind == PLAIN:
        if _shares_input_storage(output, args):
            return None
        return Saved(map_tensors(_detached, output), versions_of(output), shapes_of(args), False)
    explicit_generator = any(isinstance(a, torch.Generator) for a in (*args, *kwargs.values()))
    generator = _default_generator(tensors_of(output)[0])
    if not replay_random or explicit_generator or generator is None:
        return None
    value = args[0].clone() if kind == RANDOM_IN_PLACE else map_tensors(_detached, output)
    return Saved(
        value,
        versions_of(value),
        shapes_of(args),
        kind == RANDOM_IN_PLACE,
        generator,
        generator.get_state(),
    )


class OpCache:
    """What one selective checkpoint call keeps: per op overload, its number of calls in
    forward and the saved outputs by call position; and, when the checkpoint reports
    what it saves, the plan of which calls the recomputation may skip."""

    def __init__(self, replay_random: bool) -> None:
        self.replay_random = replay_random
        self.calls: Counter[OpOverload] = Counter()
        self.saved: dict[OpOverload, dict[int, Saved]] = {}
        self.graph: OpGraph | None = None  # recorded in forward when saved tensors are observed
        self.skippable: dict[tuple[OpOverload, int], Skip] | None = (
            None  # the plan, once forward ends
        )
        self.intact = True  # every entry the plan counted on is still here
        # Plan reuse (SelectivePlans): a recording call logs its op sequence and hands what it
        # learned (this cache, the op graph, the sequence) to ``plan_sink``; a call that reuses a
        # plan checks its rerun against ``sequence`` and reports a difference to ``on_mismatch``.
        self.plan_sink: Callable[[OpCache, OpGraph, tuple[OpOverload, ...]], None] | None = None
        self.sequence_log: list[OpOverload] | None = None
        self.sequence: tuple[OpOverload, ...] | None = None
        self.on_mismatch: Callable[[], None] | None = None
        self.passthrough = False  # nothing cached, nothing counted: the rerun runs every op
        # (forward, while the op graph is recorded) cached calls not saved by autograd so far ->
        # their values
        self.pending: dict[tuple[OpOverload, int], tuple[int, ...]] = {}
        self.cached_saved_bytes = (
            0  # bytes of cached outputs autograd saved (plain autograd keeps those too)
        )
        self.cap_every_op = False  # check the cap before every op, not only at the end (a policy's)
        self.dropped_shapes: dict[
            tuple[OpOverload, int], tuple[torch.Size, ...]
        ] = {}  # forgotten calls' inputs
        self.input_storages: frozenset[int] = (
            frozenset()
        )  # the function's inputs' (for fingerprints)

    @property
    def saved_bytes(self) -> int:
        """Bytes the cache holds now (each storage once)."""
        return sum(
            storage_bytes(
                [
                    t
                    for by_position in self.saved.values()
                    for saved in by_position.values()
                    for t in tensors_of(saved.value)
                ]
            ).values()
        )

    def drop_stale(self) -> None:
        for by_position in self.saved.values():
            for position in [p for p, saved in by_position.items() if saved.is_stale()]:
                del by_position[position]

    def note_cached(self, key: tuple[OpOverload, int], values: tuple[int, ...]) -> None:
        """(forward) Call ``key`` was cached; its outputs are the graph's ``values``."""
        self.pending[key] = values

    def release_dead(self) -> None:
        """(forward, before each op, and at its end) Hold no more than plain autograd would (see
        "Never more than plain autograd"): the cached outputs autograd did not save and the function
        no longer holds may take up only the bytes autograd saved that the cache does not hold;
        beyond that, the largest are forgotten."""
        saved_values = self.graph.saved_values
        dead: list[tuple[int, str, int, tuple[OpOverload, int]]] = []
        for key, values in list(self.pending.items()):
            entry = self.saved.get(key[0], {}).get(key[1])
            if entry is None:
                del self.pending[key]
            elif not saved_values.isdisjoint(values):  # saved: plain autograd keeps it too
                self.cached_saved_bytes += entry.nbytes
                del self.pending[key]
            elif all(_held_by_cache_only(t) for t in tensors_of(entry.value)):
                dead.append((entry.nbytes, str(key[0]), key[1], key))
        extra_bytes = sum(item[0] for item in dead)
        allowance = self.graph.saved_bytes - self.cached_saved_bytes
        for nbytes, _, _, key in sorted(dead, key=lambda item: (-item[0], item[1], item[2])):
            if extra_bytes <= allowance:
                break
            self.forget(key)
            extra_bytes -= nbytes

    def forget(self, key: tuple[OpOverload, int]) -> None:
        """(forward) Let go of the cached output of call ``key``: the rerun skips the call or runs
        it again, and still checks that its inputs have the forward's shapes."""
        self.dropped_shapes[key] = self.saved[key[0]].pop(key[1]).input_shapes
        self.pending.pop(key, None)

    def cached_keys(self) -> set[tuple[OpOverload, int]]:
        return {
            (func, position) for func, by_position in self.saved.items() for position in by_position
        }

    def finish_forward(self, completed: bool = True) -> None:
        """Forward is over: forget entries modified since, and plan which calls to skip (and,
        if it ``completed`` and a plan is wanted, hand what a reusable plan is made of to
        ``plan_sink``)."""
        self.drop_stale()
        if self.graph is not None:
            if (
                self.cap_every_op
            ):  # outputs the rerun would replay for nothing: skip those calls instead
                for key in self.graph.unused_replays(self.cached_keys()):
                    self.forget(key)
            self.release_dead()
            self.pending.clear()
            self.skippable = self.graph.unneeded_calls(self.cached_keys())
            if (
                completed
                and self.plan_sink is not None
                and self.graph.packs is not None
                and self.sequence_log is not None
            ):
                self.plan_sink(self, self.graph, tuple(self.sequence_log))
            self.graph = None
            self.sequence_log = None

    def plan_for_rerun(self) -> dict[tuple[OpOverload, int], Skip] | None:
        """The calls this recomputation may skip: none unless every cached entry the plan
        counted on is still there, unmodified (otherwise its op reruns, from inputs the
        plan may have skipped)."""
        if self.skippable is None or not self.intact:
            return None
        if any(
            saved.is_stale()
            for by_position in self.saved.values()
            for saved in by_position.values()
        ):
            return None
        return self.skippable

    def check_position(
        self, func: OpOverload, position: int, *, read_skipped: bool = False
    ) -> None:
        """Refuse a rerun call the forward pass never made. ``read_skipped``: the call reads an
        empty stand-in of a skipped op, the mark of values the function read back to Python."""
        if position < self.calls[func]:
            return
        head = (
            f"selective checkpoint: the recomputation called {func} {position + 1} times, the "
            f"forward pass only {self.calls[func]} times, so the cached outputs no longer match "
            "the ops. "
        )
        if read_skipped:
            # Values read into Python (.tolist()) are a dependency the op graph cannot
            # see: the rerun skipped the op that made it, and Python then asks a stand-in for it.
            raise CheckpointError(
                head + "It reads the empty stand-in of an op the rerun skipped: the function most "
                "likely reads a tensor's values back to Python with .tolist() (or .numpy()) and "
                "computes on from them. Pass skip_unneeded=False to selective_checkpoint "
                "so that the rerun runs every op."
            )
        raise CheckpointError(
            head + "The checkpointed function must run the same ops in both passes: no branches on "
            "random numbers, time, global flags or train/eval mode changed in between."
        )

    def check_dropped(self, func: OpOverload, position: int, args: tuple) -> None:
        """A call whose cached output was forgotten in forward must see the forward's input
        shapes."""
        expected = self.dropped_shapes.get((func, position))
        if expected is not None and shapes_of(args) != expected:
            raise_shape_mismatch(func, position, args, expected)

    def take(self, func: OpOverload, position: int, args: tuple, consume: bool) -> Saved | None:
        """The entry for call ``position`` of ``func``, if saved; ``consume`` forgets it
        (nothing will replay it again), so it dies with the last tensor that uses it."""
        by_position = self.saved[func]
        saved = by_position.pop(position, None) if consume else by_position.get(position)
        if saved is not None and shapes_of(args) != saved.input_shapes:
            raise_shape_mismatch(func, position, args, saved.input_shapes)
        return saved

    def release(self) -> None:
        self.saved.clear()
        self.intact = False


def raise_shape_mismatch(func: OpOverload, position: int, args: tuple, expected: tuple) -> None:
    raise CheckpointError(
        f"selective checkpoint: call #{position} of {func} got inputs of shapes "
        f"{[list(shape) for shape in shapes_of(args)]} in the recomputation but "
        f"{[list(shape) for shape in expected]} in the forward pass, so its cached "
        "output does not belong to this call. Make the checkpointed function run the same "
        "ops on the same shapes in both passes."
    )
