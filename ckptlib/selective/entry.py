"""Selective checkpointing's entry point, ``selective_checkpoint``.

Full checkpointing drops every activation of a region and reruns the whole
region in backward. Selective checkpointing (PyTorch's "SAC",
``torch.utils.checkpoint.create_selective_checkpoint_contexts``) keeps a few
op outputs through the forward pass and, in the rerun, hands those back instead
of computing them again. The choice of ops is the *policy*: keep outputs that
are expensive to compute and cheap to store (a matmul: many flops per byte),
recompute the ones that are cheap and big (the ``batch x heads x seq x seq``
attention scores); the ready ones are in :mod:`ckptlib.selective.policy`.

``selective_checkpoint`` is ``ckptlib.checkpoint`` with a ``context_fn`` that
returns the two dispatch modes of :mod:`ckptlib.selective.modes`, or, when a
:class:`~ckptlib.selective.plans.SelectivePlans` holds a plan for this call, a
forward that needs no mode at all. Its arguments are checked at the call, before
anything is installed.

>>> import torch
>>> from ckptlib.selective.policy import save_matmuls
>>> x = torch.randn(8, 8, requires_grad=True)
>>> w = torch.randn(8, 8, requires_grad=True)
>>> layer = lambda a, b: (a @ b).tanh() @ b
>>> selective_checkpoint(layer, x, w, policy=save_matmuls).sum().backward()
>>> torch.equal(w.grad, torch.autograd.grad(layer(x, w).sum(), w)[0])
True
"""

from __future__ import annotations

from typing import Any, Callable

from ckptlib._arguments import flags
from ckptlib.core.checkpoint import checkpoint
from ckptlib.selective.modes import selective_contexts
from ckptlib.selective.plans import SelectivePlans
from ckptlib.selective.policy import Policy, as_predicate


def selective_checkpoint(
    fn: Callable[..., Any],
    *args: Any,
    policy: Policy,
    preserve_rng_state: bool = True,
    early_stop: bool = True,
    debug: bool = False,
    skip_unneeded: bool = True,
    plans: SelectivePlans | None = None,
    **kwargs: Any,
) -> Any:
    """``ckptlib.checkpoint(fn, *args, **kwargs)`` that keeps the outputs of the ops ``policy``
    chooses.

    Args:
        fn, args, kwargs: as for :func:`ckptlib.checkpoint`.
        policy: which ops to keep: a collection of aten ops (``save_matmuls``) or
            ``policy(op, *args, **kwargs) -> bool``, called in forward with each op and
            its inputs (``megatron_attention``, the result of :func:`policy_from_costs`).
            Every other op is recomputed in backward.
        preserve_rng_state, early_stop, debug: as for :func:`ckptlib.checkpoint`.
        skip_unneeded: in the rerun, skip the ops whose results nothing needs (those
            that only fed kept outputs; see :mod:`ckptlib.selective.opgraph`). Turn it off for a
            function that hands tensor data to Python without an aten op in between
            (``t.numpy()``, ``t.tolist()``) and computes on from there: such a use is
            invisible to the op graph, and the rerun would fail on a skipped tensor
            (loudly: skipped results live on the meta device).
        plans: a :class:`SelectivePlans` to record this call's plan in, or to reuse one from:
            a later call with the same function and input signature then runs forward with
            no dispatch mode, at the cost of full checkpointing's forward. For functions
            that run the same ops on every call (see :class:`SelectivePlans` for the
            contract and what is checked). Needs ``skip_unneeded=True``.

    Gradients equal plain autograd bitwise; ``retain_graph=True`` works.

    >>> import torch
    >>> x = torch.randn(4, 8, requires_grad=True)
    >>> w = torch.randn(8, 8, requires_grad=True)
    >>> def block(inp):
    ...     return torch.nn.functional.dropout((inp @ w).relu(), 0.5) @ w
    >>> torch.manual_seed(0)
    <torch._C.Generator object at ...>
    >>> expected = torch.autograd.grad(block(x).sum(), w)[0]
    >>> torch.manual_seed(0)
    <torch._C.Generator object at ...>
    >>> selective_checkpoint(block, x, policy={torch.ops.aten.mm}).sum().backward()
    >>> torch.equal(w.grad, expected)
    True
    """
    as_predicate(policy)  # a policy that would fail on the first op fails here
    flags(
        "selective_checkpoint",
        preserve_rng_state=preserve_rng_state,
        early_stop=early_stop,
        debug=debug,
        skip_unneeded=skip_unneeded,
    )
    if plans is not None and not isinstance(plans, SelectivePlans):
        raise TypeError(f"plans must be a SelectivePlans (or None), got {type(plans).__name__}.")
    if plans is not None and not skip_unneeded:
        raise ValueError(
            "plans= needs skip_unneeded=True: a plan is learned from the op graph that "
            "skipping records. Drop plans= for a function that needs skip_unneeded=False."
        )

    def contexts() -> tuple[Any, Any]:
        # Made when the checkpoint asks, after it checked its own arguments: a call that fails
        # there neither records nor counts a plan.
        if plans is not None:
            return plans.contexts(
                fn, args, kwargs, policy, replay_random=preserve_rng_state, early_stop=early_stop
            )
        return selective_contexts(
            policy, replay_random=preserve_rng_state, skip_unneeded=skip_unneeded
        )

    return checkpoint(
        fn,
        *args,
        preserve_rng_state=preserve_rng_state,
        early_stop=early_stop,
        debug=debug,
        context_fn=contexts,
        **kwargs,
    )
