"""Where to keep activations along a chain of layers: uniform, sqrt(n), log n, Revolve, budgets.

A *plan* says which layers of a chain run inside a checkpoint and how each
checkpointed segment is run again when backward needs it;
``ckptlib.sequential.checkpoint_sequential`` runs it. Four modules:

===========  ================================================================
``plan``     what a plan is (``Plan``, ``Segment``, ``Action``, ``LayerCost``):
             nested checkpoints, the training step they make, their memory
``classic``  the classic schedules: ``uniform``, ``sqrt_n``, ``recursive``, ``revolve``
``budget``   ``plan_for_budget``: the fastest plan within a memory budget
``registry`` every schedule the course offers, once: the explorer's and the
             dashboard's menus and the demo models' ``checkpointing=`` switch read it
             (imported on its own: ``ckptlib.schedules.registry``)
===========  ================================================================

>>> revolve(10, 2).forward_steps, sqrt_n(16).peak_slots
(20, 3)
"""
from __future__ import annotations

from ckptlib.schedules.budget import plan_for_budget
from ckptlib.schedules.classic import recursive, revolve, sqrt_n, uniform
from ckptlib.schedules.plan import Action, LayerCost, Plan, Segment, Step

__all__ = [
    "Plan", "Segment", "Action", "LayerCost", "Step",
    "uniform", "sqrt_n", "recursive", "revolve", "plan_for_budget",
]
