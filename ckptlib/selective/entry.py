"""Selective checkpointing's entry point, ``selective_checkpoint``, and the ready policies.

Full checkpointing drops every activation of a region and reruns the whole
region in backward. Selective checkpointing (PyTorch's "SAC",
``torch.utils.checkpoint.create_selective_checkpoint_contexts``) keeps a few
op outputs through the forward pass and, in the rerun, hands those back instead
of computing them again. The choice of ops is the *policy*: keep outputs that
are expensive to compute and cheap to store (a matmul: many flops per byte),
recompute the ones that are cheap and big (the ``batch x heads x seq x seq``
attention scores).

``selective_checkpoint`` is ``ckptlib.checkpoint`` with a ``context_fn`` that
returns the two dispatch modes of :mod:`ckptlib.selective.modes`, or, when a
:class:`~ckptlib.selective.plans.SelectivePlans` holds a plan for this call, a
forward that needs no mode at all. Its arguments are checked at the call, before
anything is installed.

>>> import torch
>>> x = torch.randn(8, 8, requires_grad=True)
>>> w = torch.randn(8, 8, requires_grad=True)
>>> layer = lambda a, b: (a @ b).tanh() @ b
>>> selective_checkpoint(layer, x, w, policy=save_matmuls).sum().backward()
>>> torch.equal(w.grad, torch.autograd.grad(layer(x, w).sum(), w)[0])
True
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch._ops import OpOverload, OpOverloadPacket

from ckptlib.core.checkpoint import checkpoint
from ckptlib._arguments import flags
from ckptlib.selective.modes import Policy, _as_predicate, selective_contexts
from ckptlib.selective.ops import _tensors
from ckptlib.selective.plans import SelectivePlans

aten = torch.ops.aten


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
    """``ckptlib.checkpoint(fn, *args, **kwargs)`` that keeps the outputs of the ops ``policy`` chooses.

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
    _as_predicate(policy)          # a policy that would fail on the first op fails here
    flags("selective_checkpoint", preserve_rng_state=preserve_rng_state, early_stop=early_stop,
                  debug=debug, skip_unneeded=skip_unneeded)
    if plans is not None and not isinstance(plans, SelectivePlans):
        raise TypeError(f"plans must be a SelectivePlans (or None), got {type(plans).__name__}.")
    if plans is not None and not skip_unneeded:
        raise ValueError("plans= needs skip_unneeded=True: a plan is learned from the op graph that "
                         "skipping records. Drop plans= for a function that needs skip_unneeded=False.")

    def contexts() -> tuple[Any, Any]:
        # Made when the checkpoint asks, after it checked its own arguments: a call that fails
        # there neither records nor counts a plan.
        if plans is not None:
            return plans.contexts(fn, args, kwargs, policy, replay_random=preserve_rng_state,
                                  early_stop=early_stop)
        return selective_contexts(policy, replay_random=preserve_rng_state, skip_unneeded=skip_unneeded)

    return checkpoint(fn, *args, preserve_rng_state=preserve_rng_state, early_stop=early_stop,
                      debug=debug, context_fn=contexts, **kwargs)


# ---------------------------------------------------------------------------
# Ready policies
# ---------------------------------------------------------------------------

save_matmuls: frozenset[OpOverload] = frozenset({
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
})
"""Keep every matrix product. ``F.linear``, ``torch.matmul`` and ``@`` reach the
dispatcher as these four ops (``linear`` and ``matmul`` are decomposed before it).
The same ops as PyTorch's usual SAC example, so ``list(save_matmuls)`` can be
passed to ``create_selective_checkpoint_contexts`` for a side-by-side run."""

ATTENTION_CORE_OPS: frozenset[OpOverloadPacket] = frozenset({
    aten.bmm, aten.baddbmm,                       # q @ k^T and weights @ v
    aten._softmax, aten._safe_softmax,            # softmax over the scores
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_cudnn_attention,
})
"""The attention core by op: batched matmuls (in a Transformer only attention uses
them: a linear layer is ``mm``/``addmm`` on the flattened tokens), softmax, and
the fused attention kernels."""


def megatron_attention(op: OpOverload, *args: Any, **kwargs: Any) -> bool:
    """Keep everything except the attention core (Korthikanti et al. 2022, Megatron-LM).

    The core is recomputed: the ops in :data:`ATTENTION_CORE_OPS` (``q @ k^T``,
    softmax, ``weights @ v``, fused attention kernels) and every op that reads a
    *per-head* tensor, one with 4 or more dims (``batch x heads x seq x seq``
    scores, ``batch x heads x seq x d_head`` queries, keys and values): the
    scaling, the causal mask, the attention dropout and the copies made for the
    batched matmuls. Everything else is kept: layer norms, linear layers, GELU,
    residual adds and the residual dropouts, all on ``batch x seq x d_model``
    tensors. The saved memory is the ``O(seq^2)`` scores; the price is the
    attention's share of the flops, small when ``d_model`` is large. By shape it
    also chooses outputs no backward formula needs (a residual sum, a dropout's
    output); those it lets go where keeping them would hold more than plain
    autograd does (``cap_every_op``), so it never holds more than no checkpoint would.

    Written for Transformers: in a model with other 4-d tensors (images), the
    dims rule also recomputes those.

    >>> scores = torch.zeros(2, 4, 16, 16)
    >>> megatron_attention(torch.ops.aten._softmax.default, scores, -1, False)
    False
    >>> megatron_attention(torch.ops.aten.addmm.default, torch.zeros(8), torch.zeros(4, 8), torch.zeros(8, 8))
    True
    """
    if not isinstance(op, OpOverload):
        raise TypeError(f"megatron_attention is a policy, called with an aten op overload such as "
                        f"torch.ops.aten.mm.default and that op's arguments; got {type(op).__name__}. "
                        "Pass it as policy=megatron_attention instead of calling it.")
    if op.overloadpacket in ATTENTION_CORE_OPS:
        return False
    return all(t.dim() < 4 for t in _tensors((args, tuple(kwargs.values()))))


# By shape alone it also chooses residual sums and dropouts that no backward formula needs: hold it to
# plain autograd's bytes before every op (ckptlib.selective.cache, "Never more than plain autograd").
megatron_attention.cap_every_op = True   # type: ignore[attr-defined]

