"""Storage identity: which memory a tensor lives in, the one way every module asks it.

Two tensors share memory when they share a storage: a view, ``detach()``, an alias. The
pointer of the storage's first byte names it; ``None`` means there is no memory to compare.

>>> import torch
>>> a = torch.zeros(4)
>>> storage_ptr(a) == storage_ptr(a[1:]) == storage_ptr(a.detach())
True
>>> storage_ptr(torch.empty(0)) is None
True
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["storage_ptr", "storage_ptrs", "storage_bytes"]


def storage_ptr(tensor: torch.Tensor) -> int | None:
    """Where ``tensor``'s storage starts: which memory it lives in, shared by its views and aliases.

    ``None`` where there is no memory to compare: layouts without a storage (sparse, mkldnn,
    jagged nested), wrapper subclasses without one of their own (FSDP2's sharded parameters),
    and empty or meta tensors (pointer 0).
    """
    try:
        return tensor.untyped_storage().data_ptr() or None
    except (RuntimeError, NotImplementedError):
        return None


def storage_ptrs(tensors: Iterable[torch.Tensor]) -> set[int]:
    """The storage pointers of ``tensors`` (those without memory left out)."""
    ptrs = set(map(storage_ptr, tensors))
    ptrs.discard(None)
    return ptrs


def storage_bytes(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    """storage pointer -> its size in bytes, each storage once (those without memory left out)."""
    sizes: dict[int, int] = {}
    for tensor in tensors:
        ptr = storage_ptr(tensor)
        if ptr:
            sizes[ptr] = tensor.untyped_storage().nbytes()
    return sizes
