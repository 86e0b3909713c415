"""What a checkpointing plan is: nested checkpoints over a chain of layers, and the training
step they make.

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

from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple, Sequence, Union

from ckptlib import palette
from ckptlib._arguments import got, integer, number

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["Plan", "Segment", "Action", "LayerCost", "Step"]


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
        start = integer(self.start, "start", where=where)
        stop = integer(self.stop, "stop", where=where)
        if not 0 <= start < stop:
            raise ValueError(f"{where}: need 0 <= start < stop (the segment holds layers "
                             "start .. stop-1).")
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
    """What one layer of a chain costs, as :func:`plan_for_budget` and :meth:`Plan.peak_bytes`
    use it.

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
        self.body: tuple[Step, ...] = _checked_body(body, "Plan", "body",
                                                    "e.g. Plan([Segment(0, 2), 2])")
        if not isinstance(name, str):
            raise TypeError(f"Plan: name must be a string (how the plan was made), {got(name)}.")
        stop = _layers_end(self.body)
        _check_steps(self.body, 0, stop, "plan")
        self.n = stop
        self.name = name
        self.actions: tuple[Action, ...] = _actions(self.body)
        self.forward_steps = sum(a.stop - a.start for a in self.actions
                                 if a.op == "forward" and not a.keep)
        self.forward_calls = sum(a.stop - a.start for a in self.actions if a.op == "forward")
        self.peak_slots = max((len(checkpoints) for checkpoints, _ in self.states()), default=0)
        self.peak_activations = self._peak(lambda layer: 1, lambda layer: 1)

    # -- costs --------------------------------------------------------------
    def peak_bytes(self, layer_costs: Sequence[LayerCost | Sequence[float]]) -> float:
        """The most bytes the plan keeps at once: checkpoints' ``input_bytes`` plus recorded layers'
        ``saved_bytes`` (an upper bound; see "Memory model" in the module notes).

        >>> from ckptlib.schedules import uniform
        >>> uniform(4, 2).peak_bytes([(10, 30, 1.0)] * 4)      # x0 kept, layers 2-3 recorded
        70
        """
        costs = checked_costs(layer_costs, self.n)
        return self._peak(lambda layer: costs[layer].input_bytes,
                          lambda layer: costs[layer].saved_bytes)

    def forward_s(self, layer_costs: Sequence[LayerCost | Sequence[float]]) -> float:
        """Seconds of layer forwards in one training step (first forward and recomputations).

        >>> from ckptlib.schedules import uniform
        >>> uniform(4, 2).forward_s([(10, 30, 1.0)] * 4)        # 4 layers + 2 recomputed
        6.0
        """
        costs = checked_costs(layer_costs, self.n)
        return sum(costs[layer].forward_s for a in self.actions if a.op == "forward"
                   for layer in range(a.start, a.stop))

    def states(self) -> Iterator[tuple[frozenset[int], frozenset[int]]]:
        """(checkpoints held, layers recorded and not yet reversed) after each of ``actions``.

        >>> plan = Plan([Segment(0, 2), 2])
        >>> [(sorted(held), sorted(recorded)) for held, recorded in plan.states()][:3]
        [([0], []), ([0], []), ([0], [2])]
        """
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
                    for checkpoints, recorded in self.states()), default=0)

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
        for action, (checkpoints, recorded) in zip(self.actions, self.states()):
            strip = ["o" if i in checkpoints else "#" if i in recorded else "."
                     for i in range(self.n)]
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
        forward; orange: backward; green horizontal bars: checkpoints held (the
        colours of ``ckptlib.palette``).

        >>> import matplotlib
        >>> from ckptlib.schedules import revolve
        >>> matplotlib.use("Agg")
        >>> ax = revolve(8, 2).plot()
        >>> ax.get_xlabel()
        'time (layer forward and backward steps)'
        """
        import matplotlib.pyplot as plt
        from matplotlib.axes import Axes

        if ax is not None and not isinstance(ax, Axes):
            raise TypeError(f"Plan.plot: ax must be a matplotlib Axes to draw on, or None for a "
                            f"new figure, {got(ax)}.")
        if ax is None:
            _, ax = plt.subplots(figsize=(9, 3.5))
        styles = {
            ("forward", False): dict(color=palette.MUTED, linestyle="--",
                                     label="forward, keep nothing"),
            ("forward", True): dict(color=palette.FORWARD, label="forward, record"),
            ("backward", False): dict(color=palette.BACKWARD, label="backward"),
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
                ends = ([action.start, action.stop] if action.op == "forward"
                        else [action.stop, action.start])
                ax.plot([time, time + span], ends, linewidth=2,
                        **once(styles[action.op, action.keep]))
                time += span
            elif action.op == "store":
                stored_at[action.start] = time
            else:
                ax.hlines(action.start, stored_at.pop(action.start), time, color=palette.SAVED,
                          linewidth=5, alpha=0.4, **once(dict(label="checkpoint held")))
        ax.set_xlabel("time (layer forward and backward steps)")
        ax.set_ylabel("layer (x_i: input of layer i)")
        ax.set_title(f"{self.name}: {self.forward_steps} recomputed layer forwards, "
                     f"at most {self.peak_slots} checkpoints")
        ax.legend(loc="upper right", fontsize="small")
        return ax


def _checked_body(body: Any, where: str, name: str, example: str) -> tuple[Step, ...]:
    """``body`` as a tuple, when it is an ordered collection of steps (sets, dicts and strings
    are not)."""
    if isinstance(body, (str, bytes, Set, Mapping)) or not isinstance(body, Iterable):
        raise TypeError(f"{where}: {name} must be a list or tuple of steps (layer indices and "
                        f"Segments, in layer order), {example}; {got(body)}.")
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


def checked_costs(layer_costs: Sequence[LayerCost | Sequence[float]],
                  n: int | None) -> list[LayerCost]:
    """The records as LayerCosts of plain Python numbers (a NumPy integer counts as an int)."""
    try:
        costs = [LayerCost(*record) for record in layer_costs]
    except TypeError as error:
        raise TypeError("layer_costs must be one (input_bytes, saved_bytes, forward_s) record per "
                        f"layer, e.g. LayerCost(4096, 8192, 1e-4): {error}") from None
    if n is not None and len(costs) != n:
        raise ValueError(f"layer_costs has {len(costs)} records, but the plan has {n} layers; "
                         "give one LayerCost per layer.")
    return [LayerCost(*(number(value, field, least=0, where=f"layer_costs[{layer}] = {cost}")
                        for field, value in zip(LayerCost._fields, cost)))
            for layer, cost in enumerate(costs)]
