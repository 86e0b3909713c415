"""Bad arguments to the public functions of checkpoint, trace, rng, offload and sequential.

Each is a TypeError or ValueError that names the argument and what it accepts, raised at the
call before anything runs, and leaves nothing behind: no saved-tensor hook, no trace, no
function mode, no registered generator use, and the RNG where it was.
"""
from __future__ import annotations

import contextlib
import re

import numpy as np
import pytest
import torch
import torch.nn as nn

from ckptlib import rng
from ckptlib.core.errors import TensorMeta
from ckptlib import checkpoint, record_trace
from ckptlib.offload import offload_saved_tensors
from ckptlib.sequential import checkpoint_sequential, measure_layer_costs
from tests._misuse import Misuse, assert_nothing_installed, assert_refused, rows

calls: list[int] = []


def region(t: torch.Tensor) -> torch.Tensor:
    calls.append(1)
    return t.sin()


def x() -> torch.Tensor:
    return torch.linspace(-1, 1, 8).reshape(2, 4).requires_grad_()   # made without the RNG


def count_a_kind_that_does_not_exist():
    with record_trace() as trace:
        checkpoint(region, x())
    trace.count("packs")


def enter_replay_of(state):
    with rng.replay(state):
        pass


def enter_forward_registration_of(state):
    with rng.ForwardRegistration(state):
        pass


NULL = contextlib.nullcontext

TABLE = [
    # checkpoint
    Misuse(
        "fn",
        lambda: checkpoint(torch.ones(3), x()),
        TypeError,
        ("checkpoint: fn must be callable, got Tensor",),
    ),
    Misuse(
        "preserve_rng_state",
        lambda: checkpoint(region, x(), preserve_rng_state="no"),
        TypeError,
        ("checkpoint: preserve_rng_state must be True or False, got 'no' (str)",),
    ),
    Misuse(
        "early_stop",
        lambda: checkpoint(region, x(), early_stop=None),
        TypeError,
        ("checkpoint: early_stop must be True or False, got None (NoneType)",),
    ),
    Misuse(
        "debug",
        lambda: checkpoint(region, x(), debug="loud"),
        TypeError,
        ("checkpoint: debug must be True or False, got 'loud' (str)",),
    ),
    Misuse(
        "use_reentrant=True",
        lambda: checkpoint(region, x(), use_reentrant=True),
        ValueError,
        ("always non-reentrant; drop use_reentrant=True",),
    ),
    Misuse(
        "use_reentrant type",
        lambda: checkpoint(region, x(), use_reentrant="no"),
        TypeError,
        ("checkpoint: use_reentrant must be None or False, got 'no' (str)",),
    ),
    Misuse(
        "determinism_check value",
        lambda: checkpoint(region, x(), determinism_check="strict"),
        ValueError,
        (
            re.compile(
                "checkpoint: determinism_check must be 'default' .* or 'none' .*got 'strict' "
                "\\(str\\)"
            ),
        ),
    ),
    Misuse(
        "determinism_check type",
        lambda: checkpoint(region, x(), determinism_check=False),
        TypeError,
        (
            re.compile(
                "checkpoint: determinism_check must be 'default' .* or 'none' .*got False "
                "\\(bool\\)"
            ),
        ),
    ),
    Misuse(
        "context_fn not callable",
        lambda: checkpoint(region, x(), context_fn=NULL()),
        TypeError,
        (
            re.compile(
                "checkpoint: context_fn must be None or a function returning two context managers "
                ".*got nullcontext"
            ),
        ),
    ),
    Misuse(
        "context_fn returns one",
        lambda: checkpoint(region, x(), context_fn=NULL),
        TypeError,
        (
            re.compile(
                "checkpoint: context_fn must return two context managers .*it returned "
                "<contextlib.nullcontext"
            ),
        ),
    ),
    Misuse(
        "context_fn returns three",
        lambda: checkpoint(region, x(), context_fn=lambda: (NULL(), NULL(), NULL())),
        TypeError,
        ("context_fn must return two context managers",),
    ),
    Misuse(
        "context_fn returns a non-context",
        lambda: checkpoint(region, x(), context_fn=lambda: (NULL(), 3)),
        TypeError,
        (
            re.compile(
                "context_fn must return two context managers .*it returned "
                "\\(<contextlib.nullcontext"
            ),
        ),
    ),
    # trace
    Misuse(
        "trace.count kind",
        count_a_kind_that_does_not_exist,
        ValueError,
        (
            "CheckpointTrace.count: kind must be one of pack, forward_done, recompute, early_stop, "
            "unpack, release; got 'packs'",
        ),
    ),
    Misuse(
        "TensorMeta.of",
        lambda: TensorMeta.of(None),
        TypeError,
        ("TensorMeta.of needs a tensor, got NoneType",),
    ),
    Misuse(
        "record_trace on_event str",
        lambda: record_trace(on_event="print"),
        TypeError,
        (
            "record_trace: on_event must be a function of one TraceEvent, or None, got 'print' "
            "(str)",
        ),
    ),
    Misuse(
        "record_trace on_event arity",
        lambda: record_trace(on_event=lambda: None),
        TypeError,
        (
            "record_trace: on_event must be a function of one TraceEvent, or None, but it cannot "
            "be called with 1 argument",
        ),
    ),
    # rng
    Misuse(
        "capture None",
        lambda: rng.capture(None),
        TypeError,
        (re.compile("capture: tensors must be a list .* of tensors"),),
    ),
    Misuse(
        "capture a tensor",
        lambda: rng.capture(torch.ones(2)),
        TypeError,
        ("capture: tensors must be a list",),
    ),
    Misuse(
        "capture non-tensors",
        lambda: rng.capture([1, 2]),
        TypeError,
        ("capture: tensors must be a list",),
    ),
    Misuse(
        "replay",
        lambda: enter_replay_of("state"),
        TypeError,
        ("replay: state must be an RNGState from rng.capture(...), got str",),
    ),
    Misuse(
        "ForwardRegistration",
        lambda: enter_forward_registration_of(None),
        TypeError,
        ("ForwardRegistration: state must be an RNGState from rng.capture(...), got NoneType",),
    ),
    # offload
    Misuse(
        "pin_memory",
        lambda: offload_saved_tensors(pin_memory="yes"),
        TypeError,
        ("offload_saved_tensors: pin_memory must be True or False, got 'yes' (str)",),
    ),
    # sequential
    Misuse(
        "empty modules",
        lambda: checkpoint_sequential(nn.Sequential(), 1, x()),
        ValueError,
        ("checkpoint_sequential: modules is empty; pass at least one module",),
    ),
    Misuse(
        "segments",
        lambda: checkpoint_sequential(nn.Sequential(nn.Tanh()), "1", x()),
        ValueError,
        ("segments must be an int (the number of segments) or a ckptlib.schedules.Plan, got '1'",),
    ),
    Misuse(
        "segments numpy bool",
        lambda: checkpoint_sequential(nn.Sequential(nn.Tanh()), np.bool_(True), x()),
        ValueError,
        (
            "segments must be an int (the number of segments) or a ckptlib.schedules.Plan, got "
            "np.True_",
        ),
    ),
    Misuse(
        "segments numpy float",
        lambda: checkpoint_sequential(nn.Sequential(nn.Tanh()), np.float64(1.0), x()),
        ValueError,
        (re.compile("segments must be an int .* got np.float64\\(1.0\\) \\(float64\\)"),),
    ),
    Misuse(
        "segments numpy out of range",
        lambda: checkpoint_sequential(nn.Sequential(nn.Tanh()), np.int64(2), x()),
        ValueError,
        ("checkpoint_sequential: segments=2 must be between 1 and the number of modules (1)",),
    ),
    Misuse(
        "sequential preserve_rng_state",
        lambda: checkpoint_sequential([region], 1, x(), preserve_rng_state="no"),
        TypeError,
        ("checkpoint_sequential: preserve_rng_state must be True or False, got 'no'",),
    ),
    Misuse(
        "sequential use_reentrant",
        lambda: checkpoint_sequential([region], 1, x(), use_reentrant=1),
        TypeError,
        ("checkpoint_sequential: use_reentrant must be None or False, got 1 (int)",),
    ),
    Misuse(
        "repeat type",
        lambda: measure_layer_costs([region], x(), repeat="3"),
        TypeError,
        ("measure_layer_costs: repeat must be an integer >= 1, got '3' (str)",),
    ),
    Misuse(
        "repeat value",
        lambda: measure_layer_costs([region], x(), repeat=0),
        ValueError,
        ("measure_layer_costs: repeat must be an integer >= 1, got 0",),
    ),
    Misuse(
        "measure empty",
        lambda: measure_layer_costs([], x()),
        ValueError,
        ("measure_layer_costs: modules is empty",),
    ),
]


@pytest.mark.parametrize("row", rows(TABLE))
def test_misuse_is_refused_at_the_call(row):
    calls.clear()
    rng_before = torch.get_rng_state()
    assert_refused(row)
    assert calls == [] or row.id == "trace.count kind", "the function ran before the error"
    assert torch.equal(torch.get_rng_state(), rng_before), "the RNG moved"


def test_checkpoint_refuses_bad_arguments_under_no_grad_too():
    with torch.no_grad(), pytest.raises(TypeError, match="early_stop must be True or False"):
        checkpoint(region, x(), early_stop="yes")
    assert_nothing_installed()


def test_a_context_fn_that_raises_leaves_nothing():
    def broken_context_fn():
        raise RuntimeError("no contexts today")

    with pytest.raises(RuntimeError, match="no contexts today"):
        checkpoint(region, x(), context_fn=broken_context_fn)
    assert_nothing_installed()
