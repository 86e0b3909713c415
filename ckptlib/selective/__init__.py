"""Selective checkpointing: keep the outputs of chosen ops, recompute the rest.

One idea per module, in the order a call meets them:

================  ==========================================================================
``entry``         ``selective_checkpoint``: ``ckptlib.checkpoint`` with the modes as its
                  ``context_fn``
``policy``        what a policy is and how the modes ask it; the ready ones (``save_matmuls``,
                  ``megatron_attention``)
``modes``         the two dispatch modes: save the chosen outputs in forward, replay or skip
                  them in the rerun (``selective_contexts``, the ``context_fn`` pair)
``cache``         what one call keeps between the two, and when it is freed
``opgraph``       the op graph of a forward pass, and which calls a rerun can skip
``ops``           what kind of aten op a call is, and which tensors it reads and writes
``plans``         ``SelectivePlans``: later calls reuse a plan and run forward with no mode
``signatures``    what must match for that: the call's signature, each saved tensor's fingerprint
``costs``         ``policy_from_costs``: a policy from measured time and bytes per op call
================  ==========================================================================

Imports point the other way, one layer down at a time, with no cycles: ``ops`` and ``policy``
at the bottom, then ``signatures`` and ``opgraph``, ``cache``, ``modes``, ``plans`` and
``costs``, and ``entry`` on top. Bad arguments are refused at the call by
``ckptlib._arguments``, as everywhere in ckptlib; a saved tensor's key comes from
``ckptlib.core.checks`` (with its storage), as in ``ckptlib.checkpoint``.

>>> import torch
>>> from ckptlib.selective import save_matmuls, selective_checkpoint
>>> x = torch.randn(8, 8, requires_grad=True)
>>> w = torch.randn(8, 8, requires_grad=True)
>>> selective_checkpoint(lambda a: (a @ w).tanh() @ w, x, policy=save_matmuls).sum().backward()
"""

from ckptlib.selective.costs import (
    CostPolicy,
    CostProfile,
    OpCall,
    OpCost,
    choose_ops,
    measure_op_costs,
    policy_from_costs,
)
from ckptlib.selective.entry import selective_checkpoint
from ckptlib.selective.modes import ReplaySavedOps, SaveChosenOps, selective_contexts
from ckptlib.selective.plans import SelectivePlans
from ckptlib.selective.policy import ATTENTION_CORE_OPS, Policy, megatron_attention, save_matmuls

__all__ = [
    "selective_checkpoint",
    "selective_contexts",
    "SelectivePlans",
    "Policy",
    "SaveChosenOps",
    "ReplaySavedOps",
    "save_matmuls",
    "megatron_attention",
    "ATTENTION_CORE_OPS",
    "OpCall",
    "OpCost",
    "CostProfile",
    "CostPolicy",
    "measure_op_costs",
    "choose_ops",
    "policy_from_costs",
]
