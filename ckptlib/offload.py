"""Offloading: keep saved tensors in CPU memory between forward and backward.

Checkpointing trades memory for compute. Offloading trades memory for
transfers: the tensors autograd saves are copied to host memory in forward and
copied back when backward needs them. It is one pair of saved-tensor hooks::

    pack   (forward):  device tensor -> host copy       (device memory freed)
    unpack (backward): host copy     -> device tensor   (lives until used)

Design notes
============

What is moved. A saved tensor is copied to the host unless that frees nothing:

* it is already on the CPU (a CPU run offloads nothing and copies nothing);
* it is a leaf that requires grad, or a view of one: parameters (``F.linear``
  saves ``weight.t()``, a view of the weight) and inputs you differentiate
  against. They outlive the step anyway, so a copy would only cost a transfer;
* it is not a plain strided tensor (sparse, nested): kept as it is.

Copies that do not stall. On CUDA the host copy goes to *pinned*
(page-locked) memory with ``non_blocking=True``: the copy engine reads the
device memory while the GPU keeps computing, and the forward pass does not wait
for it. This is safe without explicit synchronisation: the copy is queued on
the current stream, so the caching allocator reuses the source memory only
after it; the host buffer is read back only by the unpack's device copy, queued
behind it on the stream backward uses for that op; and PyTorch's pinned-memory
allocator does not recycle a pinned buffer while a copy that uses it is
pending. Pageable memory (``pin_memory=False``) makes every copy synchronous.

Compared with ``torch.autograd.graph.save_on_cpu(pin_memory=...)``:

* ``save_on_cpu`` copies every saved tensor, CPU tensors and parameters
  included; this hook keeps those in place (no copy, no extra memory);
* ``save_on_cpu`` makes the device-to-host copy synchronous even when pinned
  (``copy_`` without ``non_blocking``); here it is asynchronous when pinned;
* ``save_on_cpu`` copies into a contiguous tensor; here the copy keeps the
  original strides (``empty_like``), so backward formulas see the same layout;
* here, ``offloaded_bytes`` and ``kept_count`` say what happened;
* here, a saved tensor modified in place after forward is an error at unpack, as in
  plain autograd; ``save_on_cpu`` hands backward the modified values (on a CPU, where it
  keeps the tensor itself) or the stale copy, silently.
Both copy a tensor saved twice (say, by two ops) twice.

Saved-tensor hooks switch autograd's in-place check off: autograd compares a saved
tensor's version counter at unpack only when it stores the tensor itself. So the pack
hook keeps the version (of the tensor it keeps, or of the original it copied, held
weakly) and the unpack hook compares it, with autograd's wording. A copy is checked
only while its original is alive; its values are the forward's either way.

With ``ckptlib.checkpoint``. Entered around checkpointed blocks, the hook only
sees what checkpoint saves itself: the blocks' *inputs* (checkpoint's own pack
hook handles everything inside the block). That is the common combination:
checkpoint each block and offload the block boundaries, so device memory holds
only one block's activations at a time.

>>> import torch
>>> x = torch.randn(4, 4, requires_grad=True)
>>> with offload_saved_tensors() as offload:
...     y = (x.exp() * 2).sin()
>>> y.sum().backward()
>>> offload.offloaded_bytes, offload.kept_count   # on the CPU: nothing to move
(0, 2)
"""
from __future__ import annotations

import weakref
from typing import Any

import torch

from ckptlib._arguments import flag

__all__ = ["offload_saved_tensors"]


def _frees_device_memory(tensor: torch.Tensor) -> bool:
    """Would moving this saved tensor to the host free device memory?"""
    if tensor.device.type == "cpu" or tensor.layout != torch.strided:
        return False
    owner = tensor._base if tensor._base is not None else tensor
    return not (owner.is_leaf and owner.requires_grad)


def _host_copy(tensor: torch.Tensor, pinned: bool) -> torch.Tensor:
    """A copy in host memory with the same strides; into pinned memory and asynchronous if
    ``pinned`` (pinned memory only speeds up CUDA copies)."""
    host = torch.empty_like(tensor, device="cpu", pin_memory=pinned)
    host.copy_(tensor, non_blocking=pinned)
    return host


class offload_saved_tensors(torch.autograd.graph.saved_tensors_hooks):
    """Context manager: tensors autograd saves inside it wait for backward in host memory.

    Args:
        pin_memory: copy CUDA tensors into pinned host memory, asynchronously
            (faster, and the forward pass does not wait for the copies). Pinned
            memory is locked RAM: turn it off if the host is short of memory.

    Attributes:
        offloaded_bytes: bytes copied to the host so far.
        kept_count: saved tensors left where they were (see the module notes).

    >>> import torch, ckptlib
    >>> x = torch.randn(8, 8, requires_grad=True)
    >>> with offload_saved_tensors():          # offload the checkpoint's inputs
    ...     y = ckptlib.checkpoint(lambda t: t.relu().exp(), x * 2)
    >>> y.sum().backward()
    """

    def __init__(self, pin_memory: bool = True) -> None:
        flag(pin_memory, "pin_memory", where="offload_saved_tensors")
        self.pin_memory = pin_memory
        self.offloaded_bytes = 0
        self.kept_count = 0
        super().__init__(self._pack, self._unpack)

    def __enter__(self) -> "offload_saved_tensors":
        super().__enter__()
        return self

    def _pack(self, tensor: torch.Tensor) -> Any:
        version = _Version(tensor)
        if not _frees_device_memory(tensor):
            self.kept_count += 1
            # detach(): stored as is, a saved *output* would hold its own grad_fn, a reference
            # cycle that outlives the graph when no backward runs. Unpack re-attaches autograd.
            # The detached tensor shares the original's version counter.
            return tensor.detach(), version
        pinned = self.pin_memory and tensor.device.type == "cuda"
        self.offloaded_bytes += tensor.nbytes
        return (tensor.device, _host_copy(tensor, pinned), pinned), version

    def _unpack(self, packed: Any) -> torch.Tensor:
        stored, version = packed
        version.check(stored if isinstance(stored, torch.Tensor) else None)
        if isinstance(stored, torch.Tensor):
            return stored
        device, host, pinned = stored
        # copy=True: a fresh tensor even where `device` is the CPU, so backward never
        # holds (or modifies) the host buffer a retained graph will read again.
        return host.to(device, non_blocking=pinned, copy=True)


class _Version:
    """A saved tensor's version at pack, to check at unpack as autograd would (see the notes)."""

    __slots__ = ("version", "original", "node")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.version = tensor._version
        self.original = weakref.ref(tensor)   # only read when the kept tensor is a copy
        self.node = type(tensor.grad_fn) if tensor.grad_fn is not None else None

    def check(self, kept: torch.Tensor | None) -> None:
        tensor = kept if kept is not None else self.original()
        if tensor is None or tensor._version == self.version:
            return
        made = f", which is the output of {self.node.__name__}," if self.node is not None else ""
        node = torch._C._current_autograd_node()
        needed = f" needed by {node.name()}" if node is not None else ""
        raise RuntimeError(
            "offload_saved_tensors: one of the variables needed for gradient computation has been "
            "modified by an inplace operation: a saved tensor "
            f"[{tensor.dtype}, shape {list(tensor.shape)}]"
            f"{made}{needed} is at version {tensor._version}; "
            f"expected version {self.version} instead. "
            "It was changed in place after the forward pass saved it (plain autograd raises the "
            "same error). Modify a clone instead (y = y.clone() before the in-place op), or do the "
            "in-place update after backward.")
