"""Claims notebook 08, a deep dive into selective checkpointing, makes in prose, checked on the
installed torch.

The notebooks measure these in their cells (nbval compares the committed outputs); the tests
here keep the claims true when torch or ckptlib changes, without running a notebook, and check
the few that a cell cannot show (FSDP2's parameter gathers).
"""
from __future__ import annotations

import pytest
import torch

from ckptlib import record_trace, selective_checkpoint
from ckptlib.selective import SelectivePlans

aten = torch.ops.aten


# ---------------------------------------------------------------------------
# Notebook 08, section 5 and exercise 2: which check catches a changed branch
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("first, second, outcome", [
    (lambda h: h.exp(), lambda h: h.sigmoid(), "fallback"),        # another node saves the output
    (lambda h: (h * 2).exp(), lambda h: (h + h).exp(), "mismatch"),  # same saved tensors, other ops
])
def test_a_changed_branch_costs_a_fallback_or_a_second_rerun_never_a_wrong_gradient(
    first, second, outcome
):
    torch.manual_seed(0)
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(8, 16, requires_grad=True)
    branch = [first]

    def fn(h):
        return branch[0](h @ w) @ w

    plans = SelectivePlans()
    selective_checkpoint(fn, x, policy={aten.mm}, plans=plans).sum().backward()
    branch[0] = second
    expected = torch.autograd.grad(fn(x).sum(), w)[0]
    w.grad = None
    with record_trace() as trace:
        selective_checkpoint(fn, x, policy={aten.mm}, plans=plans).sum().backward()
    assert torch.equal(w.grad, expected)
    assert (plans.fallbacks, plans.mismatches) == ((1, 0) if outcome == "fallback" else (0, 1))
    assert trace.count("recompute") == (1 if outcome == "fallback" else 2)
