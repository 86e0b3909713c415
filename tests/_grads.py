"""Gradients compared to the bit, for the tests that hold a checkpointed run to plain autograd:
the same numbers, not close ones.

Lists of tensors (an input's gradient, then the parameters') are compared with
``assert_bitwise_equal``, or with ``bitwise_equal`` where a test asserts that they differ; a whole
training step, its loss and each parameter's gradient by name, with ``assert_same_step``.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn as nn


def gradients(
    run: Callable[[], torch.Tensor], tensors: Sequence[torch.Tensor], seed: int | None = None
) -> tuple[torch.Tensor, ...]:
    """The gradients of ``run().sum()`` w.r.t. ``tensors``, the global RNG seeded first if a
    ``seed`` is given."""
    if seed is not None:
        torch.manual_seed(seed)
    return torch.autograd.grad(run().sum(), tensors)


def take_grads(x: torch.Tensor, module: nn.Module) -> list[torch.Tensor]:
    """The gradients of ``x`` and of ``module``'s parameters, copied; both are then reset."""
    result = [x.grad.clone(), *(p.grad.clone() for p in module.parameters())]
    x.grad = None
    module.zero_grad(set_to_none=True)
    return result


def bitwise_equal(first: Sequence[torch.Tensor], second: Sequence[torch.Tensor]) -> bool:
    """As many tensors in each, pair by pair ``torch.equal``."""
    return len(first) == len(second) and all(torch.equal(a, b) for a, b in zip(first, second))


def assert_bitwise_equal(
    actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor], *, equal_nan: bool = False
) -> None:
    """As many tensors in each, pair by pair the same values to the bit (``rtol=atol=0``), dtype,
    shape and device; NaN matches NaN only with ``equal_nan`` (a random op chain may overflow)."""
    assert len(actual) == len(expected), f"{len(actual)} tensors, expected {len(expected)}"
    for index, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(
            a, e, rtol=0, atol=0, equal_nan=equal_nan, msg=lambda text: f"tensor {index}: {text}"
        )


def seeded_step(
    model: nn.Module, loss: Callable[[], torch.Tensor], seed: int = 1234
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One training step of ``model`` with the same dropout masks every time (the global RNG
    seeded first): the loss and each parameter's gradient, copied, by name."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    value = loss()
    value.backward()
    return value.detach(), {
        name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None
    }


def assert_same_step(expected: tuple, got: tuple) -> None:
    """Two steps' ``(loss, {name: gradient})`` equal to the bit (``torch.equal``), name by name."""
    assert torch.equal(expected[0], got[0]), f"loss {got[0]} != {expected[0]}"
    assert expected[1].keys() == got[1].keys()
    differ = [name for name in expected[1] if not torch.equal(expected[1][name], got[1][name])]
    assert not differ, f"gradients differ: {differ[:3]}"
