"""A policy from measurements: keep the op outputs that save the most recomputation time per byte.

Design notes
============

The unit. An op type is too coarse a unit: in a Transformer block the four
linears are all ``aten.addmm``, yet fc2 (1024 -> 256) does four times the flops
per byte of output of the others, and the last op before the end of the block
is never rerun at all (early stop ends the recomputation at the last saved
tensor). So costs are kept per *call signature* (:class:`OpCall`): the op and
the shapes of its tensor inputs. The blocks of a model share their signatures,
so one block's profile is a policy for all of them.

Measuring (:func:`measure_op_costs`). One dispatch mode times every op call
while a pack hook counts what autograd saves, and the op graph of the forward
(:mod:`ckptlib.selective.opgraph`) is recorded with each call's time, so a
choice can be priced the way the rerun will run it: without the calls it
replays, the calls it can then skip, and the calls after the early stop.

Choosing (:func:`choose_ops`). Greedy by time saved per byte, within a byte
budget. On the graph, keeping a *set* of outputs can save more than its parts
(keeping ``q``, ``k`` and ``v`` makes the projection before them unneeded), so
each step weighs single signatures and pairs. A choice must also be worth its
bytes: save at least what full checkpointing pays per byte it frees.
"""

from __future__ import annotations

import functools
import itertools
import math
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple

import torch
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode

from ckptlib._arguments import integer, number
from ckptlib.selective.cache import make_entry
from ckptlib.selective.modes import SaveChosenOps
from ckptlib.selective.opgraph import OpGraph
from ckptlib.selective.ops import (
    CACHEABLE_KINDS,
    VIEW,
    is_parameter_cast,
    op_kind,
    shapes_of,
    storages_of,
    tensors_of,
)
from ckptlib.core.checks import storage_ptr

aten = torch.ops.aten


class OpCall(NamedTuple):
    """An op and the shapes of its tensor inputs: the unit a cost policy saves."""

    op: OpOverload
    input_shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, op: OpOverload, args: tuple) -> "OpCall":
        return cls(op, tuple(tuple(shape) for shape in shapes_of(args)))

    def __str__(self) -> str:
        shapes = ", ".join("x".join(map(str, shape)) or "scalar" for shape in self.input_shapes)
        return f"{self.op}({shapes})"


@dataclass(frozen=True)
class OpCost:
    """What caching the outputs of one call signature would cost and save, per forward pass."""

    calls: int
    time_s: float  # time of the calls a recomputation would run: what replaying them saves
    output_bytes: int  # what caching their outputs would keep alive

    @property
    def seconds_per_byte(self) -> float:
        return self.time_s / self.output_bytes if self.output_bytes else 0.0


@dataclass(frozen=True)
class CostProfile:
    """Per call signature costs of one function, and the bytes plain autograd saves for it."""

    ops: Mapping[OpCall, OpCost]
    activation_bytes: int  # what autograd saves in a plain forward (what full checkpointing drops)
    # The measured run's op graph (per-call times) and, per signature, its calls' keys: what
    # choose_ops needs to count the calls a rerun can skip. None for a hand-made profile.
    graph: "OpGraph | None" = field(default=None, repr=False, compare=False)
    keys: Mapping[OpCall, tuple[tuple[OpOverload, int], ...]] = field(
        default_factory=dict, repr=False, compare=False
    )

    def __str__(self) -> str:
        rows = [f"{'op and input shapes':64s} {'calls':>5s} {'ms':>7s} {'MiB':>7s} {'ms/MiB':>7s}"]
        for call, cost in sorted(
            self.ops.items(), key=lambda item: (-item[1].time_s, str(item[0]))
        ):
            rows.append(
                f"{str(call)[:64]:64s} {cost.calls:5d} {cost.time_s * 1e3:7.2f} "
                f"{cost.output_bytes / 2**20:7.2f} {cost.seconds_per_byte * 2**20 * 1e3:7.2f}"
            )
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
        return (
            f"CostPolicy: {self.used_bytes} of {self.budget_bytes} bytes, "
            f"saving{calls or ' nothing'}"
        )


class _OpTimer(TorchDispatchMode):
    """Times every op call, counts the bytes its cache entry would hold, and records the op
    graph (which calls a rerun could skip)."""

    _should_skip_dynamo = SaveChosenOps._should_skip_dynamo

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[OpCall, tuple[OpOverload, int], float, int, int]] = []
        # (signature, key, seconds, bytes, packs before it), for calls a cache entry could replay
        self.created: set[int] = set()  # storages made inside the function
        self.saved_storages: dict[int, int] = {}
        self.packs = 0
        self.positions: Counter[OpOverload] = Counter()
        self.graph = OpGraph()
        self.packs_before: list[int] = []  # per recorded graph call
        self.returned: set[int] = set()  # storages of the function's output (set by finish)

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
        kind = op_kind(func)
        if (
            kind == VIEW
        ):  # allocates nothing: weight.t() is the parameter's own memory, not an activation
            return output
        self.created |= storages_of(output)
        if is_parameter_cast(func, args):
            return output
        position = self.positions[func]
        self.positions[func] = position + 1
        recorded = len(self.graph.calls)
        self.graph.record(func, position, kind, args, kwargs, output, seconds=elapsed_s)
        if len(self.graph.calls) > recorded:
            self.packs_before.append(packs_before)
        if kind in CACHEABLE_KINDS:
            saved = make_entry(func, kind, args, kwargs, output, replay_random=True)
            if saved is not None:
                self.records.append(
                    (OpCall.of(func, args), (func, position), elapsed_s, saved.nbytes, packs_before)
                )
        return output

    def finish(self, output: Any) -> None:
        """The function returned ``output``: mark the calls a rerun never reaches (they start
        after the last saved tensor: early stop), and the bytes that cost nothing to cache
        (the output's own storages, alive anyway)."""
        self.graph.calls = [
            call._replace(reached=before < self.packs)
            for call, before in zip(self.graph.calls, self.packs_before)
        ]
        self.returned = {p for p in map(storage_ptr, tensors_of(output)) if p is not None}

    def costs(
        self,
    ) -> tuple[dict[OpCall, OpCost], dict[OpCall, tuple[tuple[OpOverload, int], ...]]]:
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
        return {
            call.key for call in self.graph.calls if not returned_values.isdisjoint(call.outputs)
        }


def measure_op_costs(
    fn: Callable[..., Any], *args: Any, repeats: int = 3, **kwargs: Any
) -> CostProfile:
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
    _check_callable("measure_op_costs", fn)
    integer(repeats, "repeats", least=1, where="measure_op_costs", range_apart=True)
    runs, graphs = [], []
    for _ in range(1 + repeats):
        timer = _OpTimer()
        with (
            torch.enable_grad(),
            torch.autograd.graph.saved_tensors_hooks(timer.count_saved, _identity),
            timer,
        ):
            output = fn(*args, **kwargs)
        timer.finish(output)
        # `output` keeps the graph alive, so no saved storage was freed and its address reused.
        activation_bytes = sum(n for ptr, n in timer.saved_storages.items() if ptr in timer.created)
        del output
        runs.append(timer.costs())
        graphs.append(timer.graph)
    timed, timed_graphs = runs[1:], graphs[1:]
    last, keys = timed[-1]
    ops = {
        call: OpCost(
            cost.calls, statistics.median(run[call].time_s for run, _ in timed), cost.output_bytes
        )
        for call, cost in last.items()
    }
    graph = timed_graphs[-1]
    graph.calls = [
        call._replace(seconds=statistics.median(g.calls[i].seconds for g in timed_graphs))
        for i, call in enumerate(graph.calls)
    ]
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

    >>> ops = (aten.mm.default, aten.gelu.default, aten.add.Tensor)
    >>> mm, gelu, add = (OpCall(op, ((8, 8),)) for op in ops)
    >>> profile = CostProfile({mm: OpCost(4, 0.040, 4000), gelu: OpCost(2, 0.004, 4000),
    ...                        add: OpCost(2, 0.001, 2000)}, activation_bytes=12000)
    >>> print(choose_ops(profile, budget_bytes=6000))
    CostPolicy: 6000 of 6000 bytes, saving
      aten.add.Tensor(8x8)
      aten.mm.default(8x8)
    """
    if not isinstance(profile, CostProfile):
        raise TypeError(
            f"choose_ops: profile must be a CostProfile (what measure_op_costs returns), "
            f"got {type(profile).__name__}."
        )
    _check_budget("choose_ops", budget_bytes, worth)
    if profile.graph is None:
        ranked = sorted(
            profile.ops.items(), key=lambda item: (-item[1].seconds_per_byte, str(item[0]))
        )
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
    candidates = sorted(
        (call for call in profile.ops if call in profile.keys), key=names.__getitem__
    )

    def rerun_seconds(chosen: frozenset[OpCall]) -> float:
        return graph.rerun_seconds({key for call in chosen for key in profile.keys[call]})

    chosen: frozenset[OpCall] = frozenset()
    used_bytes, current_s = 0, rerun_seconds(chosen)
    while True:
        best = None
        remaining = [
            call
            for call in candidates
            if call not in chosen and used_bytes + profile.ops[call].output_bytes <= budget_bytes
        ]
        moves = [(call,) for call in remaining] + list(itertools.combinations(remaining, 2))
        for move in moves:
            extra_bytes = sum(profile.ops[call].output_bytes for call in move)
            if used_bytes + extra_bytes > budget_bytes:
                continue
            saved_s = current_s - rerun_seconds(chosen | frozenset(move))
            if saved_s <= 1e-9 * max(full_rerun_s, 1e-9) or saved_s < threshold * extra_bytes:
                continue
            # time per byte; a free move (bytes 0) first; ties by size of move, then names
            score = (
                saved_s / extra_bytes if extra_bytes else math.inf,
                -len(move),
                [names[call] for call in move],
            )
            if (
                best is None
                or (score[0], score[1]) > (best[0][0], best[0][1])
                or ((score[0], score[1]) == (best[0][0], best[0][1]) and score[2] < best[0][2])
            ):
                best = (score, move, extra_bytes)
        if best is None:
            break
        _, move, extra_bytes = best
        chosen |= frozenset(move)
        used_bytes += extra_bytes
        current_s = rerun_seconds(chosen)
    return CostPolicy(chosen, budget_bytes, used_bytes)


def policy_from_costs(
    fn: Callable[..., Any],
    *args: Any,
    memory_ratio: float | None = None,
    budget_bytes: int | None = None,
    repeats: int = 3,
    worth: float = 1.0,
    **kwargs: Any,
) -> CostPolicy:
    """Measure ``fn`` (:func:`measure_op_costs`) and keep the call signatures that save the
    most recomputation time per byte, within a byte budget: ``budget_bytes``, or
    ``memory_ratio`` times the activations plain autograd saves for ``fn`` (``0.4``: cache
    at most 40% of what full checkpointing drops). Give exactly one of the two. ``worth``:
    see :func:`choose_ops`.

    Profile one block with its real input; the policy then serves every block of that shape.

    >>> x = torch.randn(64, 64, requires_grad=True)
    >>> policy = policy_from_costs(lambda t: (t @ t).relu(), x, memory_ratio=1.0, repeats=1)
    >>> # relu's output is the one activation: room for mm's or relu's, not both
    >>> len(policy.chosen)
    1
    """
    _check_callable("policy_from_costs", fn)
    if (memory_ratio is None) == (budget_bytes is None):
        raise ValueError(
            "policy_from_costs needs exactly one budget: memory_ratio (a fraction of the "
            "activations plain autograd saves) or budget_bytes."
        )
    if memory_ratio is not None:
        number(
            memory_ratio,
            "memory_ratio",
            least=0,
            note="a fraction of the activations plain autograd saves, e.g. 0.5",
            where="policy_from_costs",
            range_apart=True,
        )
    _check_budget("policy_from_costs", 0 if budget_bytes is None else budget_bytes, worth)
    integer(repeats, "repeats", least=1, where="policy_from_costs", range_apart=True)
    profile = measure_op_costs(fn, *args, repeats=repeats, **kwargs)
    if budget_bytes is None:
        budget_bytes = int(memory_ratio * profile.activation_bytes)
    return choose_ops(profile, budget_bytes, worth=worth)


def _check_callable(where: str, fn: Any) -> None:
    if not callable(fn):
        raise TypeError(
            f"{where}: fn must be the function or module to measure, got {type(fn).__name__}."
        )


def _check_budget(where: str, budget_bytes: Any, worth: Any) -> None:
    integer(
        budget_bytes,
        "budget_bytes",
        least=0,
        unit="number of bytes",
        where=where,
        range_apart=True,
    )
    number(
        worth,
        "worth",
        least=0,
        note="how many times full checkpointing's time per byte a kept output must "
        "save; 0 fills the budget",
        where=where,
        range_apart=True,
    )
