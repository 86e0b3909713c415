"""Misuse of the public selective functions: a clear error at the call, and nothing left behind.

Each row: the call, the exception it must raise, and words its message must contain (the
argument's name, what it accepts, the bad value). After the error no dispatch mode is active,
no saved-tensor hook is installed, and no function was run or measured.
"""
from __future__ import annotations

import pytest
import torch

from ckptlib import CheckpointError
from ckptlib.models import TransformerBlock
from ckptlib.selective import (
    CostProfile, OpCall, OpCost, SelectivePlans, choose_ops, measure_op_costs, megatron_attention,
    policy_from_costs, save_matmuls, selective_checkpoint, selective_contexts,
)

from tests._misuse import assert_nothing_installed

aten = torch.ops.aten


def keep_without_kwargs(op, *args):
    return op is aten.mm.default


class KeepOnlyOp:
    def __call__(self, op):
        return op is aten.mm.default


def two_required(op, tensor, *args, **kwargs):
    return True


class Calls:
    """A function that counts its calls: an error "at the call" means it never ran."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return (t @ t).relu()


def _x() -> torch.Tensor:
    return torch.randn(4, 4, requires_grad=True)


_PROFILE = CostProfile(
    {OpCall(aten.mm.default, ((4, 4), (4, 4))): OpCost(1, 0.001, 64)}, activation_bytes=64
)

# (id, function, positional arguments after fn, keyword arguments, exception, words in the message)
SELECTIVE_CHECKPOINT = [
    ("policy str", {"policy": "aten.mm"}, TypeError, ["policy must be a callable", "str"]),
    ("policy None", {"policy": None}, TypeError, ["policy must be a callable", "NoneType"]),
    ("policy torch.mm", {"policy": {torch.mm}}, TypeError, ["policy contains", "not an aten op"]),
    ("policy strings", {"policy": ["aten.mm"]}, TypeError, ["'aten.mm'", "not an aten op"]),
    (
        "policy lambda op",
        {"policy": lambda op: True},
        TypeError,
        ["policy <lambda>(op)", "policy(op, *args, **kwargs)"],
    ),
    (
        "policy without **kwargs",
        {"policy": keep_without_kwargs},
        TypeError,
        ["keep_without_kwargs(op, *args)", "keyword arguments"],
    ),
    (
        "policy object, one parameter",
        {"policy": KeepOnlyOp()},
        TypeError,
        ["policy KeepOnlyOp(op)", "(op, *args, **kwargs)"],
    ),
    (
        "policy, two required",
        {"policy": two_required},
        TypeError,
        ["two_required(op, tensor, *args, **kwargs)"],
    ),
    (
        "skip_unneeded str",
        {"policy": save_matmuls, "skip_unneeded": "no"},
        TypeError,
        ["selective_checkpoint", "skip_unneeded must be True or False", "'no'"],
    ),
    (
        "preserve_rng_state str",
        {"policy": save_matmuls, "preserve_rng_state": "no"},
        TypeError,
        ["preserve_rng_state must be True or False", "'no'"],
    ),
    (
        "early_stop None",
        {"policy": save_matmuls, "early_stop": None},
        TypeError,
        ["early_stop must be True or False", "None"],
    ),
    (
        "debug str",
        {"policy": save_matmuls, "debug": "loud"},
        TypeError,
        ["debug must be True or False", "'loud'"],
    ),
    (
        "plans dict",
        {"policy": save_matmuls, "plans": {}},
        TypeError,
        ["plans must be a SelectivePlans", "dict"],
    ),
    (
        "plans without skipping",
        {"policy": save_matmuls, "plans": SelectivePlans(), "skip_unneeded": False},
        ValueError,
        ["plans= needs skip_unneeded=True"],
    ),
]

POLICY_FROM_COSTS = [
    (
        "memory_ratio str",
        {"memory_ratio": "half"},
        TypeError,
        ["memory_ratio must be a number", "'half'", "str"],
    ),
    (
        "memory_ratio bool",
        {"memory_ratio": True},
        TypeError,
        ["memory_ratio must be a number", "bool"],
    ),
    (
        "memory_ratio negative",
        {"memory_ratio": -0.5},
        ValueError,
        ["memory_ratio must be a finite number >= 0", "-0.5"],
    ),
    (
        "memory_ratio nan",
        {"memory_ratio": float("nan")},
        ValueError,
        ["memory_ratio", "finite", "nan"],
    ),
    (
        "repeats str",
        {"memory_ratio": 0.5, "repeats": "3"},
        TypeError,
        ["repeats must be an int", "'3'"],
    ),
    (
        "repeats zero",
        {"memory_ratio": 0.5, "repeats": 0},
        ValueError,
        ["repeats must be at least 1", "got 0"],
    ),
    (
        "budget negative",
        {"budget_bytes": -5},
        ValueError,
        ["budget_bytes must be at least 0", "got -5"],
    ),
    (
        "budget str",
        {"budget_bytes": "1MB"},
        TypeError,
        ["budget_bytes must be an int number of bytes", "'1MB'"],
    ),
    ("budget float", {"budget_bytes": 1.5}, TypeError, ["budget_bytes must be an int", "1.5"]),
    (
        "worth str",
        {"memory_ratio": 0.5, "worth": "1"},
        TypeError,
        ["worth must be a number", "'1'"],
    ),
    (
        "worth negative",
        {"memory_ratio": 0.5, "worth": -1},
        ValueError,
        ["worth must be a finite number >= 0"],
    ),
    ("both budgets", {"memory_ratio": 0.5, "budget_bytes": 10}, ValueError, ["exactly one budget"]),
    ("no budget", {}, ValueError, ["exactly one budget", "memory_ratio", "budget_bytes"]),
]

MEASURE_OP_COSTS = [
    (
        "repeats str",
        {"repeats": "3"},
        TypeError,
        ["measure_op_costs", "repeats must be an int", "'3'"],
    ),
    (
        "repeats zero",
        {"repeats": 0},
        ValueError,
        ["measure_op_costs", "repeats must be at least 1"],
    ),
]

OTHER = [
    (
        "policy_from_costs fn None",
        lambda: policy_from_costs(None, _x(), memory_ratio=0.5),
        TypeError,
        ["policy_from_costs", "fn must be the function or module to measure", "NoneType"],
    ),
    (
        "measure_op_costs fn str",
        lambda: measure_op_costs("block", _x()),
        TypeError,
        ["measure_op_costs", "fn must be", "str"],
    ),
    (
        "choose_ops profile None",
        lambda: choose_ops(None, 100),
        TypeError,
        ["profile must be a CostProfile", "NoneType"],
    ),
    (
        "choose_ops budget negative",
        lambda: choose_ops(_PROFILE, -5),
        ValueError,
        ["budget_bytes must be at least 0"],
    ),
    (
        "choose_ops budget str",
        lambda: choose_ops(_PROFILE, "100"),
        TypeError,
        ["budget_bytes must be an int"],
    ),
    (
        "choose_ops worth str",
        lambda: choose_ops(_PROFILE, 100, worth="high"),
        TypeError,
        ["worth must be a number"],
    ),
    (
        "selective_contexts replay_random",
        lambda: selective_contexts(save_matmuls, replay_random="yes"),
        TypeError,
        ["selective_contexts", "replay_random must be True or False", "'yes'"],
    ),
    (
        "selective_contexts skip_unneeded",
        lambda: selective_contexts(save_matmuls, skip_unneeded=1),
        TypeError,
        ["selective_contexts", "skip_unneeded must be True or False", "1 (int)"],
    ),
    (
        "selective_contexts policy",
        lambda: selective_contexts(lambda op: True),
        TypeError,
        ["<lambda>(op) cannot be called as policy(op, *args, **kwargs)"],
    ),
    (
        "megatron_attention called with torch.mm",
        lambda: megatron_attention(torch.mm, torch.zeros(2, 2)),
        TypeError,
        [
            "megatron_attention is a policy",
            "builtin_function_or_method",
            "policy=megatron_attention",
        ],
    ),
    (
        "checkpointed fn str",
        lambda: selective_checkpoint("block", _x(), policy=save_matmuls),
        TypeError,
        ["fn must be callable", "str"],
    ),
]


def _check(call, exception, words) -> None:
    with pytest.raises(exception) as info:
        call()
    message = str(info.value)
    missing = [word for word in words if word not in message]
    assert not missing, f"{missing} not in: {message}"
    assert_nothing_installed()


@pytest.mark.parametrize(
    "kwargs, exception, words",
    [row[1:] for row in SELECTIVE_CHECKPOINT],
    ids=[row[0] for row in SELECTIVE_CHECKPOINT],
)
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_selective_checkpoint_rejects_at_the_call(kwargs, exception, words, grad):
    fn = Calls()
    with torch.set_grad_enabled(grad):
        _check(lambda: selective_checkpoint(fn, _x(), **kwargs), exception, words)
    assert fn.count == 0


MEASURING = [(policy_from_costs, *row) for row in POLICY_FROM_COSTS] + [
    (measure_op_costs, *row) for row in MEASURE_OP_COSTS
]


@pytest.mark.parametrize(
    "function, kwargs, exception, words",
    [(row[0], *row[2:]) for row in MEASURING],
    ids=[f"{row[0].__name__}: {row[1]}" for row in MEASURING],
)
def test_measuring_functions_reject_before_measuring(function, kwargs, exception, words):
    fn = Calls()
    _check(lambda: function(fn, _x(), **kwargs), exception, words)
    assert fn.count == 0


@pytest.mark.parametrize(
    "call, exception, words", [row[1:] for row in OTHER], ids=[row[0] for row in OTHER]
)
def test_other_selective_functions_reject_at_the_call(call, exception, words):
    _check(call, exception, words)


def test_a_failed_call_leaves_the_plans_untouched():
    block = TransformerBlock(d_model=16, heads=2, seq=8, dropout=0.0)
    x = torch.randn(2, 8, 16, requires_grad=True)
    plans = SelectivePlans()
    selective_checkpoint(block, x, policy=save_matmuls, plans=plans).sum().backward()
    before = repr(plans)
    for kwargs in (
        {"preserve_rng_state": "no"},
        {"early_stop": None},
        {"debug": "loud"},
        {"skip_unneeded": "yes"},
        {"policy": lambda op: True},
    ):
        with pytest.raises(TypeError):
            selective_checkpoint(block, x, **{"policy": save_matmuls, "plans": plans, **kwargs})
        assert repr(plans) == before
        assert_nothing_installed()


def test_a_policy_that_raises_leaves_nothing_behind():
    def broken(op, *args, **kwargs):
        raise RuntimeError("policy bug")

    plans = SelectivePlans()
    for reuse in (None, plans):
        with pytest.raises(RuntimeError, match="policy bug"):
            selective_checkpoint(lambda t: (t @ t).relu(), _x(), policy=broken, plans=reuse)
        assert_nothing_installed()
    assert len(plans) == 0 and plans.recorded == 0


def test_plans_reuse_a_bound_method():
    """``block.forward`` is a new object at every access: the plan follows the block."""
    block = TransformerBlock(d_model=16, heads=2, seq=8, dropout=0.0)
    x = torch.randn(2, 8, 16, requires_grad=True)
    plans = SelectivePlans()
    expected = torch.autograd.grad(block(x).sum(), x)[0]
    for step in range(3):
        out = selective_checkpoint(block.forward, x, policy=save_matmuls, plans=plans)
        assert torch.equal(torch.autograd.grad(out.sum(), x)[0], expected)
    assert (len(plans), plans.recorded, plans.reused, plans.fallbacks, plans.mismatches) == (
        1,
        1,
        2,
        0,
        0,
    )
    # The method and the module itself are different functions: each gets its own plan.
    selective_checkpoint(block, x, policy=save_matmuls, plans=plans).sum().backward()
    assert (len(plans), plans.recorded) == (2, 2)


def test_a_bound_methods_plans_die_with_its_instance():
    import gc
    import weakref

    block = TransformerBlock(d_model=16, heads=2, seq=8, dropout=0.0)
    plans = SelectivePlans()
    selective_checkpoint(
        block.forward, torch.randn(2, 8, 16, requires_grad=True), policy=save_matmuls, plans=plans
    ).sum().backward()
    assert len(plans) == 1
    alive = weakref.ref(block)
    del block
    gc.collect()
    assert alive() is None and len(plans) == 0


def test_plans_warn_once_where_they_cannot_help():
    x = _x()
    plans = SelectivePlans()
    with pytest.warns(
        UserWarning, match=r"cannot keep plans for TensorBase.relu: .* Pass a Python function"
    ) as caught:
        for step in range(3):
            selective_checkpoint(
                torch.Tensor.relu, x, policy=save_matmuls, plans=plans
            ).sum().backward()
    assert len(caught) == 1 and caught[0].filename == __file__  # points at the caller's line
    assert plans.reused == 0


def test_the_top_level_names_are_selectives_own():
    import ckptlib
    import ckptlib.selective as selective

    for name in ("selective_checkpoint", "save_matmuls", "megatron_attention",
                 "policy_from_costs", "SelectivePlans"):
        assert getattr(ckptlib, name) is getattr(selective, name), name
    assert ckptlib.RecomputeAgain is selective.modes.RecomputeAgain
    with pytest.raises(AttributeError, match="no attribute '_nothing_here'"):
        ckptlib._nothing_here


def _reads_a_value_into_python(t: torch.Tensor) -> torch.Tensor:
    """Reads a sum back to Python and scales by it: the op graph never sees that dependency."""
    h = t @ t
    scale = h.relu().sum().tolist()
    return (t * scale).sin()


def test_a_value_read_into_python_is_named_with_the_fix():
    w = _x()
    with pytest.raises(CheckpointError) as caught:
        selective_checkpoint(_reads_a_value_into_python, w, policy=save_matmuls).sum().backward()
    message = str(caught.value)
    for words in (
        "called aten._to_copy.default 1 times",
        "stand-in of an op the rerun skipped",
        ".tolist()",
        "skip_unneeded=False",
    ):
        assert words in message, message
    assert_nothing_installed()
    # The fix the message names: every op reruns, and the gradient is plain autograd's.
    expected = torch.autograd.grad(_reads_a_value_into_python(w).sum(), w)[0]
    out = selective_checkpoint(
        _reads_a_value_into_python, w, policy=save_matmuls, skip_unneeded=False
    )
    assert torch.equal(torch.autograd.grad(out.sum(), w)[0], expected)


def test_an_extra_op_on_real_tensors_is_named_as_a_branch_not_a_skipped_value():
    from ckptlib import is_recomputing

    def branches(t):
        if is_recomputing():
            t.exp()  # an op the rerun calls and the forward pass did not
        return (t @ t).relu()

    with pytest.raises(CheckpointError) as caught:
        selective_checkpoint(branches, _x(), policy=save_matmuls).sum().backward()
    message = str(caught.value)
    assert "called aten.exp.default 1 times, the forward pass only 0 times" in message, message
    assert "no branches on random numbers" in message and "skip_unneeded" not in message
    assert_nothing_installed()
