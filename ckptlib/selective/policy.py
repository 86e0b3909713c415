"""What a policy is, how the modes ask it, and the ready ones (``save_matmuls``,
``megatron_attention``).

A policy says, for each aten op a selective checkpoint's forward runs, whether to keep the op's
output: a collection of aten ops (``{aten.mm}``: every overload; ``aten.mm.default``: that one)
or a function ``policy(op, *args, **kwargs) -> bool``. :func:`as_predicate` turns either into the
one question the forward mode asks per op, and refuses, at the call, a policy that would fail on
the first op (not an aten op, not callable as ``policy(op, *args, **kwargs)``).

A policy may also carry ``cap_every_op = True`` (``megatron_attention`` does): the forward mode
then holds it to plain autograd's bytes before every op, and at the end of forward lets go of the
kept outputs the rerun would not read (see "Never more than plain autograd" in
:mod:`ckptlib.selective.cache`).
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable, Collection, Union

import torch
from torch._ops import OpOverload, OpOverloadPacket

from ckptlib._arguments import got, qualname
from ckptlib.selective.ops import tensors_of

aten = torch.ops.aten

Policy = Union[Callable[..., bool], Collection[Union[OpOverload, OpOverloadPacket]]]
"""``policy(op, *args, **kwargs) -> bool`` (save this op's output?), or a collection of
ops to save (an ``OpOverload`` such as ``aten.mm.default`` matches that overload, an
``OpOverloadPacket`` such as ``aten.mm`` all of its overloads)."""


def as_predicate(policy: Policy) -> Callable[[OpOverload, tuple, dict], bool]:
    """``policy`` as ``predicate(func, args, kwargs) -> bool``; a ``TypeError`` now, at the call,
    for a policy that would fail on the first op (not an aten op, not callable as
    ``policy(op, *args, **kwargs)``)."""
    if isinstance(policy, (OpOverload, OpOverloadPacket)):
        policy = {policy}
    if callable(policy):
        _check_policy_signature(policy)

        def predicate(func: OpOverload, args: tuple, kwargs: dict) -> bool:
            decision = policy(func, *args, **kwargs)
            return (
                decision
                if decision is True or decision is False
                else _decision(decision, policy, func)
            )

        return predicate
    if isinstance(policy, (str, bytes)) or not isinstance(policy, Collection):
        raise TypeError(
            f"policy must be a callable policy(op, *args, **kwargs) -> bool or a collection "
            f"of aten ops such as {{torch.ops.aten.mm.default}}, got {type(policy).__name__}."
        )
    ops = frozenset(policy)
    for op in ops:
        if not isinstance(op, (OpOverload, OpOverloadPacket)):
            raise TypeError(
                f"policy contains {op!r} ({type(op).__name__}), which is not an aten op; "
                "use ops like torch.ops.aten.mm.default or torch.ops.aten.mm (all overloads), "
                "not torch.mm or strings."
            )
    return lambda func, args, kwargs: func in ops or func.overloadpacket in ops


def _decision(decision: Any, policy: Callable[..., Any], func: OpOverload) -> bool:
    """A policy's answer that is not ``True`` or ``False``: NumPy's booleans and torch's
    ``CheckpointPolicy`` (``MUST_SAVE``/``PREFER_SAVE`` keep) mean what they say; anything else
    (``"yes"``, ``None``, a number) is refused, since Python's truth would read ``"no"`` as keep."""
    if type(decision).__module__ == "numpy" and type(decision).__name__ in (
        "bool",
        "bool_",
    ):  # NumPy 2, 1
        return bool(decision)
    torch_checkpoint = sys.modules.get("torch.utils.checkpoint")
    checkpoint_policy = getattr(torch_checkpoint, "CheckpointPolicy", None)
    if checkpoint_policy is not None and isinstance(decision, checkpoint_policy):
        return decision in (checkpoint_policy.MUST_SAVE, checkpoint_policy.PREFER_SAVE)
    raise PolicyAnswerError(
        TypeError(
            f"policy {qualname(policy)} returned no decision for {func}, {got(decision)}: "
            "a policy must return True (keep "
            "this op's output) or False (recompute it in backward)."
        )
    )


class PolicyAnswerError(Exception):
    """Carries the ``TypeError`` about a policy's answer out of the op that asked, to the forward
    mode's exit, which raises it. (Raised inside ``a @ b``, a ``TypeError`` becomes
    ``NotImplemented`` and then
    Python's "unsupported operand type(s) for @".)"""

    def __init__(self, error: TypeError) -> None:
        super().__init__(str(error))
        self.error = error


def _check_policy_signature(policy: Callable[..., Any]) -> None:
    """The modes call ``policy(op, *args, **kwargs)`` for every op, with as many arguments as the op
    takes and, for some ops (``_to_copy(x, dtype=...)``), keyword arguments: a policy must accept
    all of that. (A callable whose signature Python cannot read, a builtin, is taken on trust.)"""
    try:
        signature = inspect.signature(policy)
    except (TypeError, ValueError):
        return
    kinds = {parameter.kind for parameter in signature.parameters.values()}
    try:
        signature.bind(None)
        takes_op = True
    except TypeError:
        takes_op = False
    if (
        takes_op
        and inspect.Parameter.VAR_POSITIONAL in kinds
        and inspect.Parameter.VAR_KEYWORD in kinds
    ):
        return
    name = qualname(policy)
    raise TypeError(
        f"policy {name}{signature} cannot be called as policy(op, *args, **kwargs): selective "
        "checkpointing calls it with every aten op, that op's arguments and its keyword "
        "arguments. Give it the parameters (op, *args, **kwargs), or pass a collection of aten "
        "ops such as {torch.ops.aten.mm.default}."
    )


# ---------------------------------------------------------------------------
# Ready policies
# ---------------------------------------------------------------------------

save_matmuls: frozenset[OpOverload] = frozenset(
    {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.baddbmm.default,
    }
)
"""Keep every matrix product. ``F.linear``, ``torch.matmul`` and ``@`` reach the
dispatcher as these four ops (``linear`` and ``matmul`` are decomposed before it).
The same ops as PyTorch's usual SAC example, so ``list(save_matmuls)`` can be
passed to ``create_selective_checkpoint_contexts`` for a side-by-side run."""

ATTENTION_CORE_OPS: frozenset[OpOverloadPacket] = frozenset(
    {
        aten.bmm,
        aten.baddbmm,  # q @ k^T and weights @ v
        aten._softmax,
        aten._safe_softmax,  # softmax over the scores
        aten._scaled_dot_product_flash_attention_for_cpu,
        aten._scaled_dot_product_flash_attention,
        aten._scaled_dot_product_efficient_attention,
        aten._scaled_dot_product_cudnn_attention,
    }
)
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
    also chooses outputs no backward formula needs (a dropout's output, GELU's
    intermediate results); those it lets go when the rerun would not read them, and
    where keeping them would hold more than plain autograd does (``cap_every_op``),
    so that it holds no more than no checkpoint would (measured on GPT-2, Llama and
    ``TinyTransformer`` in ``tests/selective/test_selective_memory.py``).

    Written for Transformers: in a model with other 4-d tensors (images), the
    dims rule also recomputes those.

    >>> scores = torch.zeros(2, 4, 16, 16)
    >>> megatron_attention(torch.ops.aten._softmax.default, scores, -1, False)
    False
    >>> bias, tokens, weight = torch.zeros(8), torch.zeros(4, 8), torch.zeros(8, 8)
    >>> megatron_attention(torch.ops.aten.addmm.default, bias, tokens, weight)
    True
    """
    if not isinstance(op, OpOverload):
        raise TypeError(
            f"megatron_attention is a policy, called with an aten op overload such as "
            f"torch.ops.aten.mm.default and that op's arguments; got {type(op).__name__}. "
            "Pass it as policy=megatron_attention instead of calling it."
        )
    if op.overloadpacket in ATTENTION_CORE_OPS:
        return False
    # Asked for every op of the forward: a plain loop over the arguments, most of them tensors
    # (a quarter of the time of collecting them all first).
    for arg in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(arg, torch.Tensor):
            if arg.dim() >= 4:
                return False
        elif isinstance(arg, (list, tuple)) and any(t.dim() >= 4 for t in tensors_of(arg)):
            return False
    return True


# By shape alone it also chooses outputs that no backward formula needs: hold it to plain
# autograd's bytes (ckptlib.selective.cache, "Never more than plain autograd").
megatron_attention.cap_every_op = True  # type: ignore[attr-defined]


def policy_name(policy: Policy) -> str:
    """A policy's name for tables: ``save_matmuls`` for the ready set, a function's own name, or
    ``policy``.

    >>> policy_name(save_matmuls), policy_name(megatron_attention)
    ('save_matmuls', 'megatron_attention')
    """
    if policy is save_matmuls or policy == save_matmuls:
        return "save_matmuls"
    return getattr(policy, "__name__", "policy")
