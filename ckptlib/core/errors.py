"""What a user sees when a checkpoint goes wrong: the exception, every message, the line a warning
names, and how a message describes a tensor (``4x8 float32 on cpu (128 bytes)``).

Each message says what differed, why the gradients would be wrong, and what to do. The checks
that raise them are in ``checks.py`` and ``checkpoint.py``; the messages are here, so that a
reader of the mechanism sees one call where a check refuses, and a reader of the messages sees
them all together.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

__all__ = ["CheckpointError", "RegionId", "TensorMeta", "dims_text", "shape_text",
           "caller_stacklevel"]


class CheckpointError(RuntimeError):
    """A checkpointed region could not give back what autograd saved in forward."""


class RegionId(NamedTuple):
    """One checkpoint call, as messages and traces name it: what it runs (a function's name, or a
    module path) and its number.

    >>> str(RegionId("transformer.h.1", 3))
    'transformer.h.1@3'
    """

    name: str
    number: int

    def __str__(self) -> str:
        return f"{self.name}@{self.number}"


def dims_text(shape: tuple[int, ...]) -> str:
    """``4x8``: a shape as every message, table and widget writes it (``scalar`` for ``()``)."""
    return "x".join(map(str, shape)) or "scalar"


def shape_text(shape: tuple[int, ...], dtype: torch.dtype) -> str:
    """``4x8 float32``: a tensor's shape and dtype as every message, table and widget writes them.

    >>> shape_text((4, 8), torch.float32), shape_text((), torch.int64)
    ('4x8 float32', 'scalar int64')
    """
    return f"{dims_text(shape)} {str(dtype).replace('torch.', '')}"


@dataclass(frozen=True)
class TensorMeta:
    """What a message says about a tensor: shape, dtype, device, bytes."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    nbytes: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TensorMeta":
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"TensorMeta.of needs a tensor, got {type(tensor).__name__}.")
        return cls(tuple(tensor.shape), tensor.dtype, tensor.device,
                   tensor.numel() * tensor.element_size())

    @classmethod
    def from_key(cls, key: tuple) -> "TensorMeta":
        """From a saved tensor's key (``checks.SavedKey``); only its shape, dtype and device."""
        shape, dtype, device = key[:3]
        return cls(tuple(shape), dtype, device, math.prod(shape) * dtype.itemsize)

    def __str__(self) -> str:
        return f"{shape_text(self.shape, self.dtype)} on {self.device} ({self.nbytes} bytes)"


# torch, ckptlib, and contextlib (the core enters its contexts through an ExitStack)
_LIBRARY_DIRS = (os.path.dirname(torch.__file__) + os.sep,
                 os.path.dirname(os.path.dirname(__file__)) + os.sep, contextlib.__file__)


def caller_stacklevel() -> int:
    """The stacklevel of the first frame outside torch and ckptlib: the user's line, for
    warnings."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level


# ---------------------------------------------------------------------------
# The mechanism's messages (checkpoint.py)
# ---------------------------------------------------------------------------

MISMATCH_CAUSES = (
    "Usual causes: non-deterministic control flow in the checkpointed function (branches on "
    "random numbers, time or a global flag), data-dependent shapes (e.g. torch.nonzero on values "
    "that changed), global state that changed between forward and backward (a module attribute, "
    "train/eval mode), or an input modified in place after the forward pass. Make the function "
    "depend only on its inputs, or keep its activations by not checkpointing it."
)


def unpacked_twice(region: object, index: int, meta: object, in_group: bool) -> str:
    if in_group:
        return (f"checkpoint {region}: saved tensor #{index} ({meta}) was unpacked twice under "
                "one torch.utils.checkpoint.GraphExecGroup: its backward calls share one "
                "recomputation, so they must not overlap (two of them needed the same saved "
                "tensor). Run overlapping backward calls outside the group, or split the group.")
    return (f"checkpoint {region}: saved tensor #{index} ({meta}) was unpacked twice in one "
            "backward pass. Each recomputed tensor is handed out once and then released. If a "
            "custom autograd.Function reads ctx.saved_tensors more than once in backward, read it "
            "once into a local variable.")


def saved_more(region: object, forward_count: int, index: int, meta: object, causes: str) -> str:
    return (f"checkpoint {region}: the recomputation saved more tensors than the forward pass did "
            f"(forward saved {forward_count}; extra tensor #{index}: {meta}). {causes}")


def saved_fewer(forward_count: int, count: int, causes: str) -> str:
    return (f"the recomputation saved fewer tensors than the forward pass did (forward saved "
            f"{forward_count}, recomputation {count}). {causes}")


def context_swallowed(region: object, failure: str) -> str:
    """``failure``: the swallowed exception in words (``ValueError: boom``)."""
    return (f"checkpoint {region}: the forward context from context_fn suppressed the exception "
            f"the checkpointed function raised ({failure}), so there is "
            "no output to return. Let the context's __exit__ return None or False (do not swallow "
            "exceptions), or catch the exception inside the function.")


def cuda_initialised_inside(region: object) -> str:
    return (f"checkpoint {region}: CUDA was initialised inside the checkpointed function, so its "
            "RNG state could not be saved for the recomputation. Initialise CUDA before "
            "checkpointing (e.g. torch.cuda.init(), or move the model to the GPU first), or pass "
            "preserve_rng_state=False.")


def modified_in_place(index: int, meta: object, made_by: Any, version: int, now: int,
                      node: str | None) -> str:
    """Why saved tensor ``index``, recomputed at ``version`` and now at ``now``, is refused."""
    made = f" made by {made_by.__name__}" if isinstance(made_by, type) else ""
    return (f"saved tensor #{index} ({meta}){made} was modified by an in-place "
            f"operation inside the checkpointed function after an op saved it (version {version} "
            f"-> {now}), so {node or 'backward'} would get the changed values. Plain autograd "
            "raises here too (\"one of the variables needed for gradient computation has been "
            "modified by an inplace operation\"). Use the out-of-place form of the op that "
            "changed it (h = h * 3 instead of h.mul_(3)), or clone the tensor before changing it.")


# ---------------------------------------------------------------------------
# The checks' messages (checks.py)
# ---------------------------------------------------------------------------

def key_mismatch(index: int, forward: TensorMeta, rerun: TensorMeta, forward_made: str,
                 rerun_made: str) -> str:
    """Why the rerun's saved tensor ``#index`` is not the forward's (``*_made``: how each was
    made, in words)."""
    if forward != rerun:
        what = f"forward saved {forward}, recomputation produced {rerun}"
    else:
        what = (f"forward saved {forward} {forward_made}; recomputation produced one "
                f"{rerun_made} (same shape, another operation)")
    return (f"saved tensor #{index} differs between forward and recomputation: {what}. "
            f"{MISMATCH_CAUSES}")


def replaced_parameter(index: int, meta: TensorMeta) -> str:
    return (f"saved tensor #{index} ({meta}) was a parameter (a leaf that requires grad) in the "
            "forward pass, and the recomputation saved another tensor of the same shape in its "
            "place: the parameter was replaced between forward and backward, e.g. by "
            "torch.func.functional_call (it swaps a module's parameters only while its call runs) "
            "or by `module.weight = nn.Parameter(...)`. The rerun would compute with the current "
            "parameters and give wrong gradients. Pass the parameters into the checkpointed "
            "function instead (checkpoint(lambda x, params: functional_call(model, params, (x,)), "
            "x, params)), or do not replace them before backward. (A leaf that the function "
            "itself makes with requires_grad=True is another tensor at every run: make it outside "
            "and pass it in.)")


def input_modified_by_fn(position: int, meta: TensorMeta, version: int, now: int) -> str:
    return (f"the checkpointed function itself modified its input tensor #{position} "
            f"({meta}) in place during the forward pass (version {version} -> {now}), so the "
            "values the forward started from are gone and the recomputation cannot start from "
            "them (plain autograd runs this, as it keeps every activation). Make the function "
            "leave its inputs alone: u = u * 2 instead of u.mul_(2), or u = u.clone() as its "
            "first line.")


def input_modified_after(position: int, meta: TensorMeta, version: int, now: int) -> str:
    return (f"input tensor #{position} ({meta}) was modified in place after the checkpointed "
            f"forward (version {version} -> {now}); recomputing from it would give wrong "
            "activations. Clone the input before modifying it, or modify a copy.")


def read_modified(name: str, version: int, now: int) -> str:
    return (f"{name} was modified in place between the forward pass and this recomputation "
            f"(version {version} -> {now}), and the recomputation reads it. The rerun would "
            "compute with the new values, not the ones the forward used, and give wrong gradients "
            "(plain autograd raises here too when it saved the tensor). Usual cause: an optimizer "
            "step, or another in-place update, before backward: call backward first, then step; "
            "or clone the tensor before changing it.")


def state_updated_twice(region: object, description: str) -> str:
    return (f"checkpoint {region}: the forward pass updated {description} in place and the "
            "recomputation updated it again, from the value the forward left: ckptlib had no copy "
            "of the value the forward read, so the gradients can differ from plain autograd's. "
            "ckptlib copies the buffers that modules in training mode reached by fn update (one "
            "a module starts updating after its first call: from the next call on). Make this "
            "state such a buffer, update it outside the checkpointed function, or do not "
            "checkpoint this code. (Its value is put back as the forward left it.)")


LOST_FUNCTORCH = (
    "the forward ran inside a torch.func transform (vmap, grad, jacrev, ...) and this backward "
    "runs outside it, so the recomputation cannot rebuild the batched or wrapped tensors the "
    "forward saved (and torch.func.grad, vjp and jacrev refuse saved-tensor hooks, so the "
    "gradient cannot be taken inside either). Checkpoint outside the transform, e.g. around the "
    "vmapped call, or do not checkpoint a function that runs under it.")

LOST_FORWARD_AD = (
    "the forward ran inside forward-mode AD (torch.autograd.forward_ad.dual_level) and this "
    "backward runs after that level was exited, so the recomputation runs without the dual "
    "tensors' tangents and saves other tensors than the forward did. Call backward inside the "
    "`with dual_level():` block, or checkpoint outside forward-mode AD.")
