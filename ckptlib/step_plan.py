"""A plan for the peak memory of one whole training step: per repeated module, keep it, checkpoint
it fully or selectively, or offload it, for the least measured time.

Design notes
============

What is bounded. ``peak_bytes`` bounds the most bytes one training step (forward, loss,
backward, the gradients it makes) holds at one moment, as ckptlib's meter counts them
(:class:`ckptlib.MemoryMeter`: the CUDA allocator on a GPU, live storages on any other device),
plus ``optimizer_state_bytes`` if you add them. What exists before the step (parameters, the
inputs) is not counted. The activations autograd keeps are only part of it: on a language model
the logits and their gradient, or the gradients late in backward, can set the peak, and then
checkpointing more layers buys nothing. The planner sees that because it measures the step.

Measure plain autograd, once. One step under the meter, one timeline entry per op, and for each
candidate module the op where its forward ends and the op where its backward begins (a hook on
its output's gradient). Between those two a checkpoint drops the module's activations; at every
other op the plan's timeline is plain's.

Measure each way, per group. The candidates that are alike (one class, the same parameter and
input shapes: a Transformer's layers) form a group; one of them runs forward and backward alone,
on the inputs it got in the step, once per way: keep, full checkpoint, each selective policy,
offload (only on a device where it frees memory: on the CPU the saved tensors are in host memory
already). Per way: the bytes it holds for backward after its forward (*dropped* is keep's minus
this), how much higher its backward peaks than keep's (the rerun), and its time over keep's (the
least of a few alternating runs each, the median of three such rounds, in the thread's CPU time
on the CPU, with the garbage collector paused; at least the forward for a full checkpoint): the
*rerun cost*. Times are measured, not counted: an LSTM's rerun is not free because a FLOP
counter cannot see it, and a selective policy whose per-op dispatch costs more than it saves is
seen to be slower than full checkpointing. A way that keeps more bytes
than full checkpointing (selective) must also cost clearly less, under two thirds of full's
time, or it is left out: a near tie would let the machine's load choose. The costs are rounded
to powers of 1.5; with both rules a busy machine plans as an idle one does.

Model. In the order their forwards end, the candidates nest: a later one's forward ends later and
its backward begins earlier (autograd runs backward in reverse). So at each op, the candidates
whose activations are dropped are a prefix of that order (where they are not, the longest prefix
inside is counted: a safe lower bound on what is dropped). Predicted live bytes at an op: plain's,
minus what that prefix drops, plus, while a checkpointed module's backward runs, its rerun.

Solve (exact for the model). Through the candidates in order, keep for every total of bytes
dropped so far the least time (a Pareto frontier of (dropped, time)); before a candidate is
chosen, drop the totals that break a constraint of the ops its prefix covers. The least time at
the end wins; ties go to fewer modules rerun, then to rerunning the earliest.

Check. The plan runs one step under the meter; its measured peak and where it happened (phase,
module, op) go into the plan. If it measures over the budget (the model errs), the budget the
solver sees is lowered by the excess and it solves again, at most three times; if no plan fits,
a ``ValueError`` names the least peak reached: every candidate checkpointed its most dropping way.
"""
from __future__ import annotations

import contextlib
import gc
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from ckptlib._arguments import integer
from ckptlib.apply import Selector, apply_checkpointing, how_name, selected_modules
from ckptlib.memory import MemoryMeter
from ckptlib.selective import save_matmuls
from ckptlib.memory.allocations import storage_bytes

__all__ = ["plan_step_peak", "StepPlan", "WayCost", "PeakPlace", "call_model", "default_loss"]

KEEP = "keep"
COST_STEP = 1.5       # rerun costs are rounded to powers of this (see the notes)
TIMED_RUNS = 5        # per round: runs of each, kept and this way, alternating
TIMED_ROUNDS = 3      # per way and group: the median round
CLEARLY_LESS = 2 / 3  # a way that keeps more than full must cost under this share of its time
SOLVES = 3            # at most this many corrections of the model by a measured run


@dataclass(frozen=True)
class WayCost:
    """One way to treat one candidate module, measured on one module of its group."""

    how: Any                # "keep", "full", "offload" or a selective policy
    kept_bytes: int         # held for backward after the module's forward (inputs, output aside)
    dropped_bytes: int      # keep's kept_bytes minus this one's
    rerun_bytes: int        # how much higher the module's backward peaks than keep's
    # measured time over keep's, rounded (see the notes); left out of ==: plans compare by choice
    rerun_s: float = field(compare=False)


class PeakPlace(NamedTuple):
    """Where a step's memory peaked: the phase (forward, recompute, backward), the module that ran
    (in backward: the candidate whose backward was running), and the op."""

    phase: str
    module: str
    op: str

    def __str__(self) -> str:
        return f"{self.phase}, {self.module}, op {self.op}"


@dataclass(frozen=True)
class StepPlan:
    """How to checkpoint each candidate module so one training step peaks within a budget.

    Apply it with ``ckptlib.apply_checkpointing(model, plan)``; ``print(plan)`` shows the table.
    """

    paths: tuple[str, ...]
    ways: tuple[tuple[WayCost, ...], ...]   # per candidate, each way measured (keep first)
    chosen: tuple[int, ...]                 # per candidate, the index of its way
    peak_budget_bytes: int
    optimizer_state_bytes: int
    plain_peak_bytes: int                   # measured: plain autograd's step (+ optimizer state)
    plain_peak_at: PeakPlace
    predicted_peak_bytes: int
    measured_peak_bytes: int                # measured: this plan's step (+ optimizer state)
    peak_at: PeakPlace

    def module_paths(self) -> tuple[str, ...]:
        """The modules this plan checkpoints (or offloads), in order."""
        return tuple(self.module_hows())

    def module_hows(self) -> dict[str, Any]:
        """path -> how, for every module the plan does not keep as it is."""
        return {path: ways[index].how for path, ways, index in zip(self.paths, self.ways,
                                                                     self.chosen)
                if ways[index].how != KEEP}

    @property
    def rerun_s(self) -> float:
        """Predicted extra time per step: the chosen ways' rerun costs."""
        return sum(ways[index].rerun_s for ways, index in zip(self.ways, self.chosen))

    def cost_of(self, path: str) -> tuple[str, str]:
        """(kept bytes, rerun cost) of one module under this plan, as the tables write them."""
        way = self.ways[self.paths.index(path)][self.chosen[self.paths.index(path)]]
        return f"{way.kept_bytes:,}", f"{way.rerun_s * 1e3:.2f} ms"

    def peak_line(self) -> str:
        """One line: what the budget bounds, the measured peak, where, and plain's."""
        state = " and optimizer state" if self.optimizer_state_bytes else ""
        return (f"one training step's peak (forward, loss, backward, gradients{state}): measured "
                f"{self.measured_peak_bytes:,} <= budget {self.peak_budget_bytes:,} bytes, at "
                f"{self.peak_at}; plain autograd's {self.plain_peak_bytes:,}, at "
                f"{self.plain_peak_at}; predicted rerun cost {self.rerun_s * 1e3:.1f} ms per step")

    def __str__(self) -> str:
        rows = [("module", "how", "kept bytes", "rerun cost")]
        for path, ways, index in zip(self.paths, self.ways, self.chosen):
            way = ways[index]
            rows.append((path, how_name(way.how), f"{way.kept_bytes:,}",
                         f"{way.rerun_s * 1e3:.2f} ms"))
        widths = [max(len(row[column]) for row in rows) for column in range(4)]
        lines = [f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]:>{widths[2]}}  "
                 f"{row[3]:>{widths[3]}}" for row in rows]
        return "\n".join([*lines, self.peak_line()])


def call_model(model: nn.Module, example_inputs: Any) -> Any:
    """``model(**inputs)`` for a dict, ``model(*inputs)`` for a tuple, else ``model(inputs)``."""
    if isinstance(example_inputs, dict):
        return model(**example_inputs)
    if isinstance(example_inputs, tuple):
        return model(*example_inputs)
    return model(example_inputs)


def default_loss(output: Any) -> torch.Tensor:
    """The model's own loss (``output.loss``, a Hugging Face model given ``labels``), else the sum
    of its first output that requires grad: a stand-in whose backward holds the same bytes (they
    depend on shapes, not values)."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    leaves = tree_flatten(output.to_tuple() if hasattr(output, "to_tuple") else output)[0]
    tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
    if not tensors:
        raise ValueError("plan_checkpointing: the model's output has no .loss and no tensor that "
                         "requires grad; pass labels in example_inputs, or loss_fn=.")
    return tensors[0].sum()


def plan_step_peak(model: nn.Module, example_inputs: Any, *, peak_bytes: int,
                   select: Selector = None, hows: Sequence[Any] | None = None,
                   loss_fn: Callable[[Any], torch.Tensor] | None = None,
                   optimizer_state_bytes: int = 0) -> StepPlan:
    """The plan of :func:`ckptlib.plan_checkpointing` with ``peak_bytes=`` (see the notes above).

    ``hows``: the ways to try besides keeping (default: full, ``save_matmuls``, and offload where
    the model is not on the CPU). ``loss_fn(output) -> loss`` (default :func:`default_loss`).
    ``optimizer_state_bytes``: held through the whole step, e.g. Adam's two moments,
    ``2 * sum(p.numel() * 4 for p in model.parameters())`` in float32.
    """
    where = "plan_checkpointing"
    integer(peak_bytes, "peak_bytes", least=0, unit="number of bytes", where=where)
    integer(optimizer_state_bytes, "optimizer_state_bytes", least=0, unit="number of bytes",
            where=where)
    device = _device_of(model)
    hows = tuple(hows) if hows is not None else (
        ("full", save_matmuls) if device.type == "cpu" else ("full", save_matmuls, "offload"))
    candidates = selected_modules(model, select)
    step = _Step(model, example_inputs, loss_fn or default_loss, candidates, device)
    with step.kept_aside():
        plain = step.metered({})
        ways = _measure_ways(step, hows, step.capture_group_inputs())
        order = sorted(range(len(candidates)),
                       key=lambda i: plain.forward_end.get(candidates[i][0], len(plain.live)))
        constraints = _constraints(plain, [candidates[i][0] for i in order])
        ordered_ways = [ways[i] for i in order]
        budget = peak_bytes - optimizer_state_bytes
        fits, chosen, predicted, measured = _solve_and_check(
            step, ordered_ways, constraints, budget, plain, [candidates[i][0] for i in order])
    if not fits:
        reached = measured
        raise ValueError(
            f"{where}: no plan keeps one training step within peak_bytes={peak_bytes:,}: plain "
            f"autograd's step peaks at {plain.peak_bytes + optimizer_state_bytes:,} bytes (at "
            f"{plain.peak_at}), and the least this planner reaches, every one of the "
            f"{len(candidates)} candidate modules checkpointed, peaks at "
            f"{reached.peak_bytes + optimizer_state_bytes:,} (at {reached.peak_at}). Raise "
            "peak_bytes to at least that, make the batch smaller, or offer more candidates "
            "(select=).")
    paths = tuple(path for path, _ in candidates)
    position = {candidates[i][0]: k for k, i in enumerate(order)}
    return StepPlan(
        paths=paths,
        ways=tuple(ordered_ways[position[path]] for path in paths),
        chosen=tuple(chosen[position[path]] for path in paths),
        peak_budget_bytes=peak_bytes,
        optimizer_state_bytes=optimizer_state_bytes,
        plain_peak_bytes=plain.peak_bytes + optimizer_state_bytes,
        plain_peak_at=plain.peak_at,
        predicted_peak_bytes=predicted + optimizer_state_bytes,
        measured_peak_bytes=measured.peak_bytes + optimizer_state_bytes,
        peak_at=measured.peak_at,
    )


# ---------------------------------------------------------------------------
# Running the step
# ---------------------------------------------------------------------------


@dataclass
class _Run:
    """One metered step: live bytes after each op, where each op ran, and when each candidate's
    forward ended and its backward began."""

    live: list[int]
    places: list[PeakPlace]
    forward_end: dict[str, int]
    backward_start: dict[str, int]
    backward_end: dict[str, int]
    peak_bytes: int

    @property
    def peak_at(self) -> PeakPlace:
        if not self.live:
            return PeakPlace("forward", "-", "-")
        return self.places[max(range(len(self.live)), key=self.live.__getitem__)]


class _Step:
    """One training step of the model on the example inputs, run the ways the planner needs."""

    def __init__(self, model: nn.Module, example_inputs: Any, loss_fn: Callable,
                 candidates: list[tuple[str, nn.Module]], device: torch.device) -> None:
        self.model, self.example_inputs, self.loss_fn = model, example_inputs, loss_fn
        self.candidates, self.device = candidates, device
        self.root = type(model).__name__

    @contextlib.contextmanager
    def kept_aside(self) -> Iterator[None]:
        """The caller's gradients and RNG set aside while the planner runs steps (grad mode on),
        then restored, also when a step raises."""
        grads = [(p, p.grad) for p in self.model.parameters()]
        for p, _ in grads:
            p.grad = None
        devices = [self.device] if self.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices), torch.enable_grad():
                yield
        finally:
            for p, grad in grads:
                p.grad = grad

    def metered(self, hows: dict[str, Any]) -> _Run:
        """One step with ``hows`` applied (path -> how; empty: plain autograd), under the meter."""
        run = _Run([], [], {}, {}, {}, 0)
        modules = {id(module): path or self.root for path, module in self.model.named_modules()}
        stack: list[str] = []
        in_backward: list[str] = []   # the candidates whose backward is running, innermost last

        def place(entry: Any) -> None:
            run.live.append(entry.live_bytes)
            if entry.phase == "backward":
                module = in_backward[-1] if in_backward else self.root
            else:
                module = stack[-1] if stack else self.root
            run.places.append(PeakPlace(entry.phase, module, entry.op))

        meter = MemoryMeter(self.device, on_op=place)

        def began(path: str) -> Callable:
            def hook(_grad: torch.Tensor) -> None:
                if path not in run.backward_start:
                    run.backward_start[path] = len(run.live)
                    in_backward.append(path)
            return hook

        def ended(path: str) -> Callable:
            def hook(_grad: torch.Tensor) -> None:
                if path not in run.backward_end:
                    run.backward_end[path] = len(run.live)
                    if path in in_backward:
                        in_backward.remove(path)
            return hook

        def push(module: nn.Module, args: Any) -> None:
            stack.append(modules.get(id(module), type(module).__name__))

        def pop(module: nn.Module, args: Any, output: Any) -> None:
            stack.pop()

        def candidate_in(path: str) -> Callable:
            def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
                first = _grad_tensors((args, kwargs))[:1]   # the hidden states, not a shared mask
                for tensor in first:
                    tensor.register_hook(ended(path))
            return hook

        def candidate_out(path: str) -> Callable:
            def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
                run.forward_end.setdefault(path, len(run.live))
                for tensor in _grad_tensors(output):
                    tensor.register_hook(began(path))
            return hook

        handles = [module.register_forward_pre_hook(push) for module in self.model.modules()]
        handles += [module.register_forward_hook(pop) for module in self.model.modules()]
        for path, module in self.candidates:
            handles.append(module.register_forward_pre_hook(candidate_in(path), with_kwargs=True))
            handles.append(module.register_forward_hook(candidate_out(path), with_kwargs=True))
        try:
            with apply_checkpointing(self.model, _Hows(hows)), meter:
                self.run_once()
        finally:
            for handle in handles:
                handle.remove()
        run.peak_bytes = max(meter.peak_bytes, max(run.live, default=0))
        return run

    def run_once(self) -> None:
        self.model.zero_grad(set_to_none=True)
        self.loss_fn(call_model(self.model, self.example_inputs)).backward()

    def capture_group_inputs(self) -> list[tuple[int, tuple, dict]]:
        """Per candidate: its group's number and the (args, kwargs) the group's first member got
        (detached copies), in one forward pass with no meter."""
        groups: dict[tuple, int] = {}
        found: list[Any] = [None] * len(self.candidates)

        def capture(index: int, module: nn.Module) -> Callable:
            def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
                key = _group_key(module, args, kwargs)
                if key not in groups:
                    groups[key] = index
                    copied = tree_map(_detached_copy, (args, kwargs))
                    found[index] = (index, *copied)
                else:
                    found[index] = (groups[key], None, None)
            return hook

        handles = [module.register_forward_pre_hook(capture(i, module), with_kwargs=True)
                   for i, (_, module) in enumerate(self.candidates)]
        try:
            call_model(self.model, self.example_inputs)
        finally:
            for handle in handles:
                handle.remove()
        missing = [path for (path, _), got in zip(self.candidates, found) if got is None]
        if missing:
            raise ValueError(f"plan_checkpointing: {', '.join(missing)} did not run in the "
                             "model's forward on example_inputs; leave them out (select=).")
        return found


class _Hows:
    """A ``select=`` for ``apply_checkpointing``: these modules, each its own way."""

    def __init__(self, hows: dict[str, Any]) -> None:
        self.hows = hows

    def module_paths(self) -> tuple[str, ...]:
        return tuple(self.hows)

    def module_hows(self) -> dict[str, Any]:
        return dict(self.hows)

    def cost_of(self, path: str) -> tuple[str, str]:
        return "-", "-"

    def peak_line(self) -> str:
        return "a trial plan of plan_checkpointing"


def _grad_tensors(value: Any) -> list[torch.Tensor]:
    if hasattr(value, "to_tuple"):   # a transformers ModelOutput
        value = value.to_tuple()
    return [t for t in tree_flatten(value)[0]
            if isinstance(t, torch.Tensor) and t.requires_grad]


def _detached_copy(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    return value.detach().clone().requires_grad_(value.requires_grad)


def _group_key(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """Alike modules: one class, the same parameters' shapes, the same inputs' shapes."""
    def describe(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return ("tensor", tuple(value.shape), value.dtype, value.requires_grad)
        return repr(value) if isinstance(value, (int, float, bool, str, type(None))) else \
            type(value).__name__
    parameters = tuple((name, tuple(p.shape), p.dtype) for name, p in module.named_parameters())
    leaves, spec = tree_flatten((args, kwargs))
    return type(module), parameters, str(spec), tuple(map(describe, leaves))


def _device_of(model: nn.Module) -> torch.device:
    devices = {t.device for t in (*model.parameters(), *model.buffers())}
    if len(devices) > 1:
        raise ValueError(f"plan_checkpointing: the model's parameters are on {len(devices)} "
                         f"devices ({', '.join(sorted(map(str, devices)))}); it plans for one "
                         "device's memory: move the model to one device first.")
    return next(iter(devices), torch.device("cpu"))


# ---------------------------------------------------------------------------
# Measuring each way
# ---------------------------------------------------------------------------


def _measure_ways(step: _Step, hows: tuple[Any, ...],
                  captured: list[tuple[int, Any, Any]]) -> list[tuple[WayCost, ...]]:
    """Per candidate, each way measured on its group's first member (see the notes)."""
    measured: dict[int, tuple[WayCost, ...]] = {}
    for index, args, kwargs in captured:
        if index in measured or args is None:
            continue
        path, module = step.candidates[index]
        readings = {how: _measure_way(step, path, module, how, args, kwargs)
                    for how in (KEEP, *hows)}
        kept, peak, _ = readings[KEEP]
        ways = []
        for how, (way_kept, way_peak, extra_s) in readings.items():
            dropped = kept - way_kept
            if how != KEEP and dropped <= 0:
                continue   # frees nothing on this device (offload on the CPU, say)
            ways.append(WayCost(how, way_kept, dropped, max(0, way_peak - peak),
                                _rounded(extra_s) if how != KEEP else 0.0))
        measured[index] = _clear_winners(ways)
    return [measured[group] for group, _, _ in captured]


def _clear_winners(ways: list[WayCost]) -> tuple[WayCost, ...]:
    """Keep, full, and each other way that costs clearly less than full (see the notes)."""
    full = [way.rerun_s for way in ways if way.how == "full"]
    if not full:
        return tuple(ways)
    return tuple(way for way in ways
                 if way.how in (KEEP, "full") or way.rerun_s < CLEARLY_LESS * full[0])


def _measure_way(step: _Step, path: str, module: nn.Module, how: Any, args: tuple,
                 kwargs: dict) -> tuple[int, int, float]:
    """(bytes held after forward, peak bytes, seconds over keeping's) of the module's forward and
    backward alone, checkpointed ``how``.

    Runs alternate, one kept (the class's own ``forward``) and one this way; the least time of
    each in a round counts, and the median of three rounds. On the CPU the clock is the calling
    thread's CPU time, which other processes on a busy machine do not stretch as they stretch
    wall time; on a GPU, wall time after synchronising. A full checkpoint costs at least its
    forward, which it runs again.
    """
    hows = {} if how == KEEP else {path: how}

    def run(call: Callable) -> Any:
        module.zero_grad(set_to_none=True)
        inputs_args, inputs_kwargs = tree_map(_fresh_leaf, (args, kwargs))
        return call(*inputs_args, **inputs_kwargs)

    def kept_as_is(*inputs_args: Any, **inputs_kwargs: Any) -> Any:
        return type(module).forward(module, *inputs_args, **inputs_kwargs)

    def backward(output: Any) -> None:
        tensors = _grad_tensors(output)
        torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])

    clock = time.thread_time if step.device.type == "cpu" else time.perf_counter

    def timed(call: Callable) -> tuple[float, float]:
        _synchronize(step.device)
        start = clock()
        output = run(call)
        _synchronize(step.device)
        middle = clock()
        backward(output)
        _synchronize(step.device)
        return middle - start, clock() - start

    with apply_checkpointing(step.model, _Hows(hows)):
        backward(run(module))                   # a selective way records its plan here
        with MemoryMeter(step.device, timeline=False) as meter:
            output = run(module)
            kept = meter.live_bytes - sum(storage_bytes(_grad_tensors(output)).values())
            backward(output)
            del output
        if how == KEEP:
            return kept, meter.peak_bytes, 0.0
        collecting = gc.isenabled()
        gc.disable()   # as timeit does: a collection of the whole heap inside one run
        try:
            extra_s = [_timed_round(timed, kept_as_is, module, how) for _ in range(TIMED_ROUNDS)]
        finally:
            if collecting:
                gc.enable()
    module.zero_grad(set_to_none=True)
    return kept, meter.peak_bytes, sorted(extra_s)[len(extra_s) // 2]


def _timed_round(timed: Callable, kept_as_is: Callable, module: nn.Module, how: Any) -> float:
    """One round of alternating runs: the least time this way minus the least kept, at least the
    forward for a full checkpoint."""
    forward_s, keep_s, way_s = math.inf, math.inf, math.inf
    for _ in range(TIMED_RUNS):
        forward, whole = timed(kept_as_is)
        forward_s, keep_s = min(forward_s, forward), min(keep_s, whole)
        way_s = min(way_s, timed(module)[1])
    return max(way_s - keep_s, forward_s if how == "full" else 0.0)


def _fresh_leaf(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    return value.detach().requires_grad_(value.requires_grad)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rounded(seconds: float) -> float:
    """To the nearest power of COST_STEP: the same plan on a busy machine (see the notes)."""
    if seconds <= 1e-7:
        return 0.0
    return COST_STEP ** round(math.log(seconds, COST_STEP))


# ---------------------------------------------------------------------------
# The model and the solver
# ---------------------------------------------------------------------------


class _Constraint(NamedTuple):
    """At some ops: the first ``prefix`` candidates' drops count, ``owner``'s rerun (if any) runs,
    and plain autograd held ``live_bytes``."""

    prefix: int
    owner: int | None
    live_bytes: int


def _constraints(plain: _Run, ordered_paths: list[str]) -> list[_Constraint]:
    """Plain's timeline, grouped by which candidates' drops count at each op (see the notes)."""
    never = len(plain.live) + 1
    spans = [(plain.forward_end.get(path, never), plain.backward_start.get(path, never),
              plain.backward_end.get(path, never)) for path in ordered_paths]
    worst: dict[tuple[int, int | None], int] = {}
    for op, live in enumerate(plain.live):
        prefix = 0
        while prefix < len(spans) and spans[prefix][0] <= op < spans[prefix][1]:
            prefix += 1
        running = [i for i, (_, start, end) in enumerate(spans) if start <= op < end]
        owner = max(running, key=lambda i: spans[i][1]) if running else None
        key = (prefix, owner)
        worst[key] = max(worst.get(key, 0), live)
    return [_Constraint(prefix, owner, live) for (prefix, owner), live in sorted(
        worst.items(), key=lambda item: (item[0][0], -1 if item[0][1] is None else item[0][1]))]


class _State(NamedTuple):
    dropped_bytes: int
    rerun_s: float
    reruns: int
    chosen: tuple[int, ...]


def _solve(ways: list[tuple[WayCost, ...]], constraints: list[_Constraint],
           budget_bytes: int) -> tuple[int, ...] | None:
    """Per candidate (in order) the index of its way: the least rerun time whose predicted peak
    fits ``budget_bytes``; ``None`` if none does (see the notes)."""
    def spike(constraint: _Constraint, chosen: tuple[int, ...], choosing: int | None) -> int:
        owner = constraint.owner
        if owner is None:
            return 0
        if owner == choosing or owner >= len(chosen):
            # owner chosen now (``choosing`` carries the way) or later: the worst of its ways
            return max(way.rerun_bytes for way in ways[owner])
        return ways[owner][chosen[owner]].rerun_bytes

    states = [_State(0, 0.0, 0, ())]
    for k in range(len(ways) + 1):
        fixed = [c for c in constraints if c.prefix == k and c.owner != k]
        states = [s for s in states if all(
            s.dropped_bytes >= c.live_bytes + spike(c, s.chosen, None) - budget_bytes
            for c in fixed)]
        if k == len(ways):
            break
        owned = [c.live_bytes for c in constraints if c.prefix == k and c.owner == k]
        grown = [
            _State(s.dropped_bytes + way.dropped_bytes, s.rerun_s + way.rerun_s,
                   s.reruns + (way.how != KEEP), s.chosen + (index,))
            for s in states for index, way in enumerate(ways[k])
            if all(s.dropped_bytes >= live + way.rerun_bytes - budget_bytes for live in owned)]
        states = _pareto(grown)
    if not states:
        return None
    return min(states, key=_preference).chosen


def _preference(state: _State) -> tuple:
    """Least time, then fewest reruns, then the earliest modules rerun."""
    return state.rerun_s, state.reruns, tuple(index == 0 for index in state.chosen)


def _pareto(states: list[_State]) -> list[_State]:
    """The states no other beats on both time and bytes dropped (the best of each tie kept)."""
    kept, most = [], -1
    for state in sorted(states, key=lambda s: (s.rerun_s, -s.dropped_bytes, *_preference(s)[1:])):
        if state.dropped_bytes > most:
            kept.append(state)
            most = state.dropped_bytes
    return kept


def _predicted_peak(ways: list[tuple[WayCost, ...]], constraints: list[_Constraint],
                    chosen: tuple[int, ...]) -> int:
    dropped = [0]
    for way, index in zip(ways, chosen):
        dropped.append(dropped[-1] + way[index].dropped_bytes)
    return max((c.live_bytes - dropped[c.prefix]
                + (ways[c.owner][chosen[c.owner]].rerun_bytes if c.owner is not None else 0)
                for c in constraints), default=0)


def _hows_by_path(paths: list[str], ways: list[tuple[WayCost, ...]],
                  chosen: tuple[int, ...]) -> dict[str, Any]:
    return {path: way[index].how for path, way, index in zip(paths, ways, chosen)
            if way[index].how != KEEP}


def _most_dropping(ways: list[tuple[WayCost, ...]]) -> tuple[int, ...]:
    return tuple(max(range(len(way)), key=lambda i: (way[i].dropped_bytes, -i)) for way in ways)


def _solve_and_check(step: _Step, ways: list[tuple[WayCost, ...]],
                     constraints: list[_Constraint], budget_bytes: int, plain: _Run,
                     paths: list[str]) -> tuple[bool, tuple[int, ...], int, _Run]:
    """Solve, measure the plan, and solve again with the budget lowered by what the measured
    step exceeded it by; the most dropping plan last, if the model was too cautious. Returns
    (fits, chosen, predicted peak, measured run); when nothing fits, the most dropping plan's."""
    target = budget_bytes
    tried: dict[tuple[int, ...], _Run] = {tuple(0 for _ in ways): plain}
    for _ in range(SOLVES):
        chosen = _solve(ways, constraints, target)
        if chosen is None:
            break
        if chosen not in tried:
            tried[chosen] = step.metered(_hows_by_path(paths, ways, chosen))
        measured = tried[chosen]
        if measured.peak_bytes <= budget_bytes:
            return True, chosen, _predicted_peak(ways, constraints, chosen), measured
        target -= measured.peak_bytes - budget_bytes
    chosen = _most_dropping(ways)
    if chosen not in tried:
        tried[chosen] = step.metered(_hows_by_path(paths, ways, chosen))
    fits = tried[chosen].peak_bytes <= budget_bytes
    return fits, chosen, _predicted_peak(ways, constraints, chosen), tried[chosen]
