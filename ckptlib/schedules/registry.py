"""Every schedule the course offers, in one table: the widgets' menus and the models' switch
read it.

A :class:`Schedule` says, once, what the three places that offer schedules need to know:

* ``ScheduleExplorer`` (``ckptlib.widgets.schedules``) lists the schedules that make a
  :class:`~ckptlib.schedules.Plan` (``name`` in its menu, ``parameter`` on its slider,
  ``curve`` the parameters its trade-off curve measures, ``marker`` the curve's symbol);
* ``MemoryDashboard`` (``ckptlib.widgets.dashboard``) lists them by ``label``, and hands a
  demo model ``mode`` (or, without one, the plan for the model's depth at
  ``dashboard_parameter``);
* the demo models' ``checkpointing=`` switch (``ckptlib.models``) takes every ``mode``: it
  runs the blocks with ``run`` when the schedule has one (checkpointing each block, say),
  else with ``checkpoint_sequential`` and the plan for its number of blocks.

Adding a schedule is one :func:`register` call here (or one more entry in
:data:`REGISTRY`'s table below); ``in_explorer`` / ``in_dashboard`` leave it out of a widget.

>>> [schedule.name for schedule in registered("explorer")]
['none', 'uniform', 'sqrt(n)', 'recursive', 'revolve', 'budget']
>>> modes()
('none', 'block', 'torch', 'sqrt', 'selective')
>>> REGISTRY["revolve"].make(8).name, REGISTRY["revolve"].dashboard_value(8).name
('revolve(8, slots=3)', 'revolve(8, slots=2)')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from ckptlib.core.checkpoint import checkpoint
from ckptlib.memory import format_bytes
from ckptlib.schedules.budget import plan_for_budget
from ckptlib.schedules.classic import recursive, revolve, sqrt_n, uniform
from ckptlib.schedules.plan import LayerCost, Plan
from ckptlib.selective import save_matmuls, selective_checkpoint

__all__ = [
    "Parameter",
    "Schedule",
    "REGISTRY",
    "register",
    "unregister",
    "registered",
    "modes",
    "by_mode",
]

PLACES = ("explorer", "dashboard", "models")
Runner = Callable[[nn.Sequential, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Parameter:
    """The one number a schedule takes: what it is, its default, and its range at n layers.

    >>> Parameter("s slots", 3, high=lambda n: n - 1).bounds(8)
    (1, 7, 1)
    """

    name: str  # the slider's description, e.g. "k segments"
    default: int
    low: int = 1
    high: Callable[[int], int] = lambda n: n  # the largest value for a chain of n layers
    step: int = 1

    def bounds(self, n: int) -> tuple[int, int, int]:
        """``(lowest, highest, step)`` for a chain of ``n`` layers."""
        return self.low, self.high(n), self.step


@dataclass(frozen=True)
class Schedule:
    """One schedule and what each place that offers it needs (see the module notes).

    Args:
        name: its key, and its entry in ``ScheduleExplorer``'s menu (``"revolve"``).
        label: its entry in ``MemoryDashboard``'s menu (``"Revolve (2 slots)"``).
        plan: ``(n, parameter) -> Plan`` for a chain of n layers (with ``needs_costs``:
            ``(n, parameter, costs)``, the layers' ``LayerCost`` list); ``None`` for a
            schedule that is no plan of the chain (checkpointing each block with torch).
        run: ``(blocks, x) -> output``: how the demo models run their blocks under it, when
            that is not ``checkpoint_sequential`` with its plan.
        parameter: the number it takes (``None``: none).
        mode: the demo models' ``checkpointing=`` string for it (``None``: they take its
            plan as a ``Plan`` object only).
        dashboard_parameter: the parameter the dashboard, which has no slider for it, uses
            (default: ``parameter.default``).
        curve: ``n -> parameters`` the explorer's trade-off curve measures at n layers
            (default: the default parameter only).
        marker: its matplotlib marker on the trade-off curve.
        in_explorer, in_dashboard: whether the widget lists it.
    """

    name: str
    label: str
    plan: Callable[..., Plan] | None = None
    run: Runner | None = None
    parameter: Parameter | None = None
    mode: str | None = None
    dashboard_parameter: int | None = None
    curve: Callable[[int], Iterable[int | None]] | None = None
    marker: str = "*"
    needs_costs: bool = False
    in_explorer: bool = True
    in_dashboard: bool = True

    def __post_init__(self) -> None:
        if not (
            isinstance(self.name, str) and self.name and isinstance(self.label, str) and self.label
        ):
            raise ValueError(
                f"Schedule: name and label must be non-empty strings, got name={self.name!r}, "
                f"label={self.label!r}."
            )
        if self.plan is None and self.run is None:
            raise ValueError(
                f"Schedule {self.name!r}: give plan=(n, parameter) -> Plan, or run=(blocks, x) "
                "-> output for a schedule that is no plan of the chain."
            )
        if self.plan is None and (self.mode is None or self.in_explorer):
            raise ValueError(
                f"Schedule {self.name!r} has no plan: the explorer cannot show it "
                "(in_explorer=False) and the models need a mode= string to run it."
            )

    def make(
        self, n: int, parameter: int | None = None, costs: Sequence[LayerCost] | None = None
    ) -> Plan:
        """The plan for ``n`` layers (``parameter``: default when ``None``; ``costs`` for a
        schedule that ``needs_costs``)."""
        if self.plan is None:
            raise ValueError(f"schedule {self.name!r} runs each block by itself; it makes no Plan.")
        if parameter is None and self.parameter is not None:
            parameter = self.parameter.default
        if not self.needs_costs:
            return self.plan(n, parameter)
        if costs is None:
            raise ValueError(
                f"schedule {self.name!r} needs the layers' costs (costs=[LayerCost, ...])."
            )
        return self.plan(n, parameter, list(costs))

    def curve_parameters(self, n: int) -> tuple[int | None, ...]:
        """The parameters of this schedule on the explorer's trade-off curve at ``n`` layers."""
        if self.curve is not None:
            return tuple(self.curve(n))
        return (None if self.parameter is None else self.parameter.default,)

    def dashboard_value(self, depth: int) -> str | Plan:
        """What the dashboard sets a demo model's ``checkpointing`` to, for ``depth`` blocks."""
        if self.mode is not None:
            return self.mode
        return self.make(depth, self.dashboard_parameter)


def _each_block(wrap: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> Runner:
    def run(blocks: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
        for block in blocks:
            x = wrap(block, x)
        return x

    return run


def _budget_plan(n: int, percent: int, costs: list[LayerCost]) -> Plan:
    # Whole bytes: with an integer budget plan_for_budget's memory grid is exact, so 100 % is
    # the plain chain (a float budget rounds the layers' sizes up and would miss it).
    budget = percent * sum(cost.saved_bytes for cost in costs) // 100
    plan = plan_for_budget(costs, budget)
    plan.name = f"plan_for_budget({percent}% = {format_bytes(budget)})"
    return plan


def _below(n: int, values: Iterable[int]) -> list[int]:
    return [value for value in values if value < n]


REGISTRY: dict[str, Schedule] = {}


def register(schedule: Schedule) -> Schedule:
    """Add ``schedule`` to every menu that lists it and, with a ``mode``, to the models' switch.

    Refuses a name, label or mode already taken (:func:`unregister` the old one first).
    """
    if not isinstance(schedule, Schedule):
        raise TypeError(f"register: expected a Schedule, got {type(schedule).__name__}.")
    for other in REGISTRY.values():
        for field in ("name", "label", "mode"):
            value = getattr(schedule, field)
            if value is not None and value == getattr(other, field):
                raise ValueError(
                    f"register: {field}={value!r} is taken by the schedule {other.name!r}; "
                    f"unregister({other.name!r}) first, or pick another {field}."
                )
    REGISTRY[schedule.name] = schedule
    return schedule


def unregister(name: str) -> Schedule:
    """Remove the schedule called ``name``; returns it."""
    if name not in REGISTRY:
        raise KeyError(f"unregister: no schedule {name!r}; registered: {', '.join(REGISTRY)}.")
    return REGISTRY.pop(name)


def registered(place: str | None = None) -> list[Schedule]:
    """The schedules in menu order; with ``place`` (``"explorer"``, ``"dashboard"`` or
    ``"models"``), those that place offers."""
    if place is None:
        return list(REGISTRY.values())
    if place not in PLACES:
        raise ValueError(
            f"registered: place={place!r} is not one of {', '.join(map(repr, PLACES))}."
        )
    shown = {
        "explorer": lambda s: s.in_explorer and s.plan is not None,
        "dashboard": lambda s: s.in_dashboard,
        "models": lambda s: s.mode is not None,
    }[place]
    return [schedule for schedule in REGISTRY.values() if shown(schedule)]


def modes() -> tuple[str, ...]:
    """The demo models' ``checkpointing=`` strings, in menu order."""
    return tuple(schedule.mode for schedule in registered("models"))


def by_mode(mode: object) -> Schedule | None:
    """The schedule whose ``mode`` is ``mode`` (``None``: no such string)."""
    return next((s for s in registered("models") if s.mode == mode), None)


for _schedule in (
    Schedule(
        "none",
        "none",
        plan=lambda n, _: Plan(list(range(n)), name="none"),
        run=lambda blocks, x: blocks(x),
        mode="none",
        marker="s",
    ),
    Schedule("block", "per block", run=_each_block(checkpoint), mode="block", in_explorer=False),
    Schedule(
        "torch",
        "per block (torch)",
        mode="torch",
        in_explorer=False,
        run=_each_block(lambda block, x: torch_checkpoint(block, x, use_reentrant=False)),
    ),
    Schedule(
        "uniform",
        "uniform (k segments)",
        plan=uniform,
        parameter=Parameter("k segments", 4),
        curve=lambda n: _below(n, (2, 4, 8)),
        marker="^",
        in_dashboard=False,
    ),
    Schedule("sqrt(n)", "sqrt(n)", plan=lambda n, _: sqrt_n(n), mode="sqrt", marker="D"),
    Schedule(
        "recursive",
        "recursive (log n)",
        plan=lambda n, _: recursive(n),
        marker="v",
        in_dashboard=False,
    ),
    # Revolve keeps at most `slots` block inputs, however deep the chain: flat memory, more
    # recomputation. The dashboard uses 2 slots.
    Schedule(
        "revolve",
        "Revolve (2 slots)",
        plan=revolve,
        dashboard_parameter=2,
        marker="o",
        parameter=Parameter("s slots", 3, high=lambda n: max(1, n - 1)),
        curve=lambda n: _below(n, (1, 2, 4, 8)),
    ),
    Schedule(
        "selective",
        "selective (save matmuls)",
        mode="selective",
        in_explorer=False,
        run=_each_block(lambda block, x: selective_checkpoint(block, x, policy=save_matmuls)),
    ),
    Schedule(
        "budget",
        "plan for a budget",
        plan=_budget_plan,
        needs_costs=True,
        marker="P",
        parameter=Parameter("budget %", 50, low=5, high=lambda n: 100, step=5),
        curve=lambda n: (25, 50),
        in_dashboard=False,
    ),
):
    register(_schedule)
del _schedule
