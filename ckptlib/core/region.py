"""How a checkpoint names its region: ``Block.forward@3``, or ``transformer.h.1@3`` by module path.

>>> import torch
>>> RegionId(function_name(torch.sin), 7)
RegionId(name='sin', number=7)
>>> str(RegionId("transformer.h.1", 3))
'transformer.h.1@3'
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

__all__ = ["RegionId", "function_name"]


class RegionId(NamedTuple):
    """One checkpoint call: what it runs (a function's name, or a module path) and its number."""

    name: str
    number: int

    def __str__(self) -> str:
        return f"{self.name}@{self.number}"


def function_name(fn: Any, through_partials: bool = False) -> str:
    """How a region and its messages name ``fn``: ``Block.forward``, ``sin``, else its type's name;
    with ``through_partials``, a ``functools.partial`` by what it calls (Hugging Face passes them).

    Never raises: a user's callable may answer every attribute (a proxy) or raise from a property.
    """
    while through_partials and type(fn) is functools.partial:
        fn = fn.func
    try:
        name = getattr(fn, "__qualname__", None)
        if isinstance(name, str) and name.startswith("_VariableFunctions"):  # torch.sin: "sin"
            name = getattr(fn, "__name__", None)
    except Exception:
        name = None
    return name if isinstance(name, str) and name else type(fn).__name__
