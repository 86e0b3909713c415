"""Which ``nn.Module`` made which autograd node: sequence-number ranges recorded by forward hooks.

Design notes
============

An autograd node does not know which ``nn.Module`` made it, but every node
gets a per-thread *sequence number* when it is created. Inside
:func:`trace_modules`, forward hooks note the sequence numbers at the start
and end of each module call; a node belongs to the innermost call whose range
holds its number. That is all ``to_dot(..., collapse="module")`` needs to draw
a 12-block Transformer as 12 boxes.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Iterator

import torch
from torch import nn

from ckptlib.core.checkpoint import is_recomputing

__all__ = ["ModuleTrace", "trace_modules"]


class ModuleTrace:
    """Module calls seen by :func:`trace_modules`, as ranges of autograd sequence numbers."""

    def __init__(self, model: nn.Module) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"ModuleTrace: model must be an nn.Module, got {type(model).__name__}.")
        self.model = model
        self.module_types = {path: type(module).__name__ for path, module in model.named_modules()}
        self.calls: list[tuple[int, int, str]] = []  # (first sequence number, end, module path)
        self._open: list[int] = []

    def module_of(self, sequence_nr: int) -> str | None:
        """Path of the innermost module call that created the node with this sequence number."""
        best: tuple[int, int, str] | None = None
        for start, end, path in self.calls:
            # Calls nest, so among those holding the number the innermost starts last
            # (and, on a tie, ends first).
            if start <= sequence_nr < end and (best is None or (start, -end) > (best[0], -best[1])):
                best = (start, end, path)
        return best[2] if best is not None else None

    def _pre_hook(self, module: nn.Module, args: Any) -> None:
        self._open.append(torch.autograd._get_sequence_nr())

    def _post_hook(self, path: str):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            start = self._open.pop()
            # A checkpoint's recomputation reruns modules; its nodes never join the graph.
            if not is_recomputing():
                self.calls.append((start, torch.autograd._get_sequence_nr(), path))

        return hook


def trace_modules(model: nn.Module) -> ContextManager[ModuleTrace]:
    """Remember which submodule created each autograd node during the forward passes in the block.

    Pass the result as ``autograd_graph(..., modules=trace)``; ``to_dot(graph,
    collapse="module")`` then draws one box per submodule. Leaves take the
    module of their parameter name. Run the forward in this thread (sequence
    numbers are per thread); the hooks are removed when the block ends.

    >>> import torch
    >>> from ckptlib.graph import autograd_graph
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    >>> with trace_modules(model) as modules:
    ...     out = model(torch.randn(2, 4))
    >>> graph = autograd_graph(out, modules=modules)
    >>> for node in graph.ops:
    ...     print(node.id, node.op, node.name, "made by module", node.module)
    n0 ReluBackward0 None made by module 1
    n1 AddmmBackward0 None made by module 0
    n2 AccumulateGrad 0.bias made by module 0
    n3 TBackward0 None made by module 0
    n4 AccumulateGrad 0.weight made by module 0
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"trace_modules: model must be an nn.Module (the model whose forward you run "
            f"in the block), got {type(model).__name__}."
        )
    return _hooked(ModuleTrace(model))


@contextlib.contextmanager
def _hooked(trace: ModuleTrace) -> Iterator[ModuleTrace]:
    handles = []
    try:
        for path, module in trace.model.named_modules():
            handles.append(module.register_forward_pre_hook(trace._pre_hook))
            handles.append(module.register_forward_hook(trace._post_hook(path), always_call=True))
        yield trace
    finally:
        for handle in handles:
            handle.remove()
