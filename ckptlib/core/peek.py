"""Looking at what a checkpoint stored without recomputing it (for inspection tools and graphs).

Reading ``grad_fn._saved_<name>`` of a tensor a checkpoint dropped would normally run the
region again. Inside :func:`peek_saved` the core's unpack answers instead with an empty tensor
on the ``meta`` device (right shape and dtype) and leaves a :class:`PackedInfo` to take.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from ckptlib.core.errors import RegionId, TensorMeta

__all__ = ["PackedInfo", "peek_saved", "peeking"]


@dataclass(frozen=True)
class PackedInfo:
    """What a checkpoint stored for one saved tensor, as seen through :func:`peek_saved`."""

    region: RegionId
    index: int
    meta: TensorMeta
    unpack_count: int
    recompute_count: int
    # False when dropping it freed nothing (an input, a parameter, a view of one)
    frees_memory: bool = True


class _Peek:
    def __init__(self) -> None:
        self.last: PackedInfo | None = None

    def take(self) -> PackedInfo | None:
        info, self.last = self.last, None
        return info

    def answer(self, frame: Any, holder: Any) -> torch.Tensor:
        """What the core's unpack returns while peeking: a meta tensor, its info kept to take."""
        meta = frame.meta(holder.index)
        self.last = PackedInfo(frame.region, holder.index, meta, holder.unpack_count,
                               frame.recompute_count, holder.frees_memory)
        return torch.empty(meta.shape, dtype=meta.dtype, device="meta")


class _State(threading.local):
    peek: "_Peek | None" = None


state = _State()   # ``state.peek``: this thread's open peek_saved (the core reads it at unpack)


def peeking() -> "_Peek | None":
    """The open :func:`peek_saved` of this thread, or ``None``."""
    return state.peek


@contextlib.contextmanager
def peek_saved() -> Iterator[_Peek]:
    """Read checkpointed saved tensors without recomputing them (for inspection tools).

    Inside the block, reading ``grad_fn._saved_<name>`` of a tensor a checkpoint dropped
    returns an empty tensor on the ``meta`` device with the right shape and dtype, and
    ``peek.take()`` returns its :class:`PackedInfo`; for a tensor no checkpoint touched it
    returns ``None``.

    >>> import torch, ckptlib
    >>> x = torch.randn(3, requires_grad=True)
    >>> y = ckptlib.checkpoint(torch.sin, x)
    >>> with peek_saved() as peek:
    ...     saved = y.grad_fn._saved_self
    ...     info = peek.take()
    >>> saved.device.type, info.index, info.recompute_count
    ('meta', 0, 0)
    """
    previous = state.peek
    state.peek = _Peek()
    try:
        yield state.peek
    finally:
        state.peek = previous
