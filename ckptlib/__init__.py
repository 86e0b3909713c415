"""ckptlib: activation checkpointing built from saved-tensor hooks.

Public names are imported lazily, so ``import ckptlib`` stays cheap and
``ckptlib.graph`` never drags matplotlib or ipywidgets along.

>>> import torch, ckptlib
>>> x = torch.randn(4, requires_grad=True)
>>> y = ckptlib.checkpoint(lambda t: t.sin().exp(), x)
>>> y.sum().backward()
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Imported eagerly: the function is what ``import ckptlib`` is for. Its module is
# ``ckptlib.core.checkpoint`` (the mechanism; ``ckptlib/core/__init__.py`` says what to read next).
from ckptlib.core.checkpoint import CheckpointError as CheckpointError, checkpoint as checkpoint

# public name -> module that defines it (see docs/design.md, "Module map")
_PUBLIC = {
    "record_trace": "core.trace",
    "CheckpointTrace": "core.trace",
    "TraceEvent": "core.trace",
    "StateUpdatedTwiceWarning": "core.checks",
    "NotReplayedRandomWarning": "rng",
    "RecomputeAgain": "selective.modes",
    "is_recomputing": "core.checkpoint",
    "peek_saved": "core.peek",
    "apply_checkpointing": "apply",
    "remove_checkpointing": "apply",
    "plan_checkpointing": "model_plan",
    "StepPlan": "step_plan",
    "checkpoint_sequential": "sequential",
    "Plan": "schedules",
    "uniform": "schedules",
    "sqrt_n": "schedules",
    "recursive": "schedules",
    "revolve": "schedules",
    "plan_for_budget": "schedules",
    "Segment": "schedules",
    "Action": "schedules",
    "LayerCost": "schedules",
    "measure_layer_costs": "sequential",
    "selective_checkpoint": "selective",
    "save_matmuls": "selective",
    "megatron_attention": "selective",
    "policy_from_costs": "selective",
    "SelectivePlans": "selective",
    "offload_saved_tensors": "offload",
    "saved_tensors_report": "inspect",
    "record_saved": "inspect",
    "MemoryMeter": "memory",
    "measure": "memory",
    "autograd_graph": "graph",
    "to_dot": "graph",
    "render_svg": "graph",
    "render_png": "graph",
    "with_statuses": "graph",
    "trace_modules": "graph",
    "MLPChain": "models",
    "TinyTransformer": "models",
    "MemoryDashboard": "widgets",
    "BackwardStepper": "widgets",
    "ScheduleExplorer": "widgets",
    "PolicyExplorer": "widgets",
}

__all__ = sorted([*_PUBLIC, "checkpoint", "CheckpointError"])


def __getattr__(name: str) -> Any:
    module_name = _PUBLIC.get(name)
    if module_name is None:
        raise AttributeError(f"module 'ckptlib' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"ckptlib.{module_name}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
