"""A checkpoint's arguments: kept for the rerun as autograd saved tensors, and put back together.

The tensors among the arguments are handed to autograd as saved tensors (:func:`save_inputs`),
not kept by the frame itself: inside an outer checkpoint they pass through its pack hook and are
dropped too (nesting, also with ``torch.utils.checkpoint`` on either side). Arguments that are
not tensors only (keywords, nested lists, dicts, numbers) are flattened once (:class:`Arguments`)
and rebuilt around the rerun's tensors; plain tensor arguments skip all this (the core's fast
path).
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["Arguments", "save_inputs"]

_make_saved_tensor = getattr(torch._C._autograd, "_make_saved_tensor", None)   # None on older torch


class Arguments:
    """``(args, kwargs)`` as a pytree: the tensors apart, the rest kept as it was."""

    def __init__(self, args: tuple, kwargs: dict) -> None:
        leaves, self.spec = tree_flatten((args, kwargs), is_leaf=_is_size)
        self.positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        self.tensors = [leaves[i] for i in self.positions]
        # what is not a tensor, where it was (also searched for the caller's generators)
        self.leaves = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]

    def rebuild(self, tensors: list[torch.Tensor]) -> tuple[Any, dict]:
        """``(args, kwargs)`` again, with ``tensors`` where the tensors were."""
        leaves = list(self.leaves)
        for position, tensor in zip(self.positions, tensors):
            leaves[position] = tensor
        args, kwargs = tree_unflatten(leaves, self.spec)
        return args, kwargs


def _is_size(value: Any) -> bool:
    return isinstance(value, torch.Size)   # a pytree node that unflattens to a tuple: keep it whole


def save_inputs(tensors: list[torch.Tensor]) -> list:
    """Hand the inputs to autograd as saved tensors (through the active pack hook: nesting);
    each of the returned objects gives its tensor back with ``.unpack()``."""
    if _make_saved_tensor is not None:
        saved = []
        for tensor in tensors:
            saved.append(_make_saved_tensor(tensor, False))   # (tensor, is_output)
        return saved
    anchor = torch.empty(0, requires_grad=True)   # older torch: a do-nothing Function saves them
    node = _InputSaver.apply(anchor, *tensors).grad_fn
    return [_SavedByNode(node, i) for i in range(len(tensors))]


class _SavedByNode:
    """One input saved by an ``_InputSaver`` node (torch without ``_make_saved_tensor``)."""

    def __init__(self, node: Any, index: int) -> None:
        self.node, self.index = node, index

    def unpack(self) -> torch.Tensor:
        return self.node.saved_tensors[self.index]


class _InputSaver(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, *tensors):
        ctx.save_for_backward(*tensors)
        return anchor.new_empty(0)

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover - its output is never used
        return (None,) * (1 + len(ctx.saved_tensors))
