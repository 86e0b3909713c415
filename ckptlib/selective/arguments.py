"""Clear errors for bad arguments of the public selective functions, raised at the call.

A flag that is not a bool, a count that is a string, a budget below zero: caught
before anything runs (no dispatch mode entered, no hook installed, no plan
counted), with a message that names the function, the argument and what it
accepts. A value that only looks right (``"no"`` is truthy) would otherwise be
used as it is, or fail deep inside a forward pass.
"""
from __future__ import annotations

import math
import numbers
from typing import Any


def _require_bool(where: str, **flags: Any) -> None:
    """Each keyword is a flag of ``where`` that must be ``True`` or ``False``.

    >>> _require_bool("selective_contexts", replay_random=True)
    >>> _require_bool("selective_contexts", replay_random="no")
    Traceback (most recent call last):
    ...
    TypeError: selective_contexts: replay_random must be True or False, got 'no' (str).
    """
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{where}: {name} must be True or False, got {value!r} ({type(value).__name__}).")


def _require_int(where: str, name: str, value: Any, *, minimum: int, unit: str = "") -> None:
    """``value`` must be an int (not a bool) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{where}: {name} must be an int{unit}, got {value!r} ({type(value).__name__}).")
    if value < minimum:
        raise ValueError(f"{where}: {name} must be at least {minimum}, got {value}.")


def _require_number(where: str, name: str, value: Any, *, what: str) -> None:
    """``value`` must be a finite real number >= 0 (``what`` says what it means).

    >>> _require_number("policy_from_costs", "memory_ratio", "half", what="a fraction of the activations")
    Traceback (most recent call last):
    ...
    TypeError: policy_from_costs: memory_ratio must be a number (a fraction of the activations), got 'half' (str).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where}: {name} must be a number ({what}), got {value!r} ({type(value).__name__}).")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{where}: {name} must be a finite number >= 0 ({what}), got {value}.")


def _qualname(obj: Any) -> str:
    """How an error names a function or callable object: ``block``, ``Block.forward``, ``CostPolicy``."""
    return getattr(obj, "__qualname__", None) or type(obj).__qualname__
