"""What a saved tensor is, as a checkpoint remembers it: its key, and its metadata in words.

The rerun hands its i-th saved tensor to the i-th holder, so it must be the tensor the forward
saved i-th. Each pack of the rerun compares its :class:`SavedKey` with the forward's: shape,
dtype, device, and its *producer*, the kind of autograd node that made it (``ExpBackward0``), or
"an input of the region" (it shares storage with one), or a leaf that requires grad (a
parameter) or not (a constant). Equal shapes are not enough: a global flag that turns
``t.exp()`` into ``t.sin()`` saves a tensor of the same shape, but ``exp`` saves its *result*
and ``sin`` its *input*, so ``ExpBackward0`` would be handed ``t`` instead of ``exp(t)``. The
producer costs one attribute read per pack. It cannot see an op swapped for another that saves
the same tensor (``t.sin()`` for ``t.cos()``: both save ``t``, so the handed value is right
anyway) nor different numbers made by the same kind of node (``t * 2`` against ``t * 3``).

>>> import torch
>>> x = torch.randn(3, requires_grad=True)
>>> key = saved_key(x.exp(), None, set())
>>> key.producer.__name__, str(TensorMeta.from_key(key))
('ExpBackward0', '3 float32 on cpu (12 bytes)')
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Collection, NamedTuple

import torch

__all__ = ["SavedKey", "TensorMeta", "saved_key", "key_mismatch", "producer_words",
           "INPUT", "PARAMETER", "CONSTANT", "VIEW", "MISMATCH_CAUSES"]

INPUT = "an input of the region"
PARAMETER = "a parameter (a leaf that requires grad)"
CONSTANT = "a constant (a leaf that does not require grad)"
VIEW = "view"

MISMATCH_CAUSES = (
    "Usual causes: non-deterministic control flow in the checkpointed function (branches on "
    "random numbers, time or a global flag), data-dependent shapes (e.g. torch.nonzero on values "
    "that changed), global state that changed between forward and backward (a module attribute, "
    "train/eval mode), or an input modified in place after the forward pass. Make the function "
    "depend only on its inputs, or keep its activations by not checkpointing it."
)


class SavedKey(NamedTuple):
    """What the forward saved at one index, compared at the same index of every rerun.

    ``producer`` is the autograd node class that made the tensor, one of ``INPUT``,
    ``PARAMETER``, ``CONSTANT``, or ``(VIEW, <that>)`` for a view (see :func:`saved_key`).
    """

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    producer: Any


@dataclass(frozen=True)
class TensorMeta:
    """What a message or a trace event says about a saved tensor: shape, dtype, device, bytes."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    nbytes: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TensorMeta":
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"TensorMeta.of needs a tensor, got {type(tensor).__name__}.")
        return cls.from_key((tensor.shape, tensor.dtype, tensor.device))

    @classmethod
    def from_key(cls, key: tuple) -> "TensorMeta":
        """From a saved tensor's key; only its shape, dtype and device are used."""
        shape, dtype, device = key[:3]
        return cls(tuple(shape), dtype, device, math.prod(shape) * dtype.itemsize)

    def __str__(self) -> str:
        dims = "x".join(map(str, self.shape)) or "scalar"
        dtype = str(self.dtype).replace("torch.", "")
        return f"{dims} {dtype} on {self.device} ({self.nbytes} bytes)"


def saved_key(tensor: torch.Tensor, ptr: int | None, input_ptrs: Collection[int]) -> SavedKey:
    """The :class:`SavedKey` of a saved tensor; ``ptr`` is its ``storage_ptr``.

    A view's producer is its base's, marked as a view: which node makes a view depends on
    the dispatch path (``reshape`` is a ``ReshapeAliasBackward0`` normally, a
    ``ViewBackward0`` under a dispatch mode such as selective checkpointing's rerun).
    Selective checkpointing's plans extend this key with the node's place.
    """
    if ptr and ptr in input_ptrs:
        return _key(SavedKey, (tensor.shape, tensor.dtype, tensor.device, INPUT))
    base = tensor._base
    source = tensor if base is None else base
    node = source.grad_fn
    made_by: Any = (type(node) if node is not None
                    else PARAMETER if source.requires_grad else CONSTANT)
    return _key(SavedKey, (tensor.shape, tensor.dtype, tensor.device,
                           made_by if base is None else (VIEW, made_by)))


_key = tuple.__new__   # SavedKey(...) without its Python-level __new__: this runs at every save


def producer_words(key: tuple) -> str:
    """How a key's tensor was made, in words that follow "a tensor" or "one"."""
    made_by = key[3]
    is_view = isinstance(made_by, tuple)
    made_by = made_by[1] if is_view else made_by
    if isinstance(made_by, str):
        return f"that is a view of {made_by}" if is_view else f"that is {made_by}"
    made = f"made by {made_by.__name__}"
    return f"that is a view of a tensor {made}" if is_view else made


def key_mismatch(index: int, forward: tuple, rerun: tuple) -> str:
    """Why the rerun's saved tensor ``#index`` is not the forward's, for a ``CheckpointError``."""
    before, after = TensorMeta.from_key(forward), TensorMeta.from_key(rerun)
    if before != after:
        what = f"forward saved {before}, recomputation produced {after}"
    else:
        what = (f"forward saved {before} {producer_words(forward)}; recomputation produced one "
                f"{producer_words(rerun)} (same shape, another operation)")
    return (f"saved tensor #{index} differs between forward and recomputation: {what}. "
            f"{MISMATCH_CAUSES}")
