"""What a rerun must reproduce, and how it must end: each case against plain autograd and
torch.utils.checkpoint(use_reentrant=False).

Forward-mode AD with backward inside the dual level; torch.autograd.grad inside the checkpointed
function; GraphExecGroup; a rerun that raises; a Parameter argument; the module path in
StateUpdatedTwiceWarning.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.autograd.forward_ad as forward_ad
import torch.nn as nn
from torch.utils.checkpoint import GraphExecGroup
from torch.utils.checkpoint import checkpoint as torch_checkpoint_fn

from ckptlib import CheckpointError, StateUpdatedTwiceWarning, checkpoint
from tests._grads import assert_bitwise_equal


def plain(fn, *args):
    return fn(*args)


def torch_checkpoint(fn, *args):
    return torch_checkpoint_fn(fn, *args, use_reentrant=False)


RUNS = {"plain": plain, "torch": torch_checkpoint, "ckptlib": checkpoint}


def test_forward_mode_ad_with_backward_inside_the_dual_level():
    def layer(a, w):
        return (a @ w).sin()

    def run(wrap):
        torch.manual_seed(0)
        a = torch.randn(2, 3, requires_grad=True)
        w = torch.randn(3, 3, requires_grad=True)
        tangent = torch.randn(2, 3)
        with forward_ad.dual_level():
            out = wrap(layer, forward_ad.make_dual(a, tangent), w)
            primal, out_tangent = forward_ad.unpack_dual(out)
            grads = torch.autograd.grad(primal.square().sum(), (a, w))
        return (*grads, out_tangent)

    expected = run(plain)
    assert_bitwise_equal(run(torch_checkpoint), expected)
    assert_bitwise_equal(run(checkpoint), expected)


def test_autograd_grad_inside_the_function_without_early_stop():
    def fn(x):
        y = x.sin()
        (dy,) = torch.autograd.grad(y.sum(), x, create_graph=True)   # recomputes mid-forward
        return (dy * y).exp()

    base = torch.randn(4)

    def run(wrap):
        x = base.clone().requires_grad_()
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            wrap(fn, x).sum().backward()
        return (x.grad,)

    expected = run(plain)
    assert_bitwise_equal(run(torch_checkpoint), expected)
    assert_bitwise_equal(run(lambda f, x: checkpoint(f, x, early_stop=False)), expected)


def counted(fn):
    runs = []

    def counting(*args):
        runs.append(1)
        return fn(*args)

    return counting, runs


def test_a_graph_exec_group_reruns_once_for_its_backward_calls():
    torch.manual_seed(0)
    x = torch.randn(4, requires_grad=True)
    w = torch.randn(4, requires_grad=True)
    fn = lambda a, b: a.sin().exp() + b.cos().exp()   # noqa: E731  (two separate paths)

    expected = torch.autograd.grad(fn(x, w).sum(), (x, w))
    for wrap in (torch_checkpoint, checkpoint):
        counting, runs = counted(fn)
        out = wrap(counting, x, w).sum()
        with GraphExecGroup():
            got_x = torch.autograd.grad(out, x, retain_graph=True)
            got_w = torch.autograd.grad(out, w, retain_graph=True)
        # two backward calls in one group: one rerun (the forward is the first run)
        assert len(runs) == 2, wrap
        assert_bitwise_equal((*got_x, *got_w), expected)


def test_overlapping_backward_calls_in_a_group_raise_as_in_torch():
    x = torch.randn(4, requires_grad=True)
    fn = lambda a: a.sin().exp()   # noqa: E731
    for wrap, message in ((torch_checkpoint, "GraphExecGroup"), (checkpoint, "GraphExecGroup")):
        out = wrap(fn, x).sum()
        with GraphExecGroup():
            torch.autograd.grad(out, x, retain_graph=True)
            with pytest.raises(CheckpointError if wrap is checkpoint else Exception,
                               match=message):
                torch.autograd.grad(out, x, retain_graph=True)


def test_a_rerun_that_raises_is_freed_without_gc():
    def fails_in_the_rerun(t):
        if torch.is_grad_enabled() and calls:
            raise ValueError("boom")
        calls.append(1)
        return t.sin().exp()

    # (torch's first checkpoint call imports Dynamo; an exception raised under that first call
    # is held by the import machinery for a while: warm it up first.)
    y = torch.randn(2, requires_grad=True)
    torch_checkpoint(torch.sin, y).sum().backward()
    for wrap in (checkpoint, torch_checkpoint):
        calls = []
        gc.collect()
        gc.disable()
        try:
            x = torch.randn(8, requires_grad=True)
            h = x * 2
            alive = weakref.ref(h)
            out = wrap(fails_in_the_rerun, h)
            del h
            with pytest.raises(ValueError, match="boom"):
                out.sum().backward()
            del out
            assert alive() is None, wrap   # the frame (and the input it keeps) freed at once
        finally:
            gc.enable()


def test_a_parameter_argument_stays_a_parameter_in_the_rerun():
    for wrap in (torch_checkpoint, checkpoint):
        seen = []
        p = nn.Parameter(torch.randn(3))

        def fn(t):
            seen.append(type(t))
            return t.sin()

        wrap(fn, p).sum().backward()
        assert seen == [nn.Parameter, nn.Parameter], wrap
        assert torch.equal(p.grad, p.detach().cos())


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.fc(x)).relu()


def test_state_updated_twice_names_the_modules_path():
    import ckptlib

    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(4)])
    ckptlib.apply_checkpointing(model, lambda name, module: name == "3")
    with pytest.warns(StateUpdatedTwiceWarning, match=r"`3\.bn`"):
        model(torch.randn(5, 4, requires_grad=True)).sum().backward()
