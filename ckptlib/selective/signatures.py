"""What must match for one call to reuse another's plan: a signature before the call, a
fingerprint per saved tensor.

Design notes
============

A reused plan (:mod:`ckptlib.selective.plans`) stands in for the forward
dispatch mode, so it may only be used where the forward would have recorded the
same plan. Two checks decide that, both erring towards more work:

* before the call, its *signature*: the policy, every input tensor's type,
  shape, strides, dtype, device and ``requires_grad``, the other arguments
  (hashable ones; otherwise no signature, and no reuse), the train/eval flags of
  a module's submodules, autocast, the deterministic-algorithms setting, and
  what else changes which autograd nodes a call makes: the caller's dispatch
  modes (under one, some ops decompose differently) and global module hooks
  (``FlopCounterMode`` wraps each module call in autograd functions). Calls with
  different signatures get different plans;
* during the call's forward, a *fingerprint* of every tensor autograd saves:
  shape, dtype, device, and the autograd node that made it, by kind
  (``SoftmaxBackward0``) and by its place among the nodes the call created. The
  place is what keeps a cached output from being rebuilt from a tensor another
  op made. Node places are counted from the sequence number autograd gives the
  call's first node (:func:`next_node_number`).

What no check sees is a call whose unsaved intermediate results flow
differently with the same ops and the same saved tensors; the rerun then fails
loudly or runs again (``ReplaySavedOps``).
"""

from __future__ import annotations

import functools
import types
from typing import Any, Callable, Collection

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack as _dispatch_mode_stack
from torch.utils._pytree import tree_flatten

from ckptlib.core.checks import INPUT, saved_key
from ckptlib.selective.policy import Policy
from ckptlib.core.checks import storage_ptr


def fingerprint(tensor: torch.Tensor, input_storages: Collection[int], first_node: int) -> tuple:
    """What a reused plan checks of each saved tensor: the key a checkpoint's rerun checks
    (:func:`ckptlib.core.checks.saved_key`: shape, dtype, device and the kind of autograd node that
    made it, a view's base's, or "an input"), and the place of that node among the nodes the
    call created (``first_node``: the sequence number of the first)."""
    key = saved_key(tensor, storage_ptr(tensor), input_storages)
    base = tensor._base
    node = (tensor if base is None else base).grad_fn
    if node is None or key[3] == INPUT:  # a leaf (a parameter), a view of one, or an input
        return key
    place = node._sequence_nr() - first_node
    return (*key, place if place >= 0 else "before")


def next_node_number() -> int:
    """The sequence number autograd gives the next node this thread creates. (The probe is
    hidden from dispatch modes: an enclosing selective checkpoint must not count its ops.)"""
    with torch._C._DisableTorchDispatch():
        probe = torch.empty(0, requires_grad=True).view(0)  # creates one node
    return probe.grad_fn._sequence_nr() + 1


def underlying(fn: Callable[..., Any]) -> tuple[Any, Any, tuple, dict]:
    """``(owner, function, bound_args, bound_kwargs)``: what a call of ``fn`` really runs.

    Plans follow the owner (weakly) and are keyed by the function. A bound method is a new
    object at every ``block.forward``: owner the instance, function the method's function.
    Hugging Face's switch passes a new ``functools.partial(forward, layer, **kwargs)`` at every
    call: owner the layer, function ``forward``, and the bound arguments join the signature.
    """
    bound_args: tuple = ()
    bound_kwargs: dict = {}
    while isinstance(fn, functools.partial):
        bound_args, bound_kwargs = (*fn.args, *bound_args), {**fn.keywords, **bound_kwargs}
        fn = fn.func
    if isinstance(fn, types.MethodType):
        return fn.__self__, fn.__func__, bound_args, bound_kwargs
    if bound_args and isinstance(
        bound_args[0], torch.nn.Module
    ):  # partial(Class.forward, module, ...)
        return bound_args[0], fn, bound_args[1:], bound_kwargs
    return fn, None, bound_args, bound_kwargs


def call_signature(
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    policy: Policy,
    replay_random: bool,
    early_stop: bool,
) -> tuple | None:
    """What must be equal for a call to reuse another's plan (``None``: never reuse): the
    policy, every input tensor's type, shape, strides, dtype, device and ``requires_grad``,
    the other arguments, the train/eval flags of a module's submodules, autocast, the
    deterministic-algorithms setting and the caller's dispatch modes and module hooks. The
    saved tensors of the call are checked as well."""
    owner, _, bound_args, bound_kwargs = underlying(fn)
    if bound_args or bound_kwargs:
        args, kwargs = (*bound_args, *args), {**bound_kwargs, **kwargs}
    try:
        policy_key = frozenset(policy) if isinstance(policy, (set, list, tuple)) else policy
        hash(policy_key)
        if kwargs or any(isinstance(a, (list, tuple, dict)) for a in args):
            leaves, spec = tree_flatten((args, kwargs))
            structure: Any = str(spec)
        else:
            leaves, structure = args, len(args)
        parts = tuple(
            [
                (type(leaf), leaf.shape, leaf.stride(), leaf.dtype, leaf.device, leaf.requires_grad)
                if isinstance(leaf, torch.Tensor)
                else (type(leaf), leaf)
                for leaf in leaves
            ]
        )
        hash(parts)
    except TypeError:  # an unhashable policy or argument
        return None
    training = (
        tuple([m.training for m in owner.modules()]) if isinstance(owner, torch.nn.Module) else ()
    )
    return (
        policy_key,
        structure,
        parts,
        training,
        _autocast(),
        torch.are_deterministic_algorithms_enabled(),
        _ambient_tracing(),
        replay_random,
        early_stop,
    )


def _autocast() -> tuple:
    """Autocast as it changes the ops a call runs: on or off, and the dtype, per device."""
    return tuple(
        [
            (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
            for device in _AUTOCAST_DEVICES
        ]
    )


_AUTOCAST_DEVICES = ("cpu", "cuda")


def _ambient_tracing() -> tuple:
    """What else changes the nodes autograd makes: the caller's dispatch modes (under one, some
    ops decompose differently) and global module hooks (``FlopCounterMode`` tracks modules with
    autograd functions around each call)."""
    modes = tuple([type(mode) for mode in _dispatch_mode_stack()])
    hooks = torch.nn.modules.module
    return modes, len(hooks._global_forward_pre_hooks), len(hooks._global_forward_hooks)
