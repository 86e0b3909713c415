"""Shared by the tests/<folder>/test_misuse_<module>.py tables: a misuse must fail clearly and
leave nothing behind.

Each row of a table is ``Misuse(id, call, error, words)``: calling ``call()`` must raise exactly
``error`` (TypeError or ValueError, KeyError for a lookup) at once, its message must contain
every one of ``words`` (the argument's name, what it accepts, what was given; a word given as a
compiled ``re`` pattern must be found by ``pattern.search``), and afterwards the process must be
as it was: no dispatch or torch-function mode left on the stack, no saved-tensor hooks, no global
module hooks, no open ckptlib trace, the global RNG untouched.

A table is a list of rows named ``TABLE`` (or one list per function family), parametrized with
``@pytest.mark.parametrize("row", rows(TABLE))`` and checked with ``assert_refused(row)``; what a
file checks beyond that (the function never ran, a model kept its state) follows in the test.
"""
from __future__ import annotations

import re
from typing import Any, Callable, NamedTuple

import pytest
import torch
import torch.nn as nn
from torch.nn.modules import module as module_hooks

from ckptlib import rng
from ckptlib.core.peek import peeking
from ckptlib import is_recomputing
from ckptlib.memory import _ORIGINAL_STORAGE_RESIZE
from ckptlib.core.trace import tracing_active


class Misuse(NamedTuple):
    id: str
    call: Callable[[], Any]
    error: type[Exception]
    words: tuple[str | re.Pattern[str], ...]


def rows(table: list[Misuse]) -> list:
    """The table as pytest parameters, each named by its id."""
    return [pytest.param(row, id=row.id) for row in table]


def installed() -> dict[str, Any]:
    """What a call installs while it runs and must remove however it ends: every value falsy when
    nothing is."""
    return {
        "dispatch modes": torch._C._len_torch_dispatch_stack(),
        "torch function modes": torch._C._len_torch_function_stack(),
        "saved-tensor hooks": torch._C._autograd._top_saved_tensors_default_hooks(False)
        is not None,
        "ckptlib traces": tracing_active(),
        "registered generator uses": len(rng._users),
        "recomputing": is_recomputing(),
        "peeking at saved tensors": peeking() is not None,
        "memory meters listening to storage resizes": torch.UntypedStorage.resize_
        is not _ORIGINAL_STORAGE_RESIZE,
    }


def assert_nothing_installed() -> None:
    left = {name: value for name, value in installed().items() if value}
    assert not left, f"left behind: {left}"


def process_state() -> dict[str, Any]:
    """What a call could leave behind in the process, as comparable values."""
    return {
        **installed(),
        "global module hooks": (
            len(module_hooks._global_forward_pre_hooks),
            len(module_hooks._global_forward_hooks),
            len(module_hooks._global_backward_hooks),
        ),
        "global RNG state": torch.random.get_rng_state().tolist(),
    }


def module_state(model: nn.Module) -> dict[str, Any]:
    """A model's parameters, gradients and hooks, to check that a refused call changed none of
    them."""
    return {
        "parameters": [p.detach().clone() for p in model.parameters()],
        "gradients": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "hooks": [len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
                  for m in model.modules()],
    }


def assert_same_module_state(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert after["hooks"] == before["hooks"], "a module hook was left on the model"
    for key in ("parameters", "gradients"):
        for old, new in zip(before[key], after[key]):
            assert (old is None and new is None) or (
                old is not None and new is not None and torch.equal(old, new)
            ), f"the refused call changed the model's {key}"


def assert_refused(row: Misuse) -> str:
    """Run ``row.call`` and check the error, its words and that nothing was left behind; return the
    message."""
    before = process_state()
    with pytest.raises(Exception) as caught:
        row.call()
    message = str(caught.value)
    assert caught.type is row.error, (
        f"expected {row.error.__name__}, got {caught.type.__name__}: {message}"
    )
    missing = [
        word
        for word in row.words
        if (word.search(message) is None if isinstance(word, re.Pattern) else word not in message)
    ]
    assert missing == [], f"the message lacks {missing}: {message}"
    assert process_state() == before, "the refused call left something behind"
    assert_nothing_installed()
    return message
