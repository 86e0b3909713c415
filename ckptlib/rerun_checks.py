"""How a checkpoint's rerun can go wrong beyond what its saved-tensor keys show, and what it does about it.

Design notes
============

``ckptlib.guards`` compares what is cheap to keep: each saved tensor's key, the versions of what
the region reads from outside. A rerun can still differ from its forward in ways those miss. Each
case below is either made right or refused with its cause, where ``torch.utils.checkpoint`` is
silent or names another cause. ``ckptlib.checkpoint`` calls these; this module holds the
checks and their messages.

In-place changes inside the region. Saved-tensor hooks switch off autograd's own version check
(a saved tensor's version at its save against its version at its use), and a recomputed tensor
is a detached alias of the rerun's tensor: in ``h = a.exp(); h.mul_(3); h.sin()`` the rerun's
``mul_`` changes what ``exp`` saved. So each recomputed tensor keeps its version at the rerun's
pack, and its unpack refuses a changed one (:func:`modified_in_place`), as plain autograd would.
Tensors that live on outside the region (inputs, parameters, buffers) are left out: a recompute
context may put a buffer back after the rerun.

A function that changes its own input (``u.mul_(2)``) destroys the values the rerun would start
from. Plain autograd keeps every activation and does not mind; a checkpoint cannot recompute, and
says so (:func:`input_modified_by_fn`) instead of blaming a change "after the forward".

A parameter replaced between forward and backward (``torch.func.functional_call`` swaps a
module's parameters only while its call runs) has the same key as the one it replaced. The
rerun checks that each saved parameter is the tensor the forward saved, or has its storage
(:func:`replaced_parameter`): FSDP2 gathers a parameter anew for the rerun (the same tensor, another
storage), and the rerun's own inputs are detached copies (another tensor, the same storage).

Early stop next to a buffer an op fills. An op saves its inputs before it runs. ``rrelu`` saves
its ``noise`` buffer and its input, then fills the buffer: a rerun stopped at either save hands
back an unfilled buffer. Next to a saved constant (a tensor without history made inside: the
buffer, or a dropout mask) the rerun stops at the next save instead (:func:`may_be_filled_later`).

The rerun's inputs are detached from the forward's graph (:func:`rerun_input`): a hook the function
registers on its input (``u.register_hook``) would otherwise be registered on the forward graph's
node a second time and fire twice in backward.

Transforms that ended. A forward under forward-mode AD or ``torch.func.vmap`` saves tensors that
a backward outside it cannot rebuild; the rerun then saves other tensors or fails inside functorch.
:func:`lost_transform` names that cause. A backward under ``torch.inference_mode()`` is legal: the
rerun leaves inference mode to record its graph (:func:`outside_inference_mode`).
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, ContextManager

import torch
import torch.autograd.forward_ad as forward_ad

from ckptlib import guards
from ckptlib.trace import TensorMeta

__all__ = ["modified_in_place", "input_modified_by_fn", "replaced_parameter", "may_be_filled_later", "rerun_input",
           "transform_levels", "lost_transform", "outside_inference_mode"]


def producer(key: tuple) -> Any:
    """The producer in a saved tensor's key (``guards.saved_key``); ``None`` in a key without one."""
    return key[3] if len(key) > 3 else None


def modified_in_place(index: int, key: tuple, version: int, now: int, node: str | None) -> str:
    """Why saved tensor ``index``, recomputed at ``version`` and now at ``now``, is refused."""
    made_by = producer(key)
    made_by = made_by[1] if isinstance(made_by, tuple) else made_by   # a view's: its base's
    made = f" made by {made_by.__name__}" if isinstance(made_by, type) else ""
    return (f"saved tensor #{index} ({TensorMeta.from_key(key)}){made} was modified by an in-place operation "
            f"inside the checkpointed function after an op saved it (version {version} -> {now}), so "
            f"{node or 'backward'} would get the changed values. Plain autograd raises here too (\"one of the "
            "variables needed for gradient computation has been modified by an inplace operation\"). Use the "
            "out-of-place form of the op that changed it (h = h * 3 instead of h.mul_(3)), or clone the tensor "
            "before changing it.")


def input_modified_by_fn(inputs: list[tuple[weakref.ReferenceType, int]]) -> str | None:
    """After the forward: the message for the first input (weakly kept, with its version at the call)
    whose version moved, i.e. that the function itself changed in place; ``None`` if none did."""
    for position, (ref, version) in enumerate(inputs):
        tensor = ref()
        if tensor is not None and tensor._version != version:
            return (f"the checkpointed function itself modified its input tensor #{position} "
                    f"({TensorMeta.of(tensor)}) in place during the forward pass (version {version} -> "
                    f"{tensor._version}), so the values the forward started from are gone and the "
                    "recomputation cannot start from them (plain autograd runs this, as it keeps every "
                    "activation). Make the function leave its inputs alone: u = u * 2 instead of "
                    "u.mul_(2), or u = u.clone() as its first line.")
    return None


def replaced_parameter(index: int, meta: TensorMeta) -> str:
    """Why a rerun whose saved tensor ``index`` is another parameter than the forward's is refused."""
    return (f"saved tensor #{index} ({meta}) was a parameter (a leaf that requires grad) in the forward "
            "pass, and the recomputation saved another tensor of the same shape in its place: the parameter "
            "was replaced between forward and backward, e.g. by torch.func.functional_call (it swaps a "
            "module's parameters only while its call runs) or by `module.weight = nn.Parameter(...)`. The "
            "rerun would compute with the current parameters and give wrong gradients. Pass the parameters "
            "into the checkpointed function instead (checkpoint(lambda x, params: functional_call(model, "
            "params, (x,)), x, params)), or do not replace them before backward. (A leaf that the function "
            "itself makes with requires_grad=True is another tensor at every run: make it outside and pass "
            "it in.)")


def may_be_filled_later(keys: list[tuple], index: int) -> bool:
    """Could the op that saved tensor ``index`` still write into a tensor it saved (see the notes)?"""
    return producer(keys[index]) is guards.CONSTANT or (index > 0 and producer(keys[index - 1]) is guards.CONSTANT)


def rerun_input(tensor: torch.Tensor) -> torch.Tensor:
    """An input that requires grad, detached from the forward's graph for the rerun; under
    forward-mode AD it keeps its tangent."""
    detached = tensor.detach().requires_grad_()
    if forward_ad._current_level >= 0:
        tangent = forward_ad.unpack_dual(tensor).tangent
        if tangent is not None:
            return forward_ad.make_dual(detached, tangent)
    return detached


def transform_levels() -> tuple[int, int | None]:
    """(forward-mode AD level, -1 outside; innermost torch.func level, ``None`` outside)."""
    return forward_ad._current_level, torch._C._functorch.maybe_current_level()


def lost_transform(forward_levels: tuple[int, int | None]) -> str | None:
    """The real cause when a rerun fails because the transform its forward ran under has ended."""
    forward_level, functorch_level = forward_levels
    now_forward_level, now_functorch_level = transform_levels()
    if functorch_level is not None and now_functorch_level != functorch_level:
        return ("the forward ran inside a torch.func transform (vmap, grad, jacrev, ...) and this backward "
                "runs outside it, so the recomputation cannot rebuild the batched or wrapped tensors the "
                "forward saved (and torch.func.grad, vjp and jacrev refuse saved-tensor hooks, so the "
                "gradient cannot be taken inside either). Checkpoint outside the transform, e.g. around the "
                "vmapped call, or do not checkpoint a function that runs under it.")
    if forward_level >= 0 and now_forward_level != forward_level:
        return ("the forward ran inside forward-mode AD (torch.autograd.forward_ad.dual_level) and this "
                "backward runs after that level was exited, so the recomputation runs without the dual "
                "tensors' tangents and saves other tensors than the forward did. Call backward inside the "
                "`with dual_level():` block, or checkpoint outside forward-mode AD.")
    return None


def outside_inference_mode() -> ContextManager:
    """Leave ``torch.inference_mode()`` for the rerun (a backward under it is legal; the rerun must
    still record a graph)."""
    return torch.inference_mode(False) if torch.is_inference_mode_enabled() else _NOTHING


_NOTHING = contextlib.nullcontext()   # stateless: one for every call
