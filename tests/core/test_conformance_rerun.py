"""Conformance of the rerun with torch's non-reentrant checkpoint, where they once differed.

Forward-mode AD with backward inside the dual level, ``autograd.grad`` inside the checkpointed
function without early stop, ``GraphExecGroup`` (one rerun per group; two backwards that need
the same tensor refused), a rerun that raises (freed at once, no reference cycle), and an
``nn.Parameter`` argument (still a Parameter in the rerun). Each ``test_torch_*`` case pins the
reference: what plain autograd and torch's checkpoint do in the same situation; each
``test_ckptlib_*`` case holds ckptlib to it.
"""
from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
import torch.autograd.forward_ad as forward_ad
import torch.nn as nn
import torch.utils.checkpoint as torch_checkpointing

import ckptlib
from tests._grads import assert_bitwise_equal
from tests.core.test_conformance import Counted, wrap


# ---------------------------------------------------------------------------
# Forward-mode AD, with the backward inside the dual level
# ---------------------------------------------------------------------------


def forward_ad_then_backward(library: str) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 3, generator=generator, requires_grad=True)
    w = torch.randn(3, 2, generator=generator, requires_grad=True)
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(x, torch.ones_like(x))
        out = wrap(library, lambda t: (t @ w).sin())(dual)
        primal, tangent = forward_ad.unpack_dual(out)
        (primal.sum() + tangent.sum()).backward()
    return [primal.detach(), tangent.detach(), x.grad, w.grad]


def test_torch_forward_ad_with_backward_inside_the_dual_level():
    assert_bitwise_equal(forward_ad_then_backward("torch"), forward_ad_then_backward("plain"))


def test_ckptlib_forward_ad_with_backward_inside_the_dual_level():
    assert_bitwise_equal(forward_ad_then_backward("ckptlib"), forward_ad_then_backward("plain"))


# ---------------------------------------------------------------------------
# torch.autograd.grad inside the checkpointed function, without early stop
# ---------------------------------------------------------------------------


def gradient_inside(t: torch.Tensor) -> torch.Tensor:
    inner = t.sin()
    (slope,) = torch.autograd.grad(inner.sum(), t, create_graph=True)
    return (slope * inner).exp()


def grad_inside_without_early_stop(library: str) -> list[torch.Tensor]:
    x = torch.randn(4, generator=torch.Generator().manual_seed(0), requires_grad=True)
    with torch_checkpointing.set_checkpoint_early_stop(False):
        out = wrap(library, gradient_inside)(x)
    return [out.detach(), *torch.autograd.grad(out.sum(), x)]


def test_torch_autograd_grad_inside_the_function_without_early_stop():
    assert_bitwise_equal(grad_inside_without_early_stop("torch"),
                         grad_inside_without_early_stop("plain"))


def test_ckptlib_autograd_grad_inside_the_function_without_early_stop():
    assert_bitwise_equal(grad_inside_without_early_stop("ckptlib"),
                         grad_inside_without_early_stop("plain"))


# ---------------------------------------------------------------------------
# torch.utils.checkpoint.GraphExecGroup
# ---------------------------------------------------------------------------


def two_backwards_in_one_group(library: str) -> tuple[list[torch.Tensor], int]:
    """Two ``autograd.grad`` calls over parts of the graph that share no saved tensor."""
    generator = torch.Generator().manual_seed(0)
    x, w, v = (torch.randn(shape, generator=generator, requires_grad=True)
               for shape in [(3, 4), (4, 4), (4, 4)])
    fn = Counted(lambda t: ((t @ w).exp(), (t @ v).tanh()))
    first, second = wrap(library, fn)(x)
    with torch_checkpointing.GraphExecGroup():
        grads = [*torch.autograd.grad(first.sum(), [x, w]),
                 *torch.autograd.grad(second.sum(), [x, v])]
    return grads, fn.calls


def test_torch_graph_exec_group_reruns_once_for_backwards_over_separate_parts():
    plain, _ = two_backwards_in_one_group("plain")
    grads, calls = two_backwards_in_one_group("torch")
    assert_bitwise_equal(grads, plain)
    assert calls == 2   # the forward and one rerun for both backwards


def test_ckptlib_graph_exec_group_reruns_once_for_backwards_over_separate_parts():
    plain, _ = two_backwards_in_one_group("plain")
    grads, calls = two_backwards_in_one_group("ckptlib")
    assert_bitwise_equal(grads, plain)
    assert calls == 2


def overlapping_backwards_in_one_group(library: str) -> None:
    """Two ``autograd.grad`` calls in one group that need the same saved tensors."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, generator=generator, requires_grad=True)
    w = torch.randn(4, 4, generator=generator, requires_grad=True)
    out = wrap(library, lambda t: (t @ w).tanh().exp())(x)
    with torch_checkpointing.GraphExecGroup():
        torch.autograd.grad(out.sum(), x, retain_graph=True)
        torch.autograd.grad(out.sum(), x)


def test_torch_graph_exec_group_refuses_two_backwards_that_need_the_same_tensor():
    with pytest.raises(torch_checkpointing.CheckpointError, match="GraphExecGroup"):
        overlapping_backwards_in_one_group("torch")


def test_ckptlib_graph_exec_group_refuses_two_backwards_that_need_the_same_tensor():
    with pytest.raises(ckptlib.CheckpointError, match="GraphExecGroup"):
        overlapping_backwards_in_one_group("ckptlib")


# ---------------------------------------------------------------------------
# A rerun that raises
# ---------------------------------------------------------------------------


def tensors_alive_after_a_failed_rerun(library: str) -> list[bool]:
    """Whether each tensor the function made is still alive after a backward whose rerun raised,
    without the cycle collector's help."""
    state = {"fail": False}
    made: list[weakref.ref] = []

    def fn(t: torch.Tensor) -> torch.Tensor:
        h = t.exp()
        made.append(weakref.ref(h))
        if state["fail"]:
            raise ValueError("the rerun failed")
        return h.sin()

    out = wrap(library, fn)(torch.randn(100, requires_grad=True))
    state["fail"] = True
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with pytest.raises(ValueError, match="the rerun failed"):
            out.sum().backward()
        del out
        return [ref() is not None for ref in made]
    finally:
        if was_enabled:
            gc.enable()


def test_torch_a_rerun_that_raises_frees_its_tensors_at_once():
    assert tensors_alive_after_a_failed_rerun("torch") == [False, False]


def test_ckptlib_a_rerun_that_raises_frees_its_tensors_at_once():
    assert tensors_alive_after_a_failed_rerun("ckptlib") == [False, False]


# ---------------------------------------------------------------------------
# An nn.Parameter passed as an argument
# ---------------------------------------------------------------------------


def argument_types(library: str) -> list[str]:
    """The type the function receives its ``nn.Parameter`` argument as, in forward and rerun."""
    seen: list[str] = []

    def fn(weight: Any) -> torch.Tensor:
        seen.append(type(weight).__name__)
        return weight.sin()

    wrap(library, fn)(nn.Parameter(torch.randn(3))).sum().backward()
    return seen


def test_torch_a_parameter_argument_is_a_parameter_in_the_rerun():
    assert argument_types("torch") == ["Parameter", "Parameter"]


def test_ckptlib_a_parameter_argument_is_a_parameter_in_the_rerun():
    assert argument_types("ckptlib") == ["Parameter", "Parameter"]
