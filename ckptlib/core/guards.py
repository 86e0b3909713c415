"""The guards: the observer that refuses a rerun which would give other gradients than the forward.

Design notes
============

A rerun gives the right gradients only if it computes the values the forward computed. Those
values were dropped (that is the point), so they cannot be compared. What is cheap to keep is
compared instead, and every check errs towards a loud ``CheckpointError`` rather than a silently
wrong gradient. The core (``ckptlib/core/checkpoint.py``) compares each saved tensor's key
(``keys.py``); :class:`Guards` is the observer it always has, called by name at its named
points, for the rest:

* ``on_pack``: a saved leaf (a parameter, ``weight.t()``) is noted with its version and identity,
  and whether dropping the tensor frees memory at all;
* its ``reads`` (``reads.py``), a second observer: ``after_forward`` tells what the forward
  wrote (BatchNorm's statistics) from what it read and notes an input the function changed
  itself; ``before_rerun`` compares the versions of what the rerun certainly reads and returns
  the watch over the rest it may read; ``after_rerun`` warns about state written twice;
* ``on_fill``: the rerun saved the same parameter.

A rerun can differ from its forward in ways keys and versions miss. Each case below is either
made right or refused with its cause, where ``torch.utils.checkpoint`` is silent or names another
cause.

In-place changes inside the region. Saved-tensor hooks switch off autograd's own version check
(a saved tensor's version at its save against its version at its use), and a recomputed tensor
is a detached alias of the rerun's tensor: in ``h = a.exp(); h.mul_(3); h.sin()`` the rerun's
``mul_`` changes what ``exp`` saved. So the core keeps each recomputed tensor with its version at
the rerun's pack, and its unpack refuses a changed one (the message: :func:`modified_in_place`),
as plain autograd would: autograd's own check, put back where autograd does it. Tensors that
live on outside the region (inputs, parameters, buffers; the guards' ``on_pack`` tells them by
``holder.frees_memory``) are left out: a recompute context may put a buffer back after the rerun.

A function that changes its own input (``u.mul_(2)``) destroys the values the rerun would start
from. Plain autograd keeps every activation and does not mind; a checkpoint cannot recompute, and
says so (``reads.input_modified_by_fn``) instead of blaming a change "after the forward".

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
rerun leaves inference mode to record its graph (the core does that).
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.autograd.forward_ad as forward_ad

from ckptlib.core.errors import CheckpointError
from ckptlib.core.keys import CONSTANT, MISMATCH_CAUSES, TensorMeta
from ckptlib.core.reads import OutsideReads
from ckptlib.storage import storage_ptrs

__all__ = ["Guards", "modified_in_place", "replaced_parameter",
           "may_be_filled_later", "rerun_input", "transform_levels", "lost_transform"]


def _leaf_of(tensor: torch.Tensor) -> torch.Tensor | None:
    """The leaf a saved tensor is, or is a view of (a parameter, ``weight.t()``); None otherwise."""
    if tensor.is_leaf:
        return tensor
    base = tensor._base
    return base if base is not None and base.is_leaf else None


class Guards:
    """The checks of one checkpoint call beyond its keys (see the notes above): an observer of
    each saved tensor; what the region reads is watched by its ``reads``, the second observer
    (:class:`~ckptlib.core.reads.OutsideReads`). The frame calls both."""

    def __init__(self, fn: Any, inputs: list[torch.Tensor],
                 input_ptrs: set[int] | None = None) -> None:
        self.reads = OutsideReads(fn, inputs)
        # saved tensors sharing these free nothing (the core passes the set it made)
        self.input_ptrs = storage_ptrs(inputs) if input_ptrs is None else input_ptrs
        # forward-mode AD and torch.func levels (transform_levels(), inline: runs at every call)
        self.transforms = forward_ad._current_level, torch._C._functorch.maybe_current_level()
        # index -> (id, storage) of a saved leaf that requires grad (a parameter or an input). The
        # rerun must save the same tensor or the same storage: FSDP2 gathers a parameter anew (same
        # tensor, new storage); the rerun's inputs are detached (new tensor, same storage).
        self.leaf_ids: dict[int, tuple[int, int | None]] = {}

    def on_pack(self, frame: Any, holder: Any, tensor: torch.Tensor, ptr: int | None) -> None:
        if ptr and ptr in self.input_ptrs:   # an input (or a view of one): its version is the
            holder.frees_memory = False      # reads' to check, the rerun saves its own copy
            return
        leaf = _leaf_of(tensor)   # a parameter, ``weight.t()``
        if leaf is None:
            return
        # its version is checked before a rerun (kept weakly)
        self.reads.saved_leaves.append((weakref.ref(leaf), leaf._version))
        if leaf.requires_grad:            # the rerun must save this very parameter
            self.leaf_ids[holder.index] = (id(leaf), ptr)
        # Dropping it frees nothing if it lives on outside the region: an input's storage, a leaf
        # that requires grad, a buffer or captured tensor fn reaches. A leaf *without* grad may be
        # made inside (dropout's mask): that one frees memory.
        holder.frees_memory = not (leaf.requires_grad or (ptr and self.reads.holds_storage(ptr)))

    def on_fill(self, frame: Any, task: int, index: int, tensor: torch.Tensor,
                detached: torch.Tensor, holder: Any, ptr: int | None) -> None:
        forward_leaf = self.leaf_ids.get(index)   # ``ptr``: its storage (with keys checked)
        if forward_leaf is not None and frame.check_keys \
                and forward_leaf[1] != ptr \
                and forward_leaf[0] != id(_leaf_of(tensor)):
            raise CheckpointError(f"checkpoint {frame.region}: "
                                  f"{replaced_parameter(index, frame.meta(index))}")

    def mismatch_causes(self) -> str:
        """The likely causes of a rerun that saved other tensors, for the core's messages."""
        return lost_transform(self.transforms) or MISMATCH_CAUSES

    def lost_transform(self) -> str | None:
        return lost_transform(self.transforms)


def _producer(key: tuple) -> Any:
    """The producer in a saved tensor's key; ``None`` in a key without one."""
    return key[3] if len(key) > 3 else None


def modified_in_place(index: int, key: tuple, version: int, now: int, node: str | None) -> str:
    """Why saved tensor ``index``, recomputed at ``version`` and now at ``now``, is refused."""
    made_by = _producer(key)
    made_by = made_by[1] if isinstance(made_by, tuple) else made_by   # a view's: its base's
    made = f" made by {made_by.__name__}" if isinstance(made_by, type) else ""
    return (f"saved tensor #{index} ({TensorMeta.from_key(key)}){made} was modified by an in-place "
            f"operation inside the checkpointed function after an op saved it (version {version} "
            f"-> {now}), so {node or 'backward'} would get the changed values. Plain autograd "
            "raises here too (\"one of the variables needed for gradient computation has been "
            "modified by an inplace operation\"). Use the out-of-place form of the op that "
            "changed it (h = h * 3 instead of h.mul_(3)), or clone the tensor before changing it.")


def replaced_parameter(index: int, meta: TensorMeta) -> str:
    """Why a rerun whose saved tensor ``index`` is another parameter than the forward's is
    refused."""
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


def may_be_filled_later(keys: list[tuple], index: int) -> bool:
    """Could the op that saved tensor ``index`` still write into a tensor it saved (see the
    notes)?"""
    key = keys[index]
    if len(key) > 3 and key[3] is CONSTANT:
        return True
    before = keys[index - 1] if index > 0 else ()
    return len(before) > 3 and before[3] is CONSTANT


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
        return ("the forward ran inside a torch.func transform (vmap, grad, jacrev, ...) and this "
                "backward runs outside it, so the recomputation cannot rebuild the batched or "
                "wrapped tensors the forward saved (and torch.func.grad, vjp and jacrev refuse "
                "saved-tensor hooks, so the gradient cannot be taken inside either). Checkpoint "
                "outside the transform, e.g. around the vmapped call, or do not checkpoint a "
                "function that runs under it.")
    if forward_level >= 0 and now_forward_level != forward_level:
        return ("the forward ran inside forward-mode AD (torch.autograd.forward_ad.dual_level) "
                "and this backward runs after that level was exited, so the recomputation runs "
                "without the dual tensors' tangents and saves other tensors than the forward did. "
                "Call backward inside the `with dual_level():` block, or checkpoint outside "
                "forward-mode AD.")
    return None

