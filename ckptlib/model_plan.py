"""Which modules of a model to checkpoint for a memory budget: measured exactly, chosen exactly.

Design notes
============

Measure (one forward pass each, nothing timed). For every candidate module (by
default the repeated layers, as ``apply_checkpointing`` chooses them):

* *bytes dropped*: the storages autograd saves for the module's backward that
  the module itself made (counted by a pack hook, each storage once). Its
  inputs, parameters, buffers and its output are left out: a checkpoint keeps
  the inputs, and the output lives on as the next module's input, so dropping
  those would free nothing;
* *bytes kept*: the storages of its tensor inputs, which a checkpoint keeps to
  rerun from (usually saved anyway by the module's first op);
* *rerun cost*: the FLOPs of its forward (``torch.utils.flop_counter``), what a
  checkpoint pays again in backward. FLOPs count matrix products and attention,
  not elementwise ops; they are the same on every run and every machine, so the
  same model and inputs always give the same plan (a plan picked by timing would
  change with the machine's load).

Model of memory. Plain autograd keeps ``saved_bytes`` (all storages saved in the
forward, parameters excluded). Checkpointing a set ``S`` keeps
``saved_bytes - sum(dropped[i] for i in S)`` (plus the few inputs, such as a mask,
that only the checkpoint keeps), and in backward one rerun at a time brings a
module's activations back: ``peak = saved_bytes - sum(dropped) + max(dropped)``.
That is an upper bound (when backward reruns a module, the later modules'
activations are already freed), so a plan that fits it fits.

Solve (exact). The fastest plan is the set ``S`` with the least rerun FLOPs
whose peak fits. For each candidate value ``t`` of ``max(dropped)``, the modules
with ``dropped <= t`` form a covering knapsack: drop at least
``saved_bytes + t - budget`` bytes at the least FLOPs. It is solved exactly by
a Pareto frontier: go through the modules in order; each either stays or is
checkpointed; keep only the (bytes dropped, FLOPs) pairs no other pair beats on
both. Identical layers give few distinct pairs, so the frontier stays small. Ties
go to fewer modules, then to the earliest ones.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn as nn

from ckptlib._arguments import integer
from ckptlib.core.checks import storage_ptr, storage_ptrs
from ckptlib.memory.allocations import storage_bytes
from ckptlib.apply import Selector, selected_modules
from ckptlib.step_plan import StepPlan, call_model, plan_step_peak

__all__ = ["plan_checkpointing", "ModelPlan", "ModuleCost", "StepPlan"]


@dataclass(frozen=True)
class ModuleCost:
    """What checkpointing one module would change: bytes it drops and keeps, FLOPs it reruns."""

    path: str
    dropped_bytes: int
    kept_bytes: int
    rerun_flops: int
    # inputs plain autograd does not save (a mask, position ids) but a checkpoint keeps:
    # (storage number, bytes), numbered in the order first met so that layers sharing one count it
    # once
    unsaved_inputs: frozenset[tuple[int, int]] = frozenset()


@dataclass(frozen=True)
class ModelPlan:
    """A choice of modules to checkpoint, and what it is predicted to keep. Apply it with
    ``ckptlib.apply_checkpointing(model, plan)``; ``print(plan)`` shows the table."""

    costs: tuple[ModuleCost, ...]
    checkpointed: tuple[str, ...]
    saved_bytes: int            # what plain autograd keeps for backward (parameters excluded)
    budget_bytes: int
    forward_flops: int

    def module_paths(self) -> tuple[str, ...]:
        return self.checkpointed

    @property
    def peak_bytes(self) -> int:
        """Predicted: kept after forward, plus the largest module one rerun brings back."""
        chosen = [c for c in self.costs if c.path in self.checkpointed]
        return _peak(self.saved_bytes, [c.dropped_bytes for c in chosen]) + _unsaved_bytes(chosen)

    @property
    def kept_bytes(self) -> int:
        """Predicted bytes autograd keeps at the end of the forward pass under this plan."""
        chosen = [c for c in self.costs if c.path in self.checkpointed]
        return self.saved_bytes - sum(c.dropped_bytes for c in chosen) + _unsaved_bytes(chosen)

    @property
    def rerun_flops(self) -> int:
        return sum(c.rerun_flops for c in self.costs if c.path in self.checkpointed)

    def __str__(self) -> str:
        width = max(len("module"), *(len(c.path) for c in self.costs))
        lines = [f"{'module':<{width}}  checkpointed  {'bytes kept':>12}  "
                 f"{'bytes dropped':>13}  {'rerun FLOPs':>12}"]
        for cost in self.costs:
            mark = "yes" if cost.path in self.checkpointed else "-"
            lines.append(f"{cost.path:<{width}}  {mark:^12}  {cost.kept_bytes:>12,}  "
                         f"{cost.dropped_bytes:>13,}  {cost.rerun_flops:>12,}")
        share = self.rerun_flops / self.forward_flops if self.forward_flops else 0.0
        lines.append(f"activations kept for backward (not the step's peak: plan with "
                     f"peak_bytes= for that): plain autograd keeps {self.saved_bytes:,} bytes; "
                     f"this plan {self.kept_bytes:,} after forward, "
                     f"peak {self.peak_bytes:,} <= budget {self.budget_bytes:,}; "
                     f"reruns {self.rerun_flops:,} FLOPs ({share:.0%} of the forward)")
        return "\n".join(lines)


def plan_checkpointing(model: nn.Module, example_inputs: Any, *, peak_bytes: int | None = None,
                       budget_bytes: int | None = None, select: Selector = None,
                       hows: Any = None, loss_fn: Any = None,
                       optimizer_state_bytes: int = 0) -> ModelPlan | StepPlan:
    """How to checkpoint ``model``'s repeated modules for a memory budget, at the least cost.

    Two budgets, give one:

    * ``peak_bytes``: the peak of one whole training step (forward, loss, backward, the
      gradients), as ckptlib's meter measures it on the model's device, plus
      ``optimizer_state_bytes``: the number a device's memory must hold. Per module the plan
      keeps it, checkpoints it fully or with a selective policy, or offloads it (on a GPU),
      for the least measured time; it runs the chosen plan once under the meter and records the
      measured peak and where it happened. Returns a :class:`~ckptlib.step_plan.StepPlan`
      (design notes in :mod:`ckptlib.step_plan`).
    * ``budget_bytes``: only what autograd keeps for backward (parameters, gradients, logits'
      gradient and temporaries not counted), full checkpoints only, at the least rerun FLOPs,
      from two forward passes and no timing. Returns a :class:`ModelPlan`.

    Args:
        model: any ``nn.Module``; the planner runs it on ``example_inputs`` (the caller's RNG
            and gradients untouched).
        example_inputs: a dict of keyword arguments
            (``{"input_ids": ..., "attention_mask": ...}``), a tuple of positional ones, or one
            tensor: a batch like the training batches.
        select: the candidate modules, as for :func:`ckptlib.apply_checkpointing` (default: every
            repeated stack).
        hows, loss_fn, optimizer_state_bytes: for ``peak_bytes`` only, see
            :func:`ckptlib.step_plan.plan_step_peak`.

    Raises ValueError when no plan fits, naming the least peak (or kept bytes) reached.

    >>> import ckptlib
    >>> model = ckptlib.TinyTransformer(depth=4, d_model=32, seq=16)
    >>> tokens, _ = model.example_batch(batch=2)
    >>> everything = ckptlib.plan_checkpointing(model, tokens, budget_bytes=10**9)
    >>> everything.checkpointed                   # it all fits: nothing to rerun
    ()
    >>> budget = everything.saved_bytes * 3 // 4
    >>> plan = ckptlib.plan_checkpointing(model, tokens, budget_bytes=budget)
    >>> plan.checkpointed, plan.peak_bytes <= plan.budget_bytes
    (('blocks.0', 'blocks.1', 'blocks.2'), True)
    >>> with ckptlib.apply_checkpointing(model, plan):
    ...     loss = model.training_step()
    """
    if not isinstance(model, nn.Module):
        raise TypeError("plan_checkpointing: model must be an nn.Module, "
                        f"got {type(model).__name__}.")
    if (peak_bytes is None) == (budget_bytes is None):
        raise TypeError("plan_checkpointing: give one budget: peak_bytes= (the peak of one "
                        "training step) or budget_bytes= (the activations kept for backward).")
    if peak_bytes is not None:
        return plan_step_peak(model, example_inputs, peak_bytes=peak_bytes, select=select,
                              hows=hows, loss_fn=loss_fn,
                              optimizer_state_bytes=optimizer_state_bytes)
    if (hows, loss_fn, optimizer_state_bytes) != (None, None, 0):
        raise TypeError("plan_checkpointing: hows=, loss_fn= and optimizer_state_bytes= are for "
                        "peak_bytes=; budget_bytes= plans full checkpoints of what autograd keeps.")
    integer(budget_bytes, "budget_bytes", least=0, unit="number of bytes",
            where="plan_checkpointing")
    candidates = selected_modules(model, select)
    with torch.random.fork_rng(devices=_devices(model)), torch.enable_grad():
        saved_bytes, dropped, kept, unsaved = _measure_bytes(model, example_inputs, candidates)
        flops, forward_flops = _measure_flops(model, example_inputs, candidates)
    costs = tuple(ModuleCost(path, dropped[path], kept[path], flops[path], unsaved[path])
                  for path, _ in candidates)
    chosen = _fastest_within(costs, saved_bytes, budget_bytes)
    return ModelPlan(costs, chosen, saved_bytes, budget_bytes, forward_flops)


# ---------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------


def _storages(value: Any) -> dict[int, int]:
    """storage pointer -> bytes, for every tensor in a pytree (HF outputs are dicts of tensors)."""
    if hasattr(value, "to_tuple"):   # a transformers ModelOutput
        value = value.to_tuple()
    return storage_bytes(value)


def _measure_bytes(model: nn.Module, example_inputs: Any,
                   candidates: list[tuple[str, nn.Module]]) -> tuple:
    """Plain autograd's saved bytes; per candidate the bytes it made and saved (dropped), its inputs
    (kept), and those of its inputs plain autograd does not save."""
    state = storage_ptrs((*model.parameters(), *model.buffers()))
    saved: dict[int, int] = {}                       # every saved storage of the forward
    made: dict[str, dict[int, int]] = {path: {} for path, _ in candidates}
    inputs: dict[str, dict[int, int]] = {path: {} for path, _ in candidates}
    outputs: dict[str, set[int]] = {path: set() for path, _ in candidates}
    active: list[str] = []
    # Every tensor met is kept alive until the counting ends: a storage pointer names one tensor
    # only while it lives (a freed activation's memory is soon another tensor's), and the plan
    # must be the same on every run, whatever the allocator reuses.
    alive: list[Any] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        alive.append(tensor)
        pointer = storage_ptr(tensor)
        if pointer is not None and pointer not in state:
            saved[pointer] = nbytes = tensor.untyped_storage().nbytes()
            if active and pointer not in inputs[active[-1]]:
                made[active[-1]][pointer] = nbytes
        return tensor

    def before(path: str):
        def hook(module, args, kwargs):
            active.append(path)
            alive.append((args, kwargs))
            inputs[path].update((p, n) for p, n in _storages((args, kwargs)).items()
                                if p not in state)
        return hook

    def after(path: str):
        def hook(module, args, kwargs, output):
            active.pop()
            alive.append(output)
            outputs[path].update(_storages(output))
        return hook

    with (_hooks(candidates, before, after),
          torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)):
        alive.append(call_model(model, example_inputs))
    dropped = {path: sum(n for p, n in made[path].items() if p not in outputs[path])
               for path in made}
    kept = {path: sum(inputs[path].values()) for path in inputs}
    # storage pointer -> the order first met: the same numbers on every run
    numbers: dict[int, int] = {}
    for path, _ in candidates:
        for pointer in inputs[path]:
            numbers.setdefault(pointer, len(numbers))
    unsaved = {path: frozenset((numbers[p], n) for p, n in inputs[path].items() if p not in saved)
               for path in inputs}
    alive.clear()
    return sum(saved.values()), dropped, kept, unsaved


@contextlib.contextmanager
def _hooks(candidates, before, after) -> Iterator[None]:
    handles = []
    try:
        for path, module in candidates:
            handles.append(module.register_forward_pre_hook(before(path), with_kwargs=True))
            handles.append(module.register_forward_hook(after(path), with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _measure_flops(model: nn.Module, example_inputs: Any,
                   candidates: list[tuple[str, nn.Module]]) -> tuple[dict[str, int], int]:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        call_model(model, example_inputs)
    counts = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    root = type(model).__name__
    return ({path: int(counts.get(f"{root}.{path}", 0)) for path, _ in candidates},
            int(counter.get_total_flops()))


def _devices(model: nn.Module) -> list[int]:
    return sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})


# ---------------------------------------------------------------------------
# Solving
# ---------------------------------------------------------------------------


def _peak(saved_bytes: int, dropped: list[int]) -> int:
    return saved_bytes - sum(dropped) + max(dropped, default=0)


def _unsaved_bytes(chosen: list[ModuleCost]) -> int:
    return sum(n for _, n in set().union(*(c.unsaved_inputs for c in chosen)))


def _fastest_within(costs: tuple[ModuleCost, ...], saved_bytes: int,
                    budget_bytes: int) -> tuple[str, ...]:
    """The set of modules with the least rerun FLOPs whose peak fits (see the notes); ties: fewer,
    then earlier."""
    if saved_bytes <= budget_bytes:
        return ()
    best: tuple[int, int, tuple[int, ...]] | None = None
    # The few inputs a checkpoint keeps that plain autograd does not (masks): counted all, to be
    # safe.
    unsaved = _unsaved_bytes(list(costs))
    for largest in sorted({cost.dropped_bytes for cost in costs}):
        allowed = [(i, cost) for i, cost in enumerate(costs) if cost.dropped_bytes <= largest]
        need = saved_bytes + unsaved + largest - budget_bytes
        for dropped, flops, chosen in _frontier(allowed):
            if dropped >= need and chosen:
                option = (flops, len(chosen), chosen)
                if best is None or option < best:
                    best = option
    if best is None:
        least = _peak(saved_bytes, [cost.dropped_bytes for cost in costs]) + unsaved
        raise ValueError(
            f"plan_checkpointing: no choice of the {len(costs)} candidate modules keeps the "
            f"activations within {budget_bytes:,} bytes: plain autograd keeps {saved_bytes:,}, "
            f"and checkpointing every candidate still {least:,}. Raise budget_bytes, make the "
            "batch smaller, or offer more candidates (select=).")
    return tuple(costs[i].path for i in best[2])


def _frontier(items: list[tuple[int, ModuleCost]]) -> list[tuple[int, int, tuple[int, ...]]]:
    """Every (bytes dropped, FLOPs, chosen) that no other choice beats on both, over subsets of
    items."""
    frontier: list[tuple[int, int, tuple[int, ...]]] = [(0, 0, ())]
    for index, cost in items:
        grown = frontier + [
            (dropped + cost.dropped_bytes, flops + cost.rerun_flops, chosen + (index,))
            for dropped, flops, chosen in frontier]
        # Least FLOPs first (then fewer, earlier modules); keep a choice only if it drops more than
        # all before it.
        grown.sort(key=lambda option: (option[1], len(option[2]), option[2], -option[0]))
        frontier, most = [], -1
        for option in grown:
            if option[0] > most:
                frontier.append(option)
                most = option[0]
    return frontier
