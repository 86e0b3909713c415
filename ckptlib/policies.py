"""Selective checkpointing: keep the outputs of chosen ops, recompute the rest.

Full checkpointing drops every activation of a region and reruns the whole
region in backward. Selective checkpointing (PyTorch's "SAC",
``torch.utils.checkpoint.create_selective_checkpoint_contexts``) keeps a few
op outputs through the forward pass and, in the rerun, hands those back instead
of computing them again. The choice of ops is the *policy*: keep outputs that
are expensive to compute and cheap to store (a matmul: many flops per byte),
recompute the ones that are cheap and big (the ``batch x heads x seq x seq``
attention scores).

Design notes
============

Two dispatch modes. ``selective_checkpoint`` is ``ckptlib.checkpoint`` with a
``context_fn`` that returns two ``TorchDispatchMode``\\ s sharing one cache.
A dispatch mode sees every aten op *below* autograd (``torch.mm``,
``F.linear`` and ``x @ w`` all arrive as ``aten.mm``/``aten.addmm``):

* forward, :class:`SaveChosenOps`: run each op; if the policy says save, put
  its output in the cache; and record the op graph (below).
* recomputation, :class:`ReplaySavedOps`: for an op whose output is cached,
  return the cached output instead of running the op; skip the ops whose
  results nothing needs; run every other op.

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
and it has no effect beyond them. Never skipped: random ops (the generator must
advance as in forward; a replayed one sets it), in-place ops, ops whose result
is not a tensor (``.item()``: a value leaves for Python), ops writing memory the
function did not create, and ops on tensor subclasses or unusual layouts. A
skipped call hands back empty tensors of the forward's sizes and strides on the
*meta* device: they cost no memory, and the plan guarantees only views and other
skipped calls read them, so a wrong plan fails loudly (an op that runs cannot mix
meta and real tensors; the checkpoint refuses a recomputed tensor on the wrong
device) instead of computing from garbage. The plan is used only while every
cache entry it counted on is still there and unmodified; otherwise the rerun
runs every op it does not replay, as before. With ``torch.utils.checkpoint``
(``selective_contexts`` as its ``context_fn``) nobody reports the saved tensors,
so nothing is skipped.

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

Autocast. Under autocast, the first use of a parameter in an autocast region
casts it (``aten._to_copy``) and later uses reuse the cast, so forward and
rerun need not issue the same casts: the forward may have cast a weight for an
earlier block, the rerun (a region of its own) casts it again. Casts of leaf
tensors that require grad (what autocast caches) are therefore invisible to the
modes: not counted, never cached or skipped, always run.

The cache. Outputs are kept per op overload and call position: the 3rd
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

>>> import torch
>>> x = torch.randn(8, 8, requires_grad=True)
>>> w = torch.randn(8, 8, requires_grad=True)
>>> layer = lambda a, b: (a @ b).tanh() @ b
>>> selective_checkpoint(layer, x, w, policy=save_matmuls).sum().backward()
>>> torch.equal(w.grad, torch.autograd.grad(layer(x, w).sum(), w)[0])
True
"""
from __future__ import annotations

import functools
import itertools
import math
import statistics
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping, NamedTuple, Union

import torch
from torch._ops import OpOverload, OpOverloadPacket
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack as _dispatch_mode_stack
from torch.utils._pytree import tree_flatten

from ckptlib.checkpoint import CheckpointError, RecomputeAgain, _autocast_state, checkpoint, is_recomputing

__all__ = [
    "selective_checkpoint", "selective_contexts", "SelectivePlans", "Policy", "SaveChosenOps", "ReplaySavedOps",
    "save_matmuls", "megatron_attention", "ATTENTION_CORE_OPS",
    "OpCall", "OpCost", "CostProfile", "CostPolicy", "measure_op_costs", "choose_ops", "policy_from_costs",
]

aten = torch.ops.aten

Policy = Union[Callable[..., bool], Collection[Union[OpOverload, OpOverloadPacket]]]
"""``policy(op, *args, **kwargs) -> bool`` (save this op's output?), or a collection of
ops to save (an ``OpOverload`` such as ``aten.mm.default`` matches that overload, an
``OpOverloadPacket`` such as ``aten.mm`` all of its overloads)."""


# ---------------------------------------------------------------------------
# What kind of op is it? (decided from the op's schema, the same in both runs)
# ---------------------------------------------------------------------------

_VIEW, _MUTATING, _PLAIN, _RANDOM, _RANDOM_IN_PLACE = "view", "mutating", "plain", "random", "random in place"
_CACHEABLE_KINDS = (_PLAIN, _RANDOM, _RANDOM_IN_PLACE)


@functools.lru_cache(maxsize=None)  # a pure function of an immutable op: memoised for speed
def _op_kind(func: OpOverload) -> str:
    if func.is_view:
        return _VIEW
    random = torch.Tag.nondeterministic_seeded in func.tags
    if func._schema.is_mutable:
        return _RANDOM_IN_PLACE if random and _modifies_only_self(func) else _MUTATING
    return _RANDOM if random else _PLAIN


def _modifies_only_self(func: OpOverload) -> bool:
    """``bernoulli_(self, ...) -> self``: one written argument, the first, returned."""
    arguments = func._schema.arguments
    written = [a for a in arguments if a.alias_info is not None and a.alias_info.is_write]
    return written == [arguments[0]] and len(func._schema.returns) == 1


def _tensors(value: Any) -> list[torch.Tensor]:
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
                found.extend(_tensors(item))
        return found
    return []


def _input_tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an op call reads, positional then keyword."""
    return _tensors((args, tuple(kwargs.values()))) if kwargs else _tensors(args)


def _map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(fn, item) for item in value)
    return value


def _storages(value: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in _tensors(value)}


def _shares_input_storage(output: Any, args: tuple) -> bool:
    return not _storages(output).isdisjoint(_storages(args))


def _default_generator(tensor: torch.Tensor) -> torch.Generator | None:
    if tensor.device.type == "cpu":
        return torch.default_generator
    if tensor.device.type == "cuda":
        index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return None


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


# ---------------------------------------------------------------------------
# One cached op output, and the cache of one selective checkpoint call
# ---------------------------------------------------------------------------


def _shapes(args: tuple) -> tuple[torch.Size, ...]:
    return tuple([t.shape for t in _tensors(args)])


def _versions(value: Any) -> tuple[int, ...]:
    return tuple(t._version for t in _tensors(value))


@dataclass
class _Saved:
    """The output of one op call, kept from forward to recomputation."""

    value: Any                         # the output, detached; a private copy for an in-place op
    versions: tuple[int, ...]          # version counters when saved; a change = modified since
    input_shapes: tuple[torch.Size, ...]
    in_place: bool
    generator: torch.Generator | None = None     # for a random op: its generator, and the
    generator_state: torch.Tensor | None = None  # generator's state right after the op

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in _tensors(self.value))

    def is_stale(self) -> bool:
        return _versions(self.value) != self.versions

    def replay(self, args: tuple) -> Any:
        if self.generator is not None:
            self.generator.set_state(self.generator_state)
        if self.in_place:
            return args[0].copy_(self.value)
        return _map_tensors(_detached, self.value)


def _save(func: OpOverload, kind: str, args: tuple, kwargs: dict, output: Any,
          replay_random: bool) -> _Saved | None:
    """Make the cache entry for one op call, or ``None`` where caching it would be wrong
    or useless (see "What is never cached" in the notes above). ``kind`` is cacheable."""
    if kind == _PLAIN:
        if _shares_input_storage(output, args):
            return None
        return _Saved(_map_tensors(_detached, output), _versions(output), _shapes(args), False)
    explicit_generator = any(isinstance(a, torch.Generator) for a in (*args, *kwargs.values()))
    generator = _default_generator(_tensors(output)[0])
    if not replay_random or explicit_generator or generator is None:
        return None
    value = args[0].clone() if kind == _RANDOM_IN_PLACE else _map_tensors(_detached, output)
    return _Saved(value, _versions(value), _shapes(args), kind == _RANDOM_IN_PLACE,
                  generator, generator.get_state())


class _OpCache:
    """What one selective checkpoint call keeps: per op overload, its number of calls in
    forward and the saved outputs by call position; and, when the checkpoint reports
    what it saves, the plan of which calls the recomputation may skip."""

    def __init__(self, replay_random: bool) -> None:
        self.replay_random = replay_random
        self.calls: Counter[OpOverload] = Counter()
        self.saved: dict[OpOverload, dict[int, _Saved]] = {}
        self.graph: _OpGraph | None = None      # recorded in forward when saved tensors are observed
        self.skippable: dict[tuple[OpOverload, int], _Skip] | None = None   # the plan, once forward ends
        self.intact = True      # every entry the plan counted on is still here
        # Plan reuse (SelectivePlans): a recording call logs its op sequence and hands the plan
        # it learned to ``plan_sink``; a call that reuses a plan checks its rerun against
        # ``sequence`` and reports a difference to ``on_mismatch``.
        self.plan_sink: Callable[[_Plan], None] | None = None
        self.sequence_log: list[OpOverload] | None = None
        self.sequence: tuple[OpOverload, ...] | None = None
        self.on_mismatch: Callable[[], None] | None = None
        self.passthrough = False     # nothing cached, nothing counted: the rerun runs every op
        self.input_storages: frozenset[int] = frozenset()    # the function's inputs' (for fingerprints)

    @property
    def saved_bytes(self) -> int:
        """Bytes the cache holds now (each storage once)."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for by_position in self.saved.values() for saved in by_position.values()
                    for t in _tensors(saved.value)}
        return sum(storages.values())

    def drop_stale(self) -> None:
        for by_position in self.saved.values():
            for position in [p for p, saved in by_position.items() if saved.is_stale()]:
                del by_position[position]

    def finish_forward(self, completed: bool = True) -> None:
        """Forward is over: forget entries modified since, and plan which calls to skip (and,
        if it ``completed`` and a plan is wanted, hand the reusable plan to ``plan_sink``)."""
        self.drop_stale()
        if self.graph is not None:
            cached = {(func, position) for func, by_position in self.saved.items() for position in by_position}
            self.skippable = self.graph.unneeded_calls(cached)
            if completed and self.plan_sink is not None and self.graph.packs is not None \
                    and self.sequence_log is not None:
                self.plan_sink(_Plan.learn(self, self.graph, tuple(self.sequence_log)))
            self.graph = None
            self.sequence_log = None

    def plan_for_rerun(self) -> dict[tuple[OpOverload, int], _Skip] | None:
        """The calls this recomputation may skip: none unless every cached entry the plan
        counted on is still there, unmodified (otherwise its op reruns, from inputs the
        plan may have skipped)."""
        if self.skippable is None or not self.intact:
            return None
        if any(saved.is_stale() for by_position in self.saved.values() for saved in by_position.values()):
            return None
        return self.skippable

    def check_position(self, func: OpOverload, position: int) -> None:
        if position >= self.calls[func]:
            raise CheckpointError(
                f"selective checkpoint: the recomputation called {func} {position + 1} times, the "
                f"forward pass only {self.calls[func]} times, so the cached outputs no longer match "
                "the ops. The checkpointed function must run the same ops in both passes: no "
                "branches on random numbers, time, global flags or train/eval mode changed in between."
            )

    def take(self, func: OpOverload, position: int, args: tuple, consume: bool) -> _Saved | None:
        """The entry for call ``position`` of ``func``, if saved; ``consume`` forgets it
        (nothing will replay it again), so it dies with the last tensor that uses it."""
        by_position = self.saved[func]
        saved = by_position.pop(position, None) if consume else by_position.get(position)
        if saved is not None and _shapes(args) != saved.input_shapes:
            _raise_shape_mismatch(func, position, args, saved.input_shapes)
        return saved

    def release(self) -> None:
        self.saved.clear()
        self.intact = False


def _raise_shape_mismatch(func: OpOverload, position: int, args: tuple, expected: tuple) -> None:
    raise CheckpointError(
        f"selective checkpoint: call #{position} of {func} got inputs of shapes "
        f"{[list(shape) for shape in _shapes(args)]} in the recomputation but "
        f"{[list(shape) for shape in expected]} in the forward pass, so its cached "
        "output does not belong to this call. Make the checkpointed function run the same "
        "ops on the same shapes in both passes."
    )


# ---------------------------------------------------------------------------
# The op graph of one forward pass, and which calls a recomputation can skip
# ---------------------------------------------------------------------------


class _Skip(NamedTuple):
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
        if (type(output) is not torch.Tensor or output.layout is not torch.strided or output.storage_offset()
                or output.is_conj() or output.is_neg() or _extent_bytes(output) != output.untyped_storage().nbytes()):
            return None   # the last: a view into a larger buffer, which a stand-in would not cover
        return _Placeholder(output.shape, output.stride(), output.dtype)
    if isinstance(output, (list, tuple)):
        items = [_template(item) for item in output]
        return None if any(item is None for item in items) else type(output)(items)
    return None


def _extent_bytes(tensor: torch.Tensor) -> int:
    """Bytes from the first to the last element of ``tensor`` (what ``empty_strided`` allocates)."""
    if tensor.numel() == 0:
        return 0
    return (1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))) * tensor.element_size()


def _from_template(template: Any) -> Any:
    if isinstance(template, _Placeholder):
        return template.make()
    return type(template)(_from_template(item) for item in template)


def _storage_key(tensor: torch.Tensor) -> int | None:
    try:
        pointer = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less tensors
        return None
    return pointer or None   # 0: no memory (empty or meta tensors), nothing to depend on


def _fingerprint(tensor: torch.Tensor, input_storages: Collection[int], first_node: int) -> tuple:
    """What a reused plan checks of each saved tensor: shape, dtype, device, and the autograd
    node that made it: its kind (``SoftmaxBackward0``) and its place among the nodes the call
    created (``first_node``: the sequence number of the first); for a view, its base's node (a
    ``reshape`` is a ``ViewBackward0`` under a dispatch mode and a ``ReshapeAliasBackward0``
    without one); ``"input"`` for (a view of) an input of the function."""
    if _storage_key(tensor) in input_storages:
        return (tensor.shape, tensor.dtype, tensor.device, "input")
    is_view = tensor._is_view()
    node = tensor._base.grad_fn if is_view else tensor.grad_fn
    if node is None:       # a leaf (a parameter) or a view of one
        return (tensor.shape, tensor.dtype, tensor.device, is_view, None)
    place = node._sequence_nr() - first_node
    return (tensor.shape, tensor.dtype, tensor.device, is_view, type(node), place if place >= 0 else "before")


def _next_node_number() -> int:
    """The sequence number autograd gives the next node this thread creates. (The probe is
    hidden from dispatch modes: an enclosing selective checkpoint must not count its ops.)"""
    with torch._C._DisableTorchDispatch():
        probe = torch.empty(0, requires_grad=True).view(0)    # creates one node
    return probe.grad_fn._sequence_nr() + 1


@functools.lru_cache(maxsize=None)
def _written_arguments(func: OpOverload) -> tuple[tuple[int, str], ...]:
    """(position, name) of the arguments ``func`` writes to (``self`` of ``relu_``, ``out=``)."""
    return tuple((i, a.name) for i, a in enumerate(func._schema.arguments)
                 if a.alias_info is not None and a.alias_info.is_write)


class _OpCall(NamedTuple):
    key: tuple[OpOverload, int]        # (op, call position): how the rerun finds it
    inputs: frozenset[int]             # values it reads
    outputs: tuple[int, ...]           # values it creates (new memory, or a new version after a write)
    must_run: bool                     # side effects, non-tensor results, or no stand-in possible
    random: bool                       # draws random numbers: rerun unless replayed
    in_place: bool                     # writes an argument (a replay copies into it: it must be real)
    skip: _Skip | None
    seconds: float = 0.0               # (measure_op_costs only) time of the call
    reached: bool = True               # (measure_op_costs only) does a full rerun run it (early stop)?


class _OpGraph:
    """Which op calls read and create which values, recorded during forward.

    A *value* is the contents of one block of memory between two writes: each new
    output storage is a value, and an in-place op creates a new value in the memory
    it writes. Views read and make no values: a view reads the memory of its base.
    Values are numbered; a memory address maps to its current value, so an address
    reused after a free is a new value.
    """

    def __init__(self) -> None:
        self.calls: list[_OpCall] = []
        self.current: dict[int, int] = {}     # storage address -> the value in it now
        self.saved_values: set[int] = set()   # values autograd saved (what a rerun must rebuild)
        self.next_value = 0
        # (recording a reusable plan only) per saved tensor, in pack order: its value and fingerprint
        self.packs: list[tuple[int | None, tuple]] | None = None
        self.input_storages: frozenset[int] = frozenset()
        self.first_node = 0

    def _new_value(self, pointer: int) -> int:
        value = self.next_value
        self.next_value += 1
        self.current[pointer] = value
        return value

    def note_saved(self, tensor: torch.Tensor) -> None:
        pointer = _storage_key(tensor)
        value = self.current.get(pointer) if pointer is not None else None
        if value is not None:
            self.saved_values.add(value)
        if self.packs is not None:
            self.packs.append((value, _fingerprint(tensor, self.input_storages, self.first_node)))

    def record(self, func: OpOverload, position: int, kind: str, args: tuple, kwargs: dict, output: Any,
               seconds: float = 0.0, reached: bool = True) -> None:
        """Note one (non-view) op call. Runs for every op of the forward pass: kept lean."""
        current = self.current
        input_tensors = _input_tensors(args, kwargs)
        input_pointers = [_storage_key(t) for t in input_tensors]
        inputs = frozenset([current[p] for p in input_pointers if p in current])
        in_place = kind is _MUTATING or kind is _RANDOM_IN_PLACE
        if in_place:
            # Always rerun (in-place ops are cheap, and skipping one would need its aliasing
            # outputs rebuilt); it reads its inputs, and makes a new value where it writes.
            written = [args[i] if i < len(args) else kwargs.get(name) for i, name in _written_arguments(func)]
            pointers = [_storage_key(t) for t in _tensors(written)]
            outputs = tuple([self._new_value(p) for p in pointers if p is not None])
            must_run, skip = True, None
        elif type(output) is torch.Tensor:         # the common case, one plain tensor
            pointer = _storage_key(output)
            if pointer in input_pointers:
                return   # returns (a view of) an input, like a view: always rerun, no new value
            template = _template(output)
            must_run = template is None
            outputs = (self._new_value(pointer),) if pointer is not None else ()
        else:
            output_pointers = [_storage_key(t) for t in _tensors(output)]
            if output_pointers and all(p in input_pointers for p in output_pointers):
                return   # returns (views of) its inputs, like a view: always rerun, no new values
            # No tensor out (a Python number: a value leaves for Python), or some outputs alias
            # inputs, or no stand-in possible: always rerun.
            template = _template(output) if output_pointers else None
            must_run = template is None or any(p in input_pointers for p in output_pointers)
            outputs = tuple([self._new_value(p) for p in output_pointers if p is not None])
        if not in_place:
            skip = None if must_run else _Skip(template, tuple([t.shape for t in input_tensors]))
        self.calls.append(_OpCall((func, position), inputs, outputs, must_run,
                                  kind is _RANDOM or kind is _RANDOM_IN_PLACE, in_place, skip, seconds, reached))

    def unneeded_calls(self, cached: Collection[tuple[OpOverload, int]]) -> dict[tuple[OpOverload, int], _Skip]:
        """The calls a rerun can skip when the ``cached`` calls are replayed: those whose values
        neither autograd saved nor any call that does run reads (a backward sweep)."""
        return {call.key: call.skip for call in self._sweep(cached) if call.skip is not None}

    def _sweep(self, cached: Collection[tuple[OpOverload, int]]) -> list[_OpCall]:
        needed = set(self.saved_values)
        skipped = []
        for call in reversed(self.calls):
            if call.key in cached:
                if call.in_place:         # replayed by copying into its argument
                    needed |= call.inputs
                continue                  # replayed: its inputs are not read
            if call.must_run or call.random or not needed.isdisjoint(call.outputs):
                needed |= call.inputs
            else:
                skipped.append(call)
        return skipped

    def rerun_seconds(self, cached: Collection[tuple[OpOverload, int]]) -> float:
        """(measure_op_costs graphs) Time of the calls a rerun runs: not replayed, not
        skipped, and before the early stop."""
        skipped = {call.key for call in self._sweep(cached)}
        return sum(call.seconds for call in self.calls
                   if call.reached and call.key not in cached and call.key not in skipped)


# ---------------------------------------------------------------------------
# The two dispatch modes (their __torch_dispatch__ runs for every op: kept lean)
# ---------------------------------------------------------------------------


def _as_predicate(policy: Policy) -> Callable[[OpOverload, tuple, dict], bool]:
    if isinstance(policy, (OpOverload, OpOverloadPacket)):
        policy = {policy}
    if callable(policy):
        return lambda func, args, kwargs: bool(policy(func, *args, **kwargs))
    if isinstance(policy, (str, bytes)) or not isinstance(policy, Collection):
        raise TypeError(f"policy must be a callable policy(op, *args, **kwargs) -> bool or a collection "
                        f"of aten ops such as {{torch.ops.aten.mm.default}}, got {type(policy).__name__}.")
    ops = frozenset(policy)
    for op in ops:
        if not isinstance(op, (OpOverload, OpOverloadPacket)):
            raise TypeError(f"policy contains {op!r} ({type(op).__name__}), which is not an aten op; "
                            "use ops like torch.ops.aten.mm.default or torch.ops.aten.mm (all overloads), "
                            "not torch.mm or strings.")
    return lambda func, args, kwargs: func in ops or func.overloadpacket in ops


class SaveChosenOps(TorchDispatchMode):
    """Forward mode: run every op, and cache the outputs of those the policy chooses.

    When the checkpoint reports the tensors it drops (``observe_saved_tensors``, called
    by ``ckptlib.checkpoint``), it also records the op graph, from which the end of the
    forward pass plans which calls the recomputation can skip.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False   # eager only: torch's dynamo-disabling wrapper costs ~5 us on every op

    def __init__(self, policy: Policy, cache: _OpCache, *, skip_unneeded: bool = True) -> None:
        super().__init__()
        self.should_save = _as_predicate(policy)
        self.cache = cache
        self.skip_unneeded = skip_unneeded

    def observe_saved_tensors(self) -> Callable[[torch.Tensor], None] | None:
        """Called by ``ckptlib.checkpoint`` before forward: returns where to report each
        tensor autograd saves (or ``None``: not interested), and starts the op graph."""
        if not self.skip_unneeded:
            return None
        self.cache.graph = _OpGraph()
        if self.cache.plan_sink is not None:
            self.cache.graph.packs, self.cache.sequence_log = [], []
            self.cache.graph.input_storages = self.cache.input_storages
        return self.cache.graph.note_saved

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        output = func(*args, **kwargs)
        kind = _op_kind(func)
        if kind == _VIEW or _is_parameter_cast(func, args):
            return output
        cache = self.cache
        position = cache.calls[func]
        cache.calls[func] = position + 1
        if cache.sequence_log is not None:
            cache.sequence_log.append(func)
        if kind in _CACHEABLE_KINDS and self.should_save(func, args, kwargs):
            saved = _save(func, kind, args, kwargs, output, cache.replay_random)
            if saved is not None:
                cache.saved.setdefault(func, {})[position] = saved
        if cache.graph is not None:
            cache.graph.record(func, position, kind, args, kwargs, output)
        return output

    def __enter__(self):
        graph = self.cache.graph
        if graph is not None and graph.packs is not None:
            graph.first_node = _next_node_number()
        return super().__enter__()

    def __exit__(self, exc_type, *exc_info):
        self.cache.finish_forward(completed=exc_type is None)
        return super().__exit__(exc_type, *exc_info)


class ReplaySavedOps(TorchDispatchMode):
    """Recomputation mode: hand back cached outputs in forward order, skip the calls whose
    results nothing needs (empty stand-ins of the right shape), run every other op.

    May be entered once per recomputation (``retain_graph=True`` backwards):
    each entry counts calls from zero again.

    If a skipped result turns out to be needed after all (the function read a skipped
    tensor's ``.device`` in Python to make a new one, so the op graph saw no dependency), an op
    that runs meets a meta tensor and fails, or a random op draws nothing on one: the mode
    switches skipping off and raises :class:`~ckptlib.checkpoint.RecomputeAgain`, and the
    checkpoint runs the function once more. Correct, at the price of a second rerun.
    """

    _should_skip_dynamo = SaveChosenOps._should_skip_dynamo

    def __init__(self, cache: _OpCache) -> None:
        super().__init__()
        self.cache = cache
        self.calls: Counter[OpOverload] = Counter()
        self.consume = False
        self.skippable: dict[tuple[OpOverload, int], _Skip] | None = None
        self.sequence: tuple[OpOverload, ...] | None = None
        self.step = 0
        self.active = False      # this entry pushed the mode (not so in passthrough)

    def __enter__(self):
        if self.cache.passthrough:
            return self       # a reused plan did not fit this call: plain rerun, no mode at all
        self.calls.clear()
        self.consume = _backward_frees_graph()
        self.skippable = self.cache.plan_for_rerun()
        self.sequence, self.step = self.cache.sequence, 0
        self.active = True
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.skippable is None:
            return self._dispatch(func, args, kwargs)
        try:
            output = self._dispatch(func, args, kwargs)
        except (RecomputeAgain, CheckpointError):
            raise
        except Exception:
            if any(t.is_meta for t in _input_tensors(args, kwargs)) and self.recompute_again():
                raise RecomputeAgain from None    # it read a skipped result
            raise
        kind = _op_kind(func)
        if (kind is _RANDOM or kind is _RANDOM_IN_PLACE) and any(t.is_meta for t in _tensors(output)) \
                and self.recompute_again():
            raise RecomputeAgain   # drew nothing: later random ops would draw other numbers
        return output

    def _dispatch(self, func: OpOverload, args: tuple, kwargs: dict) -> Any:
        if _op_kind(func) == _VIEW or _is_parameter_cast(func, args):
            return func(*args, **kwargs)
        if self.sequence is not None:
            self._check_sequence(func)
        position = self.calls[func]
        self.calls[func] = position + 1
        cache = self.cache
        cache.check_position(func, position)
        if self.skippable is not None:
            skip = self.skippable.get((func, position))
            if skip is not None:
                shapes = tuple([t.shape for t in _input_tensors(args, kwargs)])
                if shapes != skip.input_shapes:
                    _raise_shape_mismatch(func, position, (args, tuple(kwargs.values())), skip.input_shapes)
                return _from_template(skip.template)
        if func not in cache.saved:     # no call of this op was saved (or the cache is released)
            return func(*args, **kwargs)
        saved = cache.take(func, position, args, self.consume)
        if saved is None or saved.is_stale():
            return func(*args, **kwargs)
        return saved.replay(args)

    def recompute_again(self) -> bool:
        """(``ckptlib.checkpoint`` protocol) A result this rerun skipped was needed after all:
        switch skipping off for every later rerun of this call, and say whether running the
        function again can help (only if something was skipped)."""
        if self.skippable is None:
            return False
        cache = self.cache
        cache.intact = False           # plan_for_rerun: no skipping from now on
        if cache.sequence is not None:
            cache.sequence = None      # a reused plan that skips too much: forget it
            if cache.on_mismatch is not None:
                cache.on_mismatch()
        return True

    def _check_sequence(self, func: OpOverload) -> None:
        """(a call reusing a plan) The rerun must run the ops of the call that recorded it.
        If not, the entries rebuilt from the saved tensors may belong to other calls: drop
        them all and run the function again as full checkpointing would."""
        step, sequence = self.step, self.sequence
        self.step = step + 1
        if step < len(sequence) and sequence[step] is func:
            return
        cache = self.cache
        cache.saved.clear()
        cache.passthrough = True
        cache.sequence = cache.skippable = None
        if cache.on_mismatch is not None:
            cache.on_mismatch()
        raise RecomputeAgain

    def __exit__(self, *exc_info):
        if not self.active:
            return False
        self.active = False
        if self.consume:
            self.cache.release()
        self.skippable = None
        self.sequence = None
        return super().__exit__(*exc_info)


# ---------------------------------------------------------------------------
# Reusing a plan: later calls with the same signature run forward with no mode
# ---------------------------------------------------------------------------


class _Plan(NamedTuple):
    """What a recording call learned, for later calls with the same signature.

    Every cached output a plan keeps is rebuilt from a tensor autograd saves anyway (the
    softmax's output is saved by the softmax, a clone by the ``bmm`` that reads it), so a
    later call needs no dispatch mode in forward: the checkpoint reports each saved tensor,
    and the ones the plan names become the cache. Outputs that no saved tensor holds are
    not kept by a reused plan (the rerun recomputes them; the skips are planned for that).
    """

    packs: tuple[tuple, ...]     # fingerprint of each saved tensor, in pack order
    rebuild: Mapping[int, tuple[tuple[tuple[OpOverload, int], int, torch.Size, tuple[int, ...], int], ...]]
    # saved tensor index -> (entry key, output slot, size, stride, storage offset) it holds
    entries: Mapping[tuple[OpOverload, int], tuple[type | None, int, tuple[torch.Size, ...]]]
    # entry key -> (tuple/list type, or None for one tensor; number of tensors; input shapes)
    skippable: Mapping[tuple[OpOverload, int], _Skip]
    calls: Mapping[OpOverload, int]
    sequence: tuple[OpOverload, ...]     # the counted ops, in order: what the rerun must run

    @classmethod
    def learn(cls, cache: _OpCache, graph: _OpGraph, sequence: tuple[OpOverload, ...]) -> "_Plan":
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
                    continue    # random: its replay sets the generator, which needs the forward mode
                if type(value) is torch.Tensor:
                    container, tensors = None, [value]
                elif isinstance(value, (tuple, list)) and value and all(type(t) is torch.Tensor for t in value):
                    container, tensors = type(value), list(value)
                else:
                    continue
                values = outputs.get(key)
                if values is None or len(values) != len(tensors):
                    continue
                picks = [first_pack.get(v) for v in values]
                if None in picks or any(graph.packs[i][1][1] != t.dtype for i, t in zip(picks, tensors)):
                    continue
                entries[key] = (container, len(tensors), saved.input_shapes)
                for slot, (index, tensor) in enumerate(zip(picks, tensors)):
                    rebuild.setdefault(index, []).append(
                        (key, slot, tensor.shape, tensor.stride(), tensor.storage_offset()))
        return cls(tuple(fingerprint for _, fingerprint in graph.packs),
                   {index: tuple(items) for index, items in rebuild.items()}, entries,
                   graph.unneeded_calls(set(entries)), dict(cache.calls), sequence)


class _PlannedForward:
    """Forward context of a call that reuses a plan: no dispatch mode. Each tensor autograd
    saves (reported by ``ckptlib.checkpoint``) is checked against the plan's fingerprint, and
    those holding cached outputs fill the cache. If the saved tensors differ from the plan's
    in any way, the call forgets the plan and reruns every op, like full checkpointing."""

    def __init__(self, plan: _Plan, cache: _OpCache, on_fallback: Callable[[], None]) -> None:
        self.plan, self.cache, self.on_fallback = plan, cache, on_fallback
        self.count = 0
        self.matches = True
        self.parts: dict[tuple[OpOverload, int], list] = {}
        self.first_node = 0

    def observe_saved_tensors(self) -> Callable[[torch.Tensor], None]:
        return self._observe

    def _observe(self, tensor: torch.Tensor) -> None:
        index = self.count
        self.count = index + 1
        if not self.matches:
            return
        packs = self.plan.packs
        if index >= len(packs) or _fingerprint(tensor, self.cache.input_storages, self.first_node) != packs[index]:
            self.matches = False
            self.parts.clear()
            return
        for key, slot, size, stride, offset in self.plan.rebuild.get(index, ()):
            view = tensor.detach()     # shares the version counter: a later in-place change shows
            if view.shape != size or view.stride() != stride or view.storage_offset() != offset:
                view = view.as_strided(size, stride, offset)
            slots = self.parts.get(key)
            if slots is None:
                slots = self.parts[key] = [None] * self.plan.entries[key][1]
            slots[slot] = (view, view._version)

    def __enter__(self) -> "_PlannedForward":
        self.first_node = _next_node_number()
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
                complete = False        # modified in place after it was saved: not the op's output
                continue
            container, _, input_shapes = plan.entries[key]
            tensors = [t for t, _ in slots]
            value = tensors[0] if container is None else container(tensors)
            cache.saved.setdefault(key[0], {})[key[1]] = _Saved(
                value, tuple(version for _, version in slots), input_shapes, False)
        self.parts.clear()
        cache.calls = Counter(plan.calls)
        cache.sequence = plan.sequence
        # Skips were planned with every entry present; without one, its op reruns, from
        # inputs the plan would have skipped: then skip nothing (replays stay correct).
        cache.skippable = plan.skippable if complete else None
        return False


def _signature(fn: Callable[..., Any], args: tuple, kwargs: dict, policy: Policy,
               replay_random: bool, early_stop: bool) -> tuple | None:
    """What must be equal for a call to reuse another's plan (``None``: never reuse): the
    policy, every input tensor's type, shape, strides, dtype, device and ``requires_grad``,
    the other arguments, the train/eval flags of a module's submodules, autocast, the
    deterministic-algorithms setting and the caller's dispatch modes and module hooks. The
    saved tensors of the call are checked as well."""
    try:
        policy_key = frozenset(policy) if isinstance(policy, (set, list, tuple)) else policy
        hash(policy_key)
        if kwargs or any(isinstance(a, (list, tuple, dict)) for a in args):
            leaves, spec = tree_flatten((args, kwargs))
            structure: Any = str(spec)
        else:
            leaves, structure = args, len(args)
        parts = tuple([(type(leaf), leaf.shape, leaf.stride(), leaf.dtype, leaf.device, leaf.requires_grad)
                       if isinstance(leaf, torch.Tensor) else (type(leaf), leaf) for leaf in leaves])
        hash(parts)
    except TypeError:     # an unhashable policy or argument
        return None
    module = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
    training = tuple([m.training for m in module.modules()]) if isinstance(module, torch.nn.Module) else ()
    return (policy_key, structure, parts, training, _autocast_state(), torch.are_deterministic_algorithms_enabled(),
            _ambient_tracing(), replay_random, early_stop)


def _ambient_tracing() -> tuple:
    """What else changes the nodes autograd makes: the caller's dispatch modes (under one, some
    ops decompose differently) and global module hooks (``FlopCounterMode`` tracks modules with
    autograd functions around each call)."""
    modes = tuple([type(mode) for mode in _dispatch_mode_stack()])
    hooks = torch.nn.modules.module
    return modes, len(hooks._global_forward_pre_hooks), len(hooks._global_forward_hooks)


_NO_PLAN = "no plan"    # SelectivePlans' mark for a signature given up on (a fallback or a mismatch)


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
    collected takes its plans with it.

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
        self.recorded = 0     # calls that recorded a plan
        self.reused = 0       # calls that ran forward with a recorded plan (fallbacks included)
        self.fallbacks = 0    # of those, calls whose saved tensors differed from the plan's
        self.mismatches = 0   # reruns that ran other ops than the plan's, or needed a skipped result

    def __len__(self) -> int:
        """The number of plans held (signatures given up on are not counted)."""
        return sum(plan is not _NO_PLAN for table in self._tables.values() for plan in table.values())

    def clear(self) -> None:
        """Forget every plan (the counters stay)."""
        self._tables.clear()

    def __repr__(self) -> str:
        count = len(self)
        return (f"SelectivePlans({count} plan{'s' if count != 1 else ''}: {self.recorded} recorded, "
                f"{self.reused} reused, {self.fallbacks} fallbacks, {self.mismatches} mismatches)")

    def contexts(self, fn: Callable[..., Any], args: tuple, kwargs: dict, policy: Policy, *,
                 replay_random: bool = True, early_stop: bool = True) -> tuple[Any, ReplaySavedOps]:
        """The ``(forward_context, recompute_context)`` for one call of ``fn``: a recorded
        plan's (no forward mode) if one fits, else :func:`selective_contexts` recording one."""
        # Inside the rerun of an enclosing checkpoint the inputs may be stand-ins for skipped
        # results: neither record nor reuse plans there.
        key = None if is_recomputing() else _signature(fn, args, kwargs, policy, replay_random, early_stop)
        table = None
        if key is not None:
            try:
                table = self._tables.setdefault(fn, {})
            except TypeError:      # fn cannot be weakly referenced (a builtin): no reuse
                table = None
        plan = table.get(key) if table is not None else None
        if plan is _NO_PLAN:
            return selective_contexts(policy, replay_random=replay_random)
        inputs = frozenset([p for p in map(_storage_key, _input_tensors(args, kwargs)) if p is not None])
        if plan is None:
            forward, recompute = selective_contexts(policy, replay_random=replay_random)
            if table is not None:
                forward.cache.plan_sink = functools.partial(self._learned, table, key)
                forward.cache.input_storages = inputs
            return forward, recompute
        self.reused += 1
        cache = _OpCache(replay_random)
        cache.input_storages = inputs
        cache.on_mismatch = functools.partial(self._mismatched, table, key)
        return _PlannedForward(plan, cache, functools.partial(self._fell_back, table, key)), ReplaySavedOps(cache)

    def _learned(self, table: dict, key: tuple, plan: _Plan) -> None:
        table[key] = plan
        self.recorded += 1

    def _fell_back(self, table: dict, key: tuple) -> None:
        table[key] = _NO_PLAN     # this signature's saved tensors vary: stop trying to reuse
        self.fallbacks += 1

    def _mismatched(self, table: dict, key: tuple) -> None:
        table[key] = _NO_PLAN
        self.mismatches += 1


def _is_parameter_cast(func: OpOverload, args: tuple) -> bool:
    """A cast of a leaf that requires grad (a parameter): what autocast caches per region, so
    forward and rerun need not both issue it. Such calls are left out of the positions."""
    return func is _TO_COPY and args[0].requires_grad and args[0].is_leaf


_TO_COPY = aten._to_copy.default


def _backward_frees_graph() -> bool:
    """True inside a backward pass that was not asked to ``retain_graph``."""
    return (torch._C._current_graph_task_id() != -1
            and not torch._C._autograd._get_current_graph_task_keep_graph())


def selective_contexts(policy: Policy, *, replay_random: bool = True,
                       skip_unneeded: bool = True) -> tuple[SaveChosenOps, ReplaySavedOps]:
    """A fresh ``(forward_context, recompute_context)`` pair sharing one empty cache.

    This is the ``context_fn`` protocol of ``torch.utils.checkpoint``, so the pair
    also works there: ``context_fn=functools.partial(selective_contexts, save_matmuls)``
    (without skipping unneeded ops: torch does not report what autograd saved).
    With ``ckptlib.checkpoint`` it is what :func:`selective_checkpoint` does.
    ``replay_random=False`` reruns random ops instead of replaying them (needed
    when the checkpoint does not replay the RNG state); ``skip_unneeded``: see
    :func:`selective_checkpoint`.

    >>> forward_mode, recompute_mode = selective_contexts(save_matmuls)
    >>> forward_mode.cache is recompute_mode.cache
    True
    """
    cache = _OpCache(replay_random)
    return SaveChosenOps(policy, cache, skip_unneeded=skip_unneeded), ReplaySavedOps(cache)


def selective_checkpoint(
    fn: Callable[..., Any],
    *args: Any,
    policy: Policy,
    preserve_rng_state: bool = True,
    early_stop: bool = True,
    debug: bool = False,
    skip_unneeded: bool = True,
    plans: SelectivePlans | None = None,
    **kwargs: Any,
) -> Any:
    """``ckptlib.checkpoint(fn, *args, **kwargs)`` that keeps the outputs of the ops ``policy`` chooses.

    Args:
        fn, args, kwargs: as for :func:`ckptlib.checkpoint`.
        policy: which ops to keep: a collection of aten ops (``save_matmuls``) or
            ``policy(op, *args, **kwargs) -> bool``, called in forward with each op and
            its inputs (``megatron_attention``, the result of :func:`policy_from_costs`).
            Every other op is recomputed in backward.
        preserve_rng_state, early_stop, debug: as for :func:`ckptlib.checkpoint`.
        skip_unneeded: in the rerun, skip the ops whose results nothing needs (those
            that only fed kept outputs; see the module notes). Turn it off for a
            function that hands tensor data to Python without an aten op in between
            (``t.numpy()``, ``t.tolist()``) and computes on from there: such a use is
            invisible to the op graph, and the rerun would fail on a skipped tensor
            (loudly: skipped results live on the meta device).
        plans: a :class:`SelectivePlans` to record this call's plan in, or to reuse one from:
            a later call with the same function and input signature then runs forward with
            no dispatch mode, at the cost of full checkpointing's forward. For functions
            that run the same ops on every call (see :class:`SelectivePlans` for the
            contract and what is checked). Needs ``skip_unneeded=True``.

    Gradients equal plain autograd bitwise; ``retain_graph=True`` works.

    >>> import torch
    >>> x = torch.randn(4, 8, requires_grad=True)
    >>> w = torch.randn(8, 8, requires_grad=True)
    >>> def block(inp):
    ...     return torch.nn.functional.dropout((inp @ w).relu(), 0.5) @ w
    >>> torch.manual_seed(0)
    <torch._C.Generator object at ...>
    >>> expected = torch.autograd.grad(block(x).sum(), w)[0]
    >>> torch.manual_seed(0)
    <torch._C.Generator object at ...>
    >>> selective_checkpoint(block, x, policy={torch.ops.aten.mm}).sum().backward()
    >>> torch.equal(w.grad, expected)
    True
    """
    if plans is not None and not isinstance(plans, SelectivePlans):
        raise TypeError(f"plans must be a SelectivePlans (or None), got {type(plans).__name__}.")
    if plans is not None and not skip_unneeded:
        raise ValueError("plans= needs skip_unneeded=True: a plan is learned from the op graph that "
                         "skipping records. Drop plans= for a function that needs skip_unneeded=False.")
    if plans is not None and torch.is_grad_enabled():
        forward_mode, recompute_mode = plans.contexts(fn, args, kwargs, policy, replay_random=preserve_rng_state,
                                                      early_stop=early_stop)
    else:
        forward_mode, recompute_mode = selective_contexts(policy, replay_random=preserve_rng_state,
                                                          skip_unneeded=skip_unneeded)
    return checkpoint(fn, *args, preserve_rng_state=preserve_rng_state, early_stop=early_stop,
                      debug=debug, context_fn=lambda: (forward_mode, recompute_mode), **kwargs)


# ---------------------------------------------------------------------------
# Ready policies
# ---------------------------------------------------------------------------

save_matmuls: frozenset[OpOverload] = frozenset({
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
})
"""Keep every matrix product. ``F.linear``, ``torch.matmul`` and ``@`` reach the
dispatcher as these four ops (``linear`` and ``matmul`` are decomposed before it).
The same ops as PyTorch's usual SAC example, so ``list(save_matmuls)`` can be
passed to ``create_selective_checkpoint_contexts`` for a side-by-side run."""

ATTENTION_CORE_OPS: frozenset[OpOverloadPacket] = frozenset({
    aten.bmm, aten.baddbmm,                       # q @ k^T and weights @ v
    aten._softmax, aten._safe_softmax,            # softmax over the scores
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_cudnn_attention,
})
"""The attention core by op: batched matmuls (in a Transformer only attention uses
them: a linear layer is ``mm``/``addmm`` on the flattened tokens), softmax, and
the fused attention kernels."""


def megatron_attention(op: OpOverload, *args: Any, **kwargs: Any) -> bool:
    """Keep everything except the attention core (Korthikanti et al. 2022, Megatron-LM).

    The core is recomputed: the ops in :data:`ATTENTION_CORE_OPS` (``q @ k^T``,
    softmax, ``weights @ v``, fused attention kernels) and every op that reads a
    *per-head* tensor, one with 4 or more dims (``batch x heads x seq x seq``
    scores, ``batch x heads x seq x d_head`` queries, keys and values): the
    scaling, the causal mask, the attention dropout and the copies made for the
    batched matmuls. Everything else is kept: layer norms, linear layers, GELU,
    residual adds and the residual dropouts, all on ``batch x seq x d_model``
    tensors. The saved memory is the ``O(seq^2)`` scores; the price is the
    attention's share of the flops, small when ``d_model`` is large. It keeps a
    lot (every output outside the core, even ones autograd itself would not
    save), so it pays off where the scores dominate: long sequences, many heads.

    Written for Transformers: in a model with other 4-d tensors (images), the
    dims rule also recomputes those.

    >>> scores = torch.zeros(2, 4, 16, 16)
    >>> megatron_attention(torch.ops.aten._softmax.default, scores, -1, False)
    False
    >>> megatron_attention(torch.ops.aten.addmm.default, torch.zeros(8), torch.zeros(4, 8), torch.zeros(8, 8))
    True
    """
    if op.overloadpacket in ATTENTION_CORE_OPS:
        return False
    return all(t.dim() < 4 for t in _tensors((args, tuple(kwargs.values()))))


# ---------------------------------------------------------------------------
# A policy from measurements: time saved per byte kept
# ---------------------------------------------------------------------------
#
# An op type is too coarse a unit: in a Transformer block the four linears are
# all aten.addmm, yet fc2 (1024 -> 256) does four times the flops per byte
# of output of the others, and the last op before the end of the block is never
# rerun at all (early stop ends the recomputation at the last saved tensor).
# So costs are kept per *call signature*: the op and the shapes of its tensor
# inputs. The blocks of a model share their signatures, so one block's profile
# is a policy for all of them.


class OpCall(NamedTuple):
    """An op and the shapes of its tensor inputs: the unit a cost policy saves."""

    op: OpOverload
    input_shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, op: OpOverload, args: tuple) -> "OpCall":
        return cls(op, tuple(tuple(shape) for shape in _shapes(args)))

    def __str__(self) -> str:
        shapes = ", ".join("x".join(map(str, shape)) or "scalar" for shape in self.input_shapes)
        return f"{self.op}({shapes})"


@dataclass(frozen=True)
class OpCost:
    """What caching the outputs of one call signature would cost and save, per forward pass."""

    calls: int
    time_s: float        # time of the calls a recomputation would run: what replaying them saves
    output_bytes: int    # what caching their outputs would keep alive

    @property
    def seconds_per_byte(self) -> float:
        return self.time_s / self.output_bytes if self.output_bytes else 0.0


@dataclass(frozen=True)
class CostProfile:
    """Per call signature costs of one function, and the bytes plain autograd saves for it."""

    ops: Mapping[OpCall, OpCost]
    activation_bytes: int   # what autograd saves in a plain forward (what full checkpointing drops)
    # The measured run's op graph (per-call times) and, per signature, its calls' keys: what
    # choose_ops needs to count the calls a rerun can skip. None for a hand-made profile.
    graph: "_OpGraph | None" = field(default=None, repr=False, compare=False)
    keys: Mapping[OpCall, tuple[tuple[OpOverload, int], ...]] = field(default_factory=dict, repr=False,
                                                                      compare=False)

    def __str__(self) -> str:
        rows = [f"{'op and input shapes':64s} {'calls':>5s} {'ms':>7s} {'MiB':>7s} {'ms/MiB':>7s}"]
        for call, cost in sorted(self.ops.items(), key=lambda item: (-item[1].time_s, str(item[0]))):
            rows.append(f"{str(call)[:64]:64s} {cost.calls:5d} {cost.time_s * 1e3:7.2f} "
                        f"{cost.output_bytes / 2**20:7.2f} {cost.seconds_per_byte * 2**20 * 1e3:7.2f}")
        rows.append(f"activations saved by plain autograd: {self.activation_bytes / 2**20:.2f} MiB")
        return "\n".join(rows)


@dataclass(frozen=True)
class CostPolicy:
    """Save exactly the chosen call signatures (a policy for :func:`selective_checkpoint`)."""

    chosen: frozenset[OpCall]
    budget_bytes: int
    used_bytes: int

    def __call__(self, op: OpOverload, *args: Any, **kwargs: Any) -> bool:
        return op in self._ops and OpCall.of(op, args) in self.chosen

    @functools.cached_property
    def _ops(self) -> frozenset[OpOverload]:
        return frozenset(call.op for call in self.chosen)

    def __str__(self) -> str:
        calls = "".join(f"\n  {call}" for call in sorted(map(str, self.chosen)))
        return f"CostPolicy: {self.used_bytes} of {self.budget_bytes} bytes, saving{calls or ' nothing'}"


class _OpTimer(TorchDispatchMode):
    """Times every op call, counts the bytes its cache entry would hold, and records the op
    graph (which calls a rerun could skip)."""

    _should_skip_dynamo = SaveChosenOps._should_skip_dynamo

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[OpCall, tuple[OpOverload, int], float, int, int]] = []
        # (signature, key, seconds, bytes, packs before it), for calls a cache entry could replay
        self.created: set[int] = set()     # storages made inside the function
        self.saved_storages: dict[int, int] = {}
        self.packs = 0
        self.positions: Counter[OpOverload] = Counter()
        self.graph = _OpGraph()
        self.packs_before: list[int] = []   # per recorded graph call
        self.returned: set[int] = set()     # storages of the function's output (set by finish)

    def count_saved(self, tensor: torch.Tensor) -> torch.Tensor:
        """Pack hook: autograd saves ``tensor`` (kept as is; counted once per storage)."""
        storage = tensor.untyped_storage()
        self.saved_storages[storage.data_ptr()] = storage.nbytes()
        self.packs += 1
        self.graph.note_saved(tensor)
        return tensor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packs_before = self.packs
        start = time.perf_counter()
        output = func(*args, **kwargs)
        elapsed_s = time.perf_counter() - start
        self.created |= _storages(output)
        kind = _op_kind(func)
        if kind == _VIEW or _is_parameter_cast(func, args):
            return output
        position = self.positions[func]
        self.positions[func] = position + 1
        recorded = len(self.graph.calls)
        self.graph.record(func, position, kind, args, kwargs, output, seconds=elapsed_s)
        if len(self.graph.calls) > recorded:
            self.packs_before.append(packs_before)
        if kind in _CACHEABLE_KINDS:
            saved = _save(func, kind, args, kwargs, output, replay_random=True)
            if saved is not None:
                self.records.append((OpCall.of(func, args), (func, position), elapsed_s, saved.nbytes, packs_before))
        return output

    def finish(self, output: Any) -> None:
        """The function returned ``output``: mark the calls a rerun never reaches (they start
        after the last saved tensor: early stop), and the bytes that cost nothing to cache
        (the output's own storages, alive anyway)."""
        self.graph.calls = [call._replace(reached=before < self.packs)
                            for call, before in zip(self.graph.calls, self.packs_before)]
        self.returned = {p for p in map(_storage_key, _tensors(output)) if p is not None}

    def costs(self) -> tuple[dict[OpCall, OpCost], dict[OpCall, tuple[tuple[OpOverload, int], ...]]]:
        """Per call signature: calls, time of the calls a rerun reaches, bytes of the outputs
        (not counting the function's own output), and the calls' keys."""
        calls, time_s, output_bytes, keys = Counter(), Counter(), Counter(), {}
        for call, key, elapsed_s, nbytes, packs_before in self.records:
            calls[call] += 1
            keys[call] = keys.get(call, ()) + (key,)
            output_bytes[call] += 0 if key in self._returned_keys else nbytes
            time_s[call] += elapsed_s if packs_before < self.packs else 0.0
        return {call: OpCost(calls[call], time_s[call], output_bytes[call]) for call in calls}, keys

    @functools.cached_property
    def _returned_keys(self) -> set[tuple[OpOverload, int]]:
        # The calls whose output storage is the function's output (the value still current there).
        returned_values = {self.graph.current[p] for p in self.returned if p in self.graph.current}
        return {call.key for call in self.graph.calls if not returned_values.isdisjoint(call.outputs)}


def measure_op_costs(fn: Callable[..., Any], *args: Any, repeats: int = 3, **kwargs: Any) -> CostProfile:
    """Run ``fn(*args, **kwargs)`` with autograd, as in training, ``1 + repeats`` times and
    measure per call signature the time (median over the repeats; the first run warms up)
    and the bytes of the outputs; and the bytes autograd saves. The profile also keeps the
    op graph of the last run, with each call's median time, for :func:`choose_ops`.

    >>> x = torch.randn(64, 64, requires_grad=True)
    >>> profile = measure_op_costs(lambda t: (t @ t).relu(), x, repeats=1)
    >>> [str(call) for call in profile.ops]
    ['aten.mm.default(64x64, 64x64)', 'aten.relu.default(64x64)']
    >>> profile.ops[OpCall(torch.ops.aten.mm.default, ((64, 64), (64, 64)))].output_bytes
    16384
    >>> profile.activation_bytes    # relu's output; x is an input, not an activation
    16384
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}.")
    runs, graphs = [], []
    for _ in range(1 + repeats):
        timer = _OpTimer()
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(timer.count_saved, _identity), timer:
            output = fn(*args, **kwargs)
        timer.finish(output)
        # `output` keeps the graph alive, so no saved storage was freed and its address reused.
        activation_bytes = sum(n for ptr, n in timer.saved_storages.items() if ptr in timer.created)
        del output
        runs.append(timer.costs())
        graphs.append(timer.graph)
    timed, timed_graphs = runs[1:], graphs[1:]
    last, keys = timed[-1]
    ops = {call: OpCost(cost.calls, statistics.median(run[call].time_s for run, _ in timed), cost.output_bytes)
           for call, cost in last.items()}
    graph = timed_graphs[-1]
    graph.calls = [call._replace(seconds=statistics.median(g.calls[i].seconds for g in timed_graphs))
                   for i, call in enumerate(graph.calls)]
    return CostProfile(ops, activation_bytes, graph, keys)


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def choose_ops(profile: CostProfile, budget_bytes: int, *, worth: float = 1.0) -> CostPolicy:
    """The call signatures to keep: most recomputation time saved per byte first, while their
    outputs fit in ``budget_bytes``. Pure and deterministic: ties go by name; calls that save
    no time are never kept.

    With the op graph of :func:`measure_op_costs`, the time a choice saves is counted on the
    graph: keeping the softmax's output also saves the ``q @ k^T``, scaling and masking that
    only fed it, since the rerun skips them. Such savings only appear for a *set* of outputs
    (keeping ``q``, ``k`` and ``v`` makes the projection before them unneeded, keeping one of
    them does not), so each step weighs single signatures and pairs, and takes the best time
    saved per byte. A hand-made profile without a graph counts each signature's own time.
    On the graph, a choice must also be worth its bytes: save at least ``worth`` times the
    full rerun's average time per activation byte (what checkpointing pays per byte it
    frees). Below that, recomputing is the better deal, however much budget is left;
    ``worth=0`` fills the budget.

    >>> mm, gelu, add = (OpCall(op, ((8, 8),)) for op in (aten.mm.default, aten.gelu.default, aten.add.Tensor))
    >>> profile = CostProfile({mm: OpCost(4, 0.040, 4000), gelu: OpCost(2, 0.004, 4000),
    ...                        add: OpCost(2, 0.001, 2000)}, activation_bytes=12000)
    >>> print(choose_ops(profile, budget_bytes=6000))
    CostPolicy: 6000 of 6000 bytes, saving
      aten.add.Tensor(8x8)
      aten.mm.default(8x8)
    """
    if profile.graph is None:
        ranked = sorted(profile.ops.items(), key=lambda item: (-item[1].seconds_per_byte, str(item[0])))
        chosen, used_bytes = set(), 0
        for call, cost in ranked:
            if cost.time_s > 0 and used_bytes + cost.output_bytes <= budget_bytes:
                chosen.add(call)
                used_bytes += cost.output_bytes
        return CostPolicy(frozenset(chosen), budget_bytes, used_bytes)
    return _choose_on_graph(profile, budget_bytes, worth)


def _choose_on_graph(profile: CostProfile, budget_bytes: int, worth: float) -> CostPolicy:
    graph = profile.graph
    assert graph is not None
    full_rerun_s = graph.rerun_seconds(())
    threshold = worth * full_rerun_s / profile.activation_bytes if profile.activation_bytes else 0.0
    names = {call: str(call) for call in profile.ops}
    candidates = sorted((call for call in profile.ops if call in profile.keys), key=names.__getitem__)

    def rerun_seconds(chosen: frozenset[OpCall]) -> float:
        return graph.rerun_seconds({key for call in chosen for key in profile.keys[call]})

    chosen: frozenset[OpCall] = frozenset()
    used_bytes, current_s = 0, rerun_seconds(chosen)
    while True:
        best = None
        remaining = [call for call in candidates if call not in chosen
                     and used_bytes + profile.ops[call].output_bytes <= budget_bytes]
        moves = [(call,) for call in remaining] + list(itertools.combinations(remaining, 2))
        for move in moves:
            extra_bytes = sum(profile.ops[call].output_bytes for call in move)
            if used_bytes + extra_bytes > budget_bytes:
                continue
            saved_s = current_s - rerun_seconds(chosen | frozenset(move))
            if saved_s <= 1e-9 * max(full_rerun_s, 1e-9) or saved_s < threshold * extra_bytes:
                continue
            # time per byte; a free move (bytes 0) first; ties by size of move, then names
            score = (saved_s / extra_bytes if extra_bytes else math.inf, -len(move),
                     [names[call] for call in move])
            if best is None or (score[0], score[1]) > (best[0][0], best[0][1]) or (
                    (score[0], score[1]) == (best[0][0], best[0][1]) and score[2] < best[0][2]):
                best = (score, move, extra_bytes)
        if best is None:
            break
        _, move, extra_bytes = best
        chosen |= frozenset(move)
        used_bytes += extra_bytes
        current_s = rerun_seconds(chosen)
    return CostPolicy(chosen, budget_bytes, used_bytes)


def policy_from_costs(fn: Callable[..., Any], *args: Any, memory_ratio: float | None = None,
                      budget_bytes: int | None = None, repeats: int = 3, worth: float = 1.0,
                      **kwargs: Any) -> CostPolicy:
    """Measure ``fn`` (:func:`measure_op_costs`) and keep the call signatures that save the
    most recomputation time per byte, within a byte budget: ``budget_bytes``, or
    ``memory_ratio`` times the activations plain autograd saves for ``fn`` (``0.4``: cache
    at most 40% of what full checkpointing drops). Give exactly one of the two. ``worth``:
    see :func:`choose_ops`.

    Profile one block with its real input; the policy then serves every block of that shape.

    >>> x = torch.randn(64, 64, requires_grad=True)
    >>> policy = policy_from_costs(lambda t: (t @ t).relu(), x, memory_ratio=1.0, repeats=1)
    >>> len(policy.chosen)   # relu's output is the one activation: room for mm's or relu's, not both
    1
    """
    if (memory_ratio is None) == (budget_bytes is None):
        raise ValueError("policy_from_costs needs exactly one budget: memory_ratio (a fraction of the "
                         "activations plain autograd saves) or budget_bytes.")
    if memory_ratio is not None and not (0 <= memory_ratio and math.isfinite(memory_ratio)):
        raise ValueError(f"memory_ratio must be a finite number >= 0, got {memory_ratio}.")
    profile = measure_op_costs(fn, *args, repeats=repeats, **kwargs)
    if budget_bytes is None:
        budget_bytes = int(memory_ratio * profile.activation_bytes)
    return choose_ops(profile, budget_bytes, worth=worth)
