"""Where to keep activations along a chain of layers: uniform, sqrt(n), log n, Revolve, budgets.

Design notes
============

A chain of ``n`` layers maps the input ``x0`` through ``x1, x2, ...`` to
``xn``; ``x_i`` is the input of layer ``i`` (layers are numbered from 0). A
*plan* decides which layers run inside a checkpoint, and how each checkpointed
segment is itself run again when backward needs it.

Plans are nested checkpoints. A plan's ``body`` is a tuple of steps covering
the layers in order. A step is either

* a layer index ``i``: run layer ``i`` normally, so autograd keeps what its
  backward needs ("record" it), or
* a :class:`Segment` ``(start, stop, body)``: ``checkpoint`` the layers
  ``start .. stop-1``. In forward they run keeping nothing but the segment's
  input ``x_start`` (a *checkpoint*, one *slot*). When backward reaches them,
  the checkpoint reruns the segment following its own ``body``, in which
  layers are recorded and inner segments are checkpointed again.

``sequential.checkpoint_sequential`` executes a body with one
``ckptlib.checkpoint`` call per segment, nested like the tuples, so autograd
runs the backward and ``checkpoint``'s frames and early stop do the rest.
Every recompute-then-reverse schedule for a chain is such a nesting:

* ``uniform(n, k)``: k-1 flat segments, then the last segment's layers recorded;
  ``sqrt_n(n)`` is the same with segments of ``ceil(sqrt(n))`` layers.
* ``recursive(n)``: ``(Segment(first half, recursive body), *recursive(second half))``.
* ``revolve(n, s)``: Griewank and Walther's binomial schedule. "Advance from
  ``x_a`` to ``x_c``, store ``x_c``, reverse ``[c, b)`` with one slot fewer,
  then reverse ``[a, c)``" is the body ``(Segment(a, c, ...), *body of [c, b))``.

What a plan does is worked out once, by following how ``checkpoint`` behaves,
into ``Plan.actions``: forward (recording or keeping nothing), backward,
store and free of checkpoints. Two facts of ``checkpoint`` shape it:

* The frames made in the first forward are the ones backward meets; each
  reruns once, when backward first needs one of its tensors. Inside a rerun,
  an inner segment is checkpointed afresh: its layers run keeping nothing and
  all the rerun gives back for it is its input ``x_start``, from which the
  inner frame of the first forward reruns later ("advance, store").
* Early stop. A rerun stops at the segment's last saved tensor: inside its
  last layer when the body ends with a layer (the layer is called, the call is
  cut short), or at the input of a trailing inner segment, whose layers do
  not run at all. So every layer is recorded exactly once in a training step.

Counting convention (Griewank and Walther, "Algorithm 799: revolve", 2000)
--------------------------------------------------------------------------

Griewank and Walther count *advances*: forward steps that record nothing.
Each of the ``l`` steps is also run once recording its tape right before its
reverse step; those ``l`` runs are not counted. Advances of the first sweep
are counted. ``s`` is the number of checkpoints, the one holding the
initial state ``x0`` included. With these conventions the least number of
advances is ``r*l - C(s+r, s+1)`` with ``r`` the least integer such that
``C(s+r, s) >= l`` (``l=3, s=1``: store ``x0``, advance 2, reverse layer 2,
advance 1 from ``x0``, reverse layer 1, reverse layer 0: 3 advances).

Here a layer is recorded exactly once (above), so the same number is
``Plan.forward_steps``: the layer forwards that keep nothing, which equals the
number of layer forwards run inside recomputations. A module forward-call
counter sees ``Plan.forward_calls == n + forward_steps``; plain autograd has
``forward_steps == 0``. ``revolve(l, s)`` keeps ``peak_slots <= s``
checkpoints, plus one layer's recorded activations while it is reversed.

Memory model
------------

``peak_slots`` counts checkpoints only. ``peak_activations`` counts the
memory a homogeneous chain needs in units of one activation: every checkpoint
is one, and so is every layer recorded and not yet reversed (a layer keeps
about one activation for its backward). For measured chains,
:meth:`Plan.peak_bytes` uses per-layer :class:`LayerCost` records: a
checkpoint of ``x_i`` costs ``input_bytes`` of layer ``i``; a recorded layer
costs its ``saved_bytes``. A tensor two recorded layers share (one's output
is the next one's saved input) is counted by both, so the model errs high.
(What it leaves out: a checkpoint taken in the first forward lives until its
segment is reversed, not only until its rerun starts; that shows when the
segment's first layer does not save its input itself.) Parameters, gradients and
the tensors in flight (the current activation and its gradient) are not part
of a plan's peak.

Layers are assumed to save at least one tensor for backward (every layer
with weights or a non-linearity does): a layer that saves nothing at the end
of a segment is cut by early stop and not called in its rerun.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple, Sequence, Union

from ckptlib._arguments import got, integer, number

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = [
    "Plan", "Segment", "Action", "LayerCost",
    "uniform", "sqrt_n", "recursive", "revolve", "plan_for_budget",
]


# ---------------------------------------------------------------------------
# The pieces of a plan
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    """Layers ``start .. stop-1`` run inside one checkpoint; ``body`` is how its rerun runs them.

    The default body records every layer of the segment when it is recomputed.

    >>> Segment(0, 3)
    Segment(start=0, stop=3, body=(0, 1, 2))
    """

    start: int
    stop: int
    body: tuple["Step", ...] = ()

    def __post_init__(self) -> None:
        where = f"Segment({self.start!r}, {self.stop!r})"
        start, stop = integer(self.start, "start", where=where), integer(self.stop, "stop", where=where)
        if not 0 <= start < stop:
            raise ValueError(f"{where}: need 0 <= start < stop (the segment holds layers start .. stop-1).")
        body = _checked_body(self.body, where, "body", "() for every layer recorded")
        object.__setattr__(self, "start", start)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "body", body or tuple(range(start, stop)))
        _check_steps(self.body, start, stop, f"Segment({start}, {stop})")


Step = Union[int, Segment]


class Action(NamedTuple):
    """One step of a plan's training step.

    ``op`` is ``"forward"`` (layers ``start .. stop-1``; ``keep`` says whether
    autograd keeps what their backward needs), ``"backward"`` (layers
    ``stop-1`` down to ``start``), ``"store"`` or ``"free"`` (the checkpoint
    ``x_start``, the input of layer ``start``; then ``stop == start + 1``).
    """

    op: str
    start: int
    stop: int
    keep: bool = False

    def __str__(self) -> str:
        first, last = self.start, self.stop - 1
        if self.op == "backward":
            first, last = last, first
        layers = str(first) if first == last else f"{first}-{last}"
        if self.op == "forward":
            return f"forward {layers}, " + ("record" if self.keep else "keep nothing")
        if self.op == "backward":
            return f"backward {layers}"
        return f"{self.op} x{self.start}"


class LayerCost(NamedTuple):
    """What one layer of a chain costs, as :func:`plan_for_budget` and :meth:`Plan.peak_bytes` use it.

    ``input_bytes``: the layer's input, what a checkpoint in front of it keeps.
    ``saved_bytes``: what the layer keeps for its backward when it runs
    recorded (its input included when it saves it; parameters excluded).
    ``forward_s``: seconds of one forward call.
    ``ckptlib.sequential.measure_layer_costs`` measures all three.
    """

    input_bytes: float
    saved_bytes: float
    forward_s: float


# ---------------------------------------------------------------------------
# Plan
# ---------------------------------------------------------------------------


class Plan:
    """A checkpointing schedule for a chain of ``n`` layers, as nested checkpoints.

    Attributes:
        n: number of layers.
        body: the steps, each a layer index (run recorded) or a :class:`Segment`
            (run inside a checkpoint); see the design notes at the top of this module.
        name: how the plan was made, e.g. ``"revolve(8, slots=2)"``.
        actions: the training step the plan performs, as :class:`Action` s in order.
        forward_steps: layer forwards that keep nothing (Griewank-Walther's
            count; equal to the layer forwards done while recomputing).
        forward_calls: ``n + forward_steps``, the layer forward calls in one
            training step, the first forward included.
        peak_slots: the most checkpoints (stored chain activations ``x_i``,
            the input ``x0`` included) held at the same time.
        peak_activations: the most chain activations held at the same time:
            checkpoints, plus one per layer recorded and not yet reversed.

    ``print(plan)`` draws the actions, one per line, with the state after each:
    ``o`` a checkpoint, ``#`` a recorded layer, ``>`` a layer run keeping
    nothing, ``<`` a layer's backward.

    >>> plan = Plan([Segment(0, 2), 2])        # checkpoint layers 0-1, record layer 2
    >>> plan.forward_steps, plan.forward_calls, plan.peak_slots, plan.peak_activations
    (2, 5, 1, 2)
    >>> print(plan)
    Plan: 3 layers, forward_steps=2 (forward_calls=5), peak_slots=1, peak_activations=2
      012
      o..  store x0
      o>.  forward 0-1, keep nothing
      o.#  forward 2, record
      o.<  backward 2
      ##.  free x0 / forward 0-1, record
      <<.  backward 1-0
    """

    def __init__(self, body: Sequence[Step], name: str = "Plan") -> None:
        self.body: tuple[Step, ...] = _checked_body(body, "Plan", "body", "e.g. Plan([Segment(0, 2), 2])")
        if not isinstance(name, str):
            raise TypeError(f"Plan: name must be a string (how the plan was made), {got(name)}.")
        stop = _layers_end(self.body)
        _check_steps(self.body, 0, stop, "plan")
        self.n = stop
        self.name = name
        self.actions: tuple[Action, ...] = _actions(self.body)
        self.forward_steps = sum(a.stop - a.start for a in self.actions if a.op == "forward" and not a.keep)
        self.forward_calls = sum(a.stop - a.start for a in self.actions if a.op == "forward")
        self.peak_slots = max((len(checkpoints) for checkpoints, _ in self._states()), default=0)
        self.peak_activations = self._peak(lambda layer: 1, lambda layer: 1)

    # -- costs --------------------------------------------------------------
    def peak_bytes(self, layer_costs: Sequence[LayerCost | Sequence[float]]) -> float:
        """The most bytes the plan keeps at once: checkpoints' ``input_bytes`` plus recorded layers'
        ``saved_bytes`` (an upper bound; see "Memory model" in the module notes).

        >>> uniform(4, 2).peak_bytes([(10, 30, 1.0)] * 4)      # x0 kept, layers 2-3 recorded
        70
        """
        costs = _checked_costs(layer_costs, self.n)
        return self._peak(lambda layer: costs[layer].input_bytes, lambda layer: costs[layer].saved_bytes)

    def forward_s(self, layer_costs: Sequence[LayerCost | Sequence[float]]) -> float:
        """Seconds of layer forwards in one training step (first forward and recomputations).

        >>> uniform(4, 2).forward_s([(10, 30, 1.0)] * 4)        # 4 layers + 2 recomputed
        6.0
        """
        costs = _checked_costs(layer_costs, self.n)
        return sum(costs[layer].forward_s for a in self.actions if a.op == "forward"
                   for layer in range(a.start, a.stop))

    def _states(self) -> Iterator[tuple[frozenset[int], frozenset[int]]]:
        """(checkpoints held, layers recorded and not yet reversed) after each action."""
        checkpoints: set[int] = set()
        recorded: set[int] = set()
        for action in self.actions:
            layers = range(action.start, action.stop)
            if action.op == "store":
                checkpoints.add(action.start)
            elif action.op == "free":
                checkpoints.discard(action.start)
            elif action.op == "forward" and action.keep:
                recorded.update(layers)
            elif action.op == "backward":
                recorded.difference_update(layers)
            yield frozenset(checkpoints), frozenset(recorded)

    def _peak(self, checkpoint_size, recorded_size) -> Any:
        return max((sum(map(checkpoint_size, checkpoints)) + sum(map(recorded_size, recorded))
                    for checkpoints, recorded in self._states()), default=0)

    # -- drawings -----------------------------------------------------------
    def __repr__(self) -> str:
        return (f"<Plan {self.name}: n={self.n}, forward_steps={self.forward_steps}, "
                f"peak_slots={self.peak_slots}, peak_activations={self.peak_activations}>")

    def __str__(self) -> str:
        lines = [f"{self.name}: {self.n} layers, forward_steps={self.forward_steps} "
                 f"(forward_calls={self.forward_calls}), peak_slots={self.peak_slots}, "
                 f"peak_activations={self.peak_activations}",
                 "  " + "".join(str(i % 10) for i in range(self.n))]
        previous = None
        for action, (checkpoints, recorded) in zip(self.actions, self._states()):
            strip = ["o" if i in checkpoints else "#" if i in recorded else "." for i in range(self.n)]
            mark = {"forward": ">", "backward": "<"}.get(action.op, "")
            for i in range(action.start, action.stop):
                if mark and strip[i] == ".":
                    strip[i] = mark
            text = str(action)
            if previous is not None and previous.op == "free":
                # A free is always followed by the rerun it starts: one line for both.
                lines.pop()
                text = f"{previous} / {text}"
            lines.append(f"  {''.join(strip)}  {text}")
            previous = action
        return "\n".join(lines)

    def plot(self, ax: "Axes | None" = None) -> "Axes":
        """Draw the plan's timeline with matplotlib and return the axes.

        Time runs left to right in layer steps (one forward or backward of one
        layer each); the line climbs through the layers in forward and comes
        down in backward. Dashed grey: forward keeping nothing; blue: recorded
        forward; red: backward; horizontal bars: checkpoints held.

        >>> import matplotlib
        >>> matplotlib.use("Agg")
        >>> ax = revolve(8, 2).plot()
        >>> ax.get_xlabel()
        'time (layer forward and backward steps)'
        """
        import matplotlib.pyplot as plt
        from matplotlib.axes import Axes

        if ax is not None and not isinstance(ax, Axes):
            raise TypeError(f"Plan.plot: ax must be a matplotlib Axes to draw on, or None for a new figure, {got(ax)}.")
        if ax is None:
            _, ax = plt.subplots(figsize=(9, 3.5))
        styles = {
            ("forward", False): dict(color="0.55", linestyle="--", label="forward, keep nothing"),
            ("forward", True): dict(color="tab:blue", label="forward, record"),
            ("backward", False): dict(color="tab:red", label="backward"),
        }
        labelled: set[str] = set()

        def once(style: dict) -> dict:  # label each kind of line once in the legend
            if style["label"] in labelled:
                return {key: value for key, value in style.items() if key != "label"}
            labelled.add(style["label"])
            return style

        time = 0
        stored_at: dict[int, int] = {}
        for action in self.actions:
            span = action.stop - action.start
            if action.op in ("forward", "backward"):
                ends = [action.start, action.stop] if action.op == "forward" else [action.stop, action.start]
                ax.plot([time, time + span], ends, linewidth=2, **once(styles[action.op, action.keep]))
                time += span
            elif action.op == "store":
                stored_at[action.start] = time
            else:
                ax.hlines(action.start, stored_at.pop(action.start), time, color="tab:green", linewidth=5,
                          alpha=0.4, **once(dict(label="checkpoint held")))
        ax.set_xlabel("time (layer forward and backward steps)")
        ax.set_ylabel("layer (x_i: input of layer i)")
        ax.set_title(f"{self.name}: {self.forward_steps} recomputed layer forwards, "
                     f"at most {self.peak_slots} checkpoints")
        ax.legend(loc="upper right", fontsize="small")
        return ax


def _checked_body(body: Any, where: str, name: str, example: str) -> tuple[Step, ...]:
    """``body`` as a tuple, when it is an ordered collection of steps (sets, dicts and strings are not)."""
    if isinstance(body, (str, bytes, Set, Mapping)) or not isinstance(body, Iterable):
        raise TypeError(f"{where}: {name} must be a list or tuple of steps (layer indices and Segments, "
                        f"in layer order), {example}; {got(body)}.")
    return tuple(body)


def _layers_end(body: tuple[Step, ...]) -> int:
    if not body:
        raise ValueError("a plan needs at least one step; a chain has at least one layer.")
    last = body[-1]
    return last.stop if isinstance(last, Segment) else _first_layer(last, "plan") + 1


def _first_layer(step: Step, where: str) -> int:
    if isinstance(step, Segment):
        return step.start
    if isinstance(step, int) and not isinstance(step, bool):
        return step
    raise TypeError(f"{where}: a step is a layer index (int) or a Segment, got {step!r}.")


def _check_steps(steps: tuple[Step, ...], start: int, stop: int, where: str) -> None:
    """Steps must cover layers ``start .. stop-1`` in order, each once."""
    expected = start
    for step in steps:
        first = _first_layer(step, where)
        if first != expected:
            raise ValueError(f"{where}: steps must cover layers {start}..{stop - 1} in order; "
                             f"expected layer {expected} next, got {step!r}.")
        if isinstance(step, Segment):
            _check_steps(step.body, step.start, step.stop, f"Segment({step.start}, {step.stop})")
            expected = step.stop
        else:
            expected += 1
    if expected != stop:
        raise ValueError(f"{where}: steps cover layers {start}..{expected - 1}, "
                         f"but the segment ends at layer {stop - 1}.")


def _actions(body: tuple[Step, ...]) -> tuple[Action, ...]:
    """Follow ``checkpoint`` through a training step of ``body`` (see the design notes)."""
    actions: list[Action] = []

    def emit(op: str, start: int, stop: int, keep: bool = False) -> None:
        last = actions[-1] if actions else None
        if last and op == last.op == "forward" and keep == last.keep and start == last.stop:
            actions[-1] = last._replace(stop=stop)
        elif last and op == last.op == "backward" and stop == last.start:
            actions[-1] = last._replace(start=start)
        else:
            actions.append(Action(op, start, stop, keep))

    def run(steps: tuple[Step, ...], rerun: bool, input_kept: bool) -> None:
        # The forward of `steps`: the first forward, or a recomputation (which stops early).
        for position, step in enumerate(steps):
            if isinstance(step, int):
                emit("forward", step, step + 1, keep=True)
                continue
            if not (input_kept and position == 0):
                emit("store", step.start, step.start + 1)
            if rerun and position == len(steps) - 1:
                return  # early stop: all this rerun restores is the trailing segment's input
            emit("forward", step.start, step.stop, keep=False)

    def reverse(steps: tuple[Step, ...]) -> None:
        for step in reversed(steps):
            if isinstance(step, int):
                emit("backward", step, step + 1)
                continue
            # A rerun that starts with an inner segment saves the same x_start again: it stays.
            input_kept = isinstance(step.body[0], Segment)
            if not input_kept:
                emit("free", step.start, step.start + 1)
            run(step.body, rerun=True, input_kept=input_kept)
            reverse(step.body)

    run(body, rerun=False, input_kept=False)
    reverse(body)
    return tuple(actions)


def _checked_costs(layer_costs: Sequence[LayerCost | Sequence[float]], n: int | None) -> list[LayerCost]:
    """The records as LayerCosts of plain Python numbers (a NumPy integer counts as an int)."""
    try:
        costs = [LayerCost(*record) for record in layer_costs]
    except TypeError as error:
        raise TypeError("layer_costs must be one (input_bytes, saved_bytes, forward_s) record per layer, "
                        f"e.g. LayerCost(4096, 8192, 1e-4): {error}") from None
    if n is not None and len(costs) != n:
        raise ValueError(f"layer_costs has {len(costs)} records, but the plan has {n} layers; "
                         "give one LayerCost per layer.")
    return [LayerCost(*(number(value, field, least=0, where=f"layer_costs[{layer}] = {cost}")
                        for field, value in zip(LayerCost._fields, cost)))
            for layer, cost in enumerate(costs)]


# ---------------------------------------------------------------------------
# Ready-made plans
# ---------------------------------------------------------------------------


def _segments_then_tail(sizes: Sequence[int]) -> tuple[Step, ...]:
    """All segments but the last checkpointed (flat); the last one's layers recorded."""
    body: list[Step] = []
    start = 0
    for size in sizes[:-1]:
        body.append(Segment(start, start + size))
        start += size
    return (*body, *range(start, start + sizes[-1]))


def uniform(n: int, k: int) -> Plan:
    """``k`` segments as ``torch.utils.checkpoint.checkpoint_sequential`` makes them.

    The first ``k-1`` segments have ``n // k`` layers each and are checkpointed;
    the last holds the rest and is recorded. ``checkpoint_sequential(modules, k, x)``
    runs exactly this plan.

    >>> plan = uniform(16, 4)
    >>> plan.body[:2]
    (Segment(start=0, stop=4, body=(0, 1, 2, 3)), Segment(start=4, stop=8, body=(4, 5, 6, 7)))
    >>> plan.forward_steps, plan.peak_slots, plan.peak_activations
    (12, 3, 7)
    """
    n = integer(n, "n (the number of layers)", least=1, where="uniform")
    k = integer(k, "k (the number of segments)", least=1, where="uniform")
    if k > n:
        raise ValueError(f"uniform({n}, {k}): cannot cut {n} layers into {k} segments; use k <= {n}.")
    size = n // k
    return Plan(_segments_then_tail([size] * (k - 1) + [n - size * (k - 1)]), name=f"uniform({n}, {k})")


def sqrt_n(n: int) -> Plan:
    """Segments of ``ceil(sqrt(n))`` layers, all but the last checkpointed (Chen et al. 2016).

    About ``sqrt(n)`` checkpoints plus one segment of ``sqrt(n)`` recorded
    layers: ``peak_activations <= 2*ceil(sqrt(n)) - 1``, for ``n - ceil(sqrt(n))``
    recomputed layer forwards. For a perfect square it is ``uniform(n, sqrt(n))``.

    >>> plan = sqrt_n(64)
    >>> plan.peak_slots, plan.peak_activations, plan.forward_steps
    (7, 15, 56)
    """
    n = integer(n, "n (the number of layers)", least=1, where="sqrt_n")
    size = math.isqrt(n - 1) + 1  # ceil(sqrt(n))
    count, rest = divmod(n, size)
    sizes = [size] * count + ([rest] if rest else [])
    return Plan(_segments_then_tail(sizes), name=f"sqrt_n({n})")


def recursive(n: int) -> Plan:
    """Chen et al. (2016)'s log n plan: checkpoint the first half, recurse into both halves.

    Body of ``[a, b)``: ``(Segment(a, m, body of [a, m)), *body of [m, b))``
    with ``m`` the middle. About ``log2 n`` checkpoints and ``(n/2) log2 n``
    recomputed layer forwards.

    >>> plan = recursive(16)
    >>> plan.peak_slots, plan.peak_activations, plan.forward_steps
    (4, 5, 32)
    """
    n = integer(n, "n (the number of layers)", least=1, where="recursive")

    def body(start: int, stop: int) -> tuple[Step, ...]:
        if stop - start == 1:
            return (start,)
        middle = start + (stop - start + 1) // 2
        return (Segment(start, middle, body(start, middle)), *body(middle, stop))

    return Plan(body(0, n), name=f"recursive({n})")


def revolve(n: int, slots: int) -> Plan:
    """Griewank and Walther's binomial checkpointing: fewest recomputations with ``slots`` checkpoints.

    ``slots`` counts checkpoints, the one holding the input ``x0`` included
    (Griewank-Walther's ``s``). The plan is found by dynamic programming over
    "advance from ``x_a`` by ``j`` layers, store ``x_{a+j}``, reverse the rest
    with one slot fewer, then reverse the first ``j`` layers"; its
    ``forward_steps`` is the optimum ``r*n - C(slots+r, slots+1)``, ``r`` the
    least integer with ``C(slots+r, slots) >= n``. ``peak_slots <= slots``.

    >>> plan = revolve(10, 2)
    >>> plan.forward_steps, plan.peak_slots
    (20, 2)
    >>> 3 * 10 - math.comb(2 + 3, 2 + 1)       # r = 3: C(5, 2) = 10 >= 10 > C(4, 2)
    20
    >>> revolve(10, 3).forward_steps           # r = 2: 2*10 - C(5, 4)
    15
    """
    n = integer(n, "n (the number of layers)", least=1, where="revolve")
    slots = integer(slots, "slots (checkpoints, x0 included)", least=1, where="revolve")
    usable = max(1, min(slots, n - 1))  # with n-1 slots no layer is advanced over twice
    # steps[s][l]: least advances to reverse l layers from a stored input with s slots;
    # split[s][l]: the first advance j of such a schedule. With no slot left, only a
    # single layer (reversed from the current state) can be handled.
    steps = [[0, 0] + [math.inf] * (n - 1)] + [[0] * (n + 1) for _ in range(usable)]
    split = [[0] * (n + 1) for _ in range(usable + 1)]
    for s in range(1, usable + 1):
        for length in range(2, n + 1):
            steps[s][length], split[s][length] = min(
                (j + steps[s - 1][length - j] + steps[s][j], j) for j in range(1, length))

    def body(start: int, length: int, s: int) -> tuple[Step, ...]:
        if length == 1:
            return (start,)
        j = split[s][length]
        return (Segment(start, start + j, body(start, j, s)), *body(start + j, length - j, s - 1))

    return Plan(body(0, n, usable), name=f"revolve({n}, slots={slots})")


# ---------------------------------------------------------------------------
# Plans for a memory budget (dynamic programming, as rotor does)
# ---------------------------------------------------------------------------

_GRID_STEPS = 512  # memory resolution of plan_for_budget when sizes share no coarser unit


def plan_for_budget(layer_costs: Sequence[LayerCost | Sequence[float]], memory_budget: float) -> Plan:
    """The plan with the least forward time whose :meth:`Plan.peak_bytes` fits ``memory_budget``.

    ``layer_costs`` has one record per layer: ``LayerCost(input_bytes,
    saved_bytes, forward_s)`` or a plain ``(input_bytes, saved_bytes,
    forward_s)`` tuple (see :class:`LayerCost`;
    ``ckptlib.sequential.measure_layer_costs`` measures them). The budget bounds
    what the plan keeps (checkpoints and recorded layers), not parameters or
    gradients.

    Dynamic programming over segments ``[a, b)`` and memory left ``m``, as in
    rotor (Beaumont et al. 2019): the first step of ``[a, b)`` either records
    layer ``a`` (``m - saved_bytes[a]`` left for ``[a+1, b)``), or checkpoints
    ``[a, c)``: advance over it, reverse ``[c, b)`` with ``m - input_bytes[a]``,
    then rerun ``[a, c)`` with ``m``. Sizes are counted in a common unit: exact
    when all sizes are multiples of ``memory_budget / 512`` or coarser, else
    rounded up to it (the plan then fits, and is optimal up to that rounding).

    Raises ValueError when no plan fits, naming the least memory that does.

    >>> costs = [LayerCost(input_bytes=100, saved_bytes=200, forward_s=1.0)] * 6
    >>> plan_for_budget(costs, 1200).forward_steps          # everything recorded fits
    0
    >>> plan = plan_for_budget(costs, 700)
    >>> plan.peak_bytes(costs) <= 700, plan.forward_steps
    (True, 3)
    >>> plan_for_budget(costs, 250)
    Traceback (most recent call last):
    ...
    ValueError: no plan runs these 6 layers within 250 bytes: the least any plan keeps is 300 bytes. Raise memory_budget to at least 300, or make the layers smaller.
    """
    costs = _checked_costs(layer_costs, None)
    if not costs:
        raise ValueError("plan_for_budget: layer_costs is empty; give one LayerCost per layer.")
    memory_budget = number(memory_budget, "memory_budget", least=0, unit="number of bytes", where="plan_for_budget")
    n = len(costs)
    least_bytes, least_body = _least_memory_plan(costs)
    if least_bytes > memory_budget:
        raise ValueError(
            f"no plan runs these {n} layers within {memory_budget} bytes: the least any plan keeps is "
            f"{least_bytes} bytes. "
            f"Raise memory_budget to at least {least_bytes}, or make the layers smaller."
        )
    # Rounding sizes up can hide plans that fit only just; the least-memory plan is then the answer.
    body = _fastest_plan_within(costs, memory_budget) or least_body
    return Plan(body, name=f"plan_for_budget({n} layers, {memory_budget} bytes)")


def _body_from_choices(choose, start: int, stop: int, memory: int,
                       record_size: Sequence[int], checkpoint_size: Sequence[int]) -> tuple[Step, ...]:
    """Rebuild a body from a DP's choices: ``choose(a, b, memory)`` is -1 (record a) or c (checkpoint [a, c))."""
    steps: list[Step] = []
    while start < stop:
        choice = choose(start, stop, memory)
        if choice < 0:
            steps.append(start)
            memory -= record_size[start]
            start += 1
        else:
            inner = _body_from_choices(choose, start, choice, memory, record_size, checkpoint_size)
            steps.append(Segment(start, choice, inner))
            memory -= checkpoint_size[start]
            start = choice
    return tuple(steps)


def _least_memory_plan(costs: list[LayerCost]) -> tuple[float, tuple[Step, ...]]:
    """The smallest peak_bytes of any plan (exact), and a plan that has it."""
    n = len(costs)
    least: dict[tuple[int, int], float] = {(b, b): 0 for b in range(n + 1)}
    choice: dict[tuple[int, int], int] = {}
    for length in range(1, n + 1):
        for a in range(n - length + 1):
            b = a + length
            options = [(costs[a].saved_bytes + least[a + 1, b], -1)]
            options += [(max(costs[a].input_bytes + least[c, b], least[a, c]), c) for c in range(a + 1, b)]
            least[a, b], choice[a, b] = min(options)
    zeros = [0] * n
    body = _body_from_choices(lambda a, b, _: choice[a, b], 0, n, 0, zeros, zeros)
    return least[0, n], body


def _fastest_plan_within(costs: list[LayerCost], memory_budget: float) -> tuple[Step, ...] | None:
    """The body with the least recomputation time within the budget, on a memory grid; None if none fits."""
    import numpy as np

    n = len(costs)
    sizes = [size for cost in costs for size in cost[:2]]
    unit: float = memory_budget / _GRID_STEPS
    if all(isinstance(size, int) for size in sizes) and isinstance(memory_budget, int):
        common = math.gcd(*sizes) or 1
        if memory_budget // common <= _GRID_STEPS:
            unit = common
    limit = int(memory_budget // unit)
    record_size = [math.ceil(cost.saved_bytes / unit) for cost in costs]
    checkpoint_size = [math.ceil(cost.input_bytes / unit) for cost in costs]
    advanced_s = np.concatenate([[0.0], np.cumsum([cost.forward_s for cost in costs])])

    def after_spending(times: np.ndarray, size: int) -> np.ndarray:
        # times[..., m - size] at memory level m; infinitely slow where m < size
        shifted = np.full(times.shape, np.inf)
        if size <= limit:
            shifted[..., size:] = times[..., :limit + 1 - size]
        return shifted

    # time[a, b, m]: least recomputation seconds to reverse layers a..b-1 from a kept x_a with m
    # memory units; choice[a, b, m]: -1 to record layer a first, c to checkpoint a..c-1 first.
    time = np.full((n + 1, n + 1, limit + 1), np.inf)
    time[np.arange(n + 1), np.arange(n + 1)] = 0.0
    choice = np.full((n + 1, n + 1, limit + 1), -1, dtype=np.int32)
    for length in range(1, n + 1):
        for a in range(n - length + 1):
            b = a + length
            best = after_spending(time[a + 1, b], record_size[a])
            if length > 1:
                cuts = np.arange(a + 1, b)
                options = ((advanced_s[cuts] - advanced_s[a])[:, None]
                           + after_spending(time[cuts, b], checkpoint_size[a]) + time[a, cuts])
                fastest = options.argmin(axis=0)
                better = options[fastest, np.arange(limit + 1)] < best
                best = np.where(better, options[fastest, np.arange(limit + 1)], best)
                choice[a, b] = np.where(better, cuts[fastest], -1)
            time[a, b] = best
    if not np.isfinite(time[0, n, limit]):
        return None
    return _body_from_choices(lambda a, b, m: int(choice[a, b, m]), 0, n, limit, record_size, checkpoint_size)
