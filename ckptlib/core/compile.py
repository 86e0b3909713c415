"""``checkpoint`` under ``torch.compile``: it runs eagerly, between compiled graphs.

Dynamo cannot trace Python saved-tensor hooks: a traced forward would save the compiled
graph's tensors while the eager rerun saves others, and hand them over by position. So
``checkpoint`` is disabled for Dynamo, as by ``torch.compiler.disable``: inside a compiled
function Dynamo breaks the graph at the call, runs the checkpoint eagerly, hooks and all, and
compiles the code before and after it. With ``fullgraph=True`` the break is an error that
says so. A compiled function *inside* a checkpoint runs compiled in forward and rerun alike.

Decorating ``checkpoint`` with ``torch.compiler.disable`` would import Dynamo, a second, at
every ``import ckptlib``. So :func:`run_eagerly_under_dynamo` puts on the function the two marks
that decorator sets, which Dynamo reads where it meets a call; should Dynamo trace into it
anyway, its first line hands over to :func:`outside_dynamo`, the real decorated function, made
when first needed.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["COMPILE_REASON", "run_eagerly_under_dynamo", "outside_dynamo"]

COMPILE_REASON = ("ckptlib.checkpoint runs eagerly under torch.compile (Python saved-tensor "
                  "hooks cannot be traced): drop fullgraph=True, or use torch.utils.checkpoint, "
                  "which the compiler traces, inside a fullgraph region.")

_disabled: dict[Callable[..., Any], Callable[..., Any]] = {}


def run_eagerly_under_dynamo(fn: Callable[..., Any],
                             reason: str = COMPILE_REASON) -> Callable[..., Any]:
    """Mark ``fn`` so Dynamo breaks the graph at its call and runs it eagerly; returns ``fn``."""
    fn._torchdynamo_disable = True   # type: ignore[attr-defined]
    fn._torchdynamo_disable_msg = reason   # type: ignore[attr-defined]
    return fn


def outside_dynamo(fn: Callable[..., Any], reason: str = COMPILE_REASON) -> Callable[..., Any]:
    """``torch.compiler.disable(fn)``, made once per function."""
    disabled = _disabled.get(fn)
    if disabled is None:
        try:
            disabled = torch.compiler.disable(fn, reason=reason)
        except TypeError:   # torch before 2.6: no reason= (the graph break is the same)
            disabled = torch.compiler.disable(fn)
        _disabled[fn] = disabled
    return disabled
