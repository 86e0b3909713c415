"""Misuse of ckptlib.memory: each bad argument is a TypeError or ValueError at the call, naming it.

Before these checks: ``measure(None)`` failed inside the meter with "'NoneType' object is not
callable", ``MemoryMeter(on_op="print")`` was accepted and failed on the first op of the block,
``timeline="no"`` counted as true, ``device="cuda"`` on a machine without CUDA failed in
``torch.cuda`` on entry (and a tensor meter on such a device counted nothing), and
``format_bytes(float("nan"))`` crashed converting NaN to int.
"""
from __future__ import annotations

import pytest
import torch

from ckptlib.memory import MemoryMeter, format_bytes, measure
from tests._misuse import Misuse, assert_refused, rows

x = torch.randn(16)


def step():
    return x.exp().sum()


# A CUDA device this machine lacks: any on a CPU-only machine, one past the last otherwise.
MISSING_CUDA = f"cuda:{torch.cuda.device_count()}"

TABLE = [
    Misuse(
        "measure(None)", lambda: measure(None), TypeError, ("measure: fn", "function", "got None")
    ),
    Misuse(
        "measure(result, not function)",
        lambda: measure(step()),
        TypeError,
        ("fn must be a function", "not its result", "got a Tensor"),
    ),
    Misuse(
        "measure(fn with an argument)",
        lambda: measure(lambda batch: batch),
        TypeError,
        ("measure: fn", "cannot be called with 0 arguments"),
    ),
    Misuse(
        "measure(timeline='no')",
        lambda: measure(step, timeline="no"),
        TypeError,
        ("timeline must be True or False", "'no'"),
    ),
    Misuse(
        "measure(device='gpu')",
        lambda: measure(step, device="gpu"),
        ValueError,
        ("device='gpu' is not a device", "'cpu'", "None (count every device)"),
    ),
    Misuse(
        "measure(device=3.5)",
        lambda: measure(step, device=3.5),
        TypeError,
        ("device must be a torch.device", "got 3.5 (float)"),
    ),
    Misuse(
        "measure(device=missing CUDA device)",
        lambda: measure(step, device=MISSING_CUDA),
        ValueError,
        (f"device='{MISSING_CUDA}'", "CUDA"),
    ),
    Misuse(
        "MemoryMeter(on_op='print')",
        lambda: MemoryMeter(on_op="print"),
        TypeError,
        ("MemoryMeter: on_op must be a function", "TimelineEntry", "'print'"),
    ),
    Misuse(
        "MemoryMeter(on_op without an argument)",
        lambda: MemoryMeter(on_op=lambda: None),
        TypeError,
        ("on_op", "cannot be called with 1 argument"),
    ),
    Misuse(
        "MemoryMeter(on_op, timeline=False)",
        lambda: MemoryMeter(timeline=False, on_op=lambda entry: None),
        ValueError,
        ("on_op", "timeline=False", "timeline=True"),
    ),
    Misuse(
        "MemoryMeter(timeline=None)",
        lambda: MemoryMeter(timeline=None),
        TypeError,
        ("MemoryMeter: timeline must be True or False", "got None"),
    ),
    Misuse(
        "MemoryMeter(device=tensor)",
        lambda: MemoryMeter(device=x),
        TypeError,
        ("device must be", "got a Tensor of shape (16,)"),
    ),
    Misuse(
        "MemoryMeter(device=True)",
        lambda: MemoryMeter(device=True),
        TypeError,
        ("device must be", "got True (bool)"),
    ),
    Misuse(
        "MemoryMeter(device=-1)",
        lambda: MemoryMeter(device=-1),
        ValueError,
        ("device=-1 is not a device", "negative"),
    ),
    Misuse(
        "format_bytes('1')",
        lambda: format_bytes("1"),
        TypeError,
        ("format_bytes: nbytes must be a number of bytes", "'1' (str)"),
    ),
    Misuse("format_bytes(None)", lambda: format_bytes(None), TypeError, ("nbytes", "got None")),
    Misuse("format_bytes(True)", lambda: format_bytes(True), TypeError, ("nbytes", "True (bool)")),
]


@pytest.mark.parametrize("row", rows(TABLE))
def test_misuse_is_refused_at_the_call(row):
    assert_refused(row)


def test_a_bad_callback_is_refused_before_any_op_runs():
    """Before: the meter was built, the block entered, and the first op raised "'str' object is
    not callable" from inside the dispatch mode."""
    ops = []
    with pytest.raises(TypeError, match="on_op must be a function"):
        with MemoryMeter(on_op="print"):
            ops.append(x.exp())
    assert ops == [] and torch._C._len_torch_dispatch_stack() == 0


def test_non_finite_byte_counts_are_printed_not_crashed_on():
    assert [
        format_bytes(float("nan")),
        format_bytes(float("inf")),
        format_bytes(-float("inf")),
    ] == ["nan B", "inf B", "-inf B"]
