"""Misuse of ckptlib.inspect: each bad argument is a TypeError or ValueError at the call, naming it.

Before these checks: ``saved_tensors_report(None)`` (or ``3``, ``"loss"``, ``[]``) returned an
empty report, as if nothing had been saved; a module passed itself was called with no input;
``model="m"`` failed with "'str' object has no attribute 'buffers'", and a model next to a
function was ignored; ``SavedTensorsReport([1])`` was built and failed on first use;
``by_module(depth=0)`` lumped every module under "".
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from ckptlib.inspect import SavedTensorsReport, record_saved, saved_tensors_report
from ckptlib.models import MLPChain
from tests._misuse import Misuse, assert_refused, module_state, rows, assert_same_module_state

x = torch.randn(4, 8, requires_grad=True)
REPORT = saved_tensors_report(lambda: x.exp().sin())
MODEL = MLPChain(depth=2, width=8)


def record_with(model):
    with record_saved(model):
        x.exp()


TABLE = [
    Misuse(
        "saved_tensors_report(None)",
        lambda: saved_tensors_report(None),
        TypeError,
        ("saved_tensors_report: outputs_or_fn must be a function", "output tensor(s)", "got None"),
    ),
    Misuse(
        "saved_tensors_report(3)",
        lambda: saved_tensors_report(3),
        TypeError,
        ("outputs_or_fn", "got 3 (int)", "holds no tensor"),
    ),
    Misuse(
        "saved_tensors_report('loss')",
        lambda: saved_tensors_report("loss"),
        TypeError,
        ("outputs_or_fn", "'loss' (str)"),
    ),
    Misuse(
        "saved_tensors_report([])",
        lambda: saved_tensors_report([]),
        ValueError,
        ("outputs_or_fn", "got [] (list), which holds no tensor"),
    ),
    Misuse(
        "saved_tensors_report({'loss': 0.5})",
        lambda: saved_tensors_report({"loss": 0.5}),
        ValueError,
        ("outputs_or_fn", "holds no tensor"),
    ),
    Misuse(
        "saved_tensors_report(module)",
        lambda: saved_tensors_report(MODEL),
        TypeError,
        ("the module MLPChain itself", "lambda: model(x)"),
    ),
    Misuse(
        "saved_tensors_report(fn with an argument)",
        lambda: saved_tensors_report(lambda t: t.exp()),
        TypeError,
        ("outputs_or_fn", "cannot be called with 0 arguments"),
    ),
    Misuse(
        "saved_tensors_report(outputs, model='m')",
        lambda: saved_tensors_report(x.exp(), model="m"),
        TypeError,
        ("saved_tensors_report: model must be an nn.Module", "'m' (str)"),
    ),
    Misuse(
        "saved_tensors_report(fn, model=3)",
        lambda: saved_tensors_report(lambda: x.exp(), model=3),
        TypeError,
        ("model must be an nn.Module", "got 3 (int)"),
    ),
    Misuse(
        "record_saved(model='m')",
        lambda: record_with("m"),
        TypeError,
        ("record_saved: model must be an nn.Module", "'m'"),
    ),
    Misuse(
        "SavedTensorsReport(None)",
        lambda: SavedTensorsReport(None),
        TypeError,
        ("SavedTensorsReport: rows must be", "SavedTensor", "got None"),
    ),
    Misuse(
        "SavedTensorsReport([1])",
        lambda: SavedTensorsReport([1]),
        TypeError,
        ("rows[0] is 1 (int)", "SavedTensor"),
    ),
    Misuse(
        "by_module(depth='2')",
        lambda: REPORT.by_module(depth="2"),
        TypeError,
        ("by_module: depth must be an integer >= 1", "'2' (str)"),
    ),
    Misuse(
        "by_module(depth=0)",
        lambda: REPORT.by_module(depth=0),
        ValueError,
        ("depth must be an integer >= 1", "got 0"),
    ),
    Misuse(
        "by_module(depth=True)",
        lambda: REPORT.by_module(depth=True),
        TypeError,
        ("depth must be an integer", "True (bool)"),
    ),
]


@pytest.mark.parametrize("row", rows(TABLE))
def test_misuse_is_refused_at_the_call(row):
    before = module_state(MODEL)
    assert_refused(row)
    assert_same_module_state(before, module_state(MODEL))


def test_a_model_next_to_a_function_marks_its_buffers():
    """Before: ``model`` was silently ignored for a function, so a buffer used outside its own
    module's forward (here by the parent, before the child ever ran) was counted as an
    activation."""

    class Parent(nn.Module):
        def __init__(self):
            super().__init__()
            self.child = nn.Linear(4, 4)
            self.child.register_buffer("scale", torch.full((2, 4), 2.0))

        def forward(self, t):
            return self.child(t * self.child.scale)  # mul saves the buffer

    parent = Parent()
    t = torch.randn(2, 4, requires_grad=True)
    report = saved_tensors_report(lambda: parent(t), model=parent)
    assert [row.kind for row in report.rows if row.op == "mul" and row.attribute == "other"] == [
        "buffer"
    ]
