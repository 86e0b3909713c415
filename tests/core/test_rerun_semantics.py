"""What a rerun must reproduce, and how it must end: each case against plain autograd and
torch.utils.checkpoint(use_reentrant=False).

Forward-mode AD with backward inside the dual level; torch.autograd.grad inside the checkpointed
function; GraphExecGroup; a rerun that raises; a Parameter argument; state the forward updates
in place (BatchNorm's statistics, spectral_norm's power iteration), which the rerun must run with
as the forward saw it and leave as the forward left it.
"""

from __future__ import annotations

import copy
import gc
import warnings
import weakref

import pytest
import torch
import torch.autograd.forward_ad as forward_ad
import torch.nn as nn
from torch.utils.checkpoint import GraphExecGroup
from torch.utils.checkpoint import checkpoint as torch_checkpoint_fn

from ckptlib import CheckpointError, checkpoint
from tests._grads import assert_bitwise_equal, bitwise_equal


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


# ---------------------------------------------------------------------------
# State the forward updates in place: the rerun runs with the state the forward saw, and the
# buffers end as plain autograd leaves them, bitwise. torch.utils.checkpoint(use_reentrant=False)
# does neither: its rerun updates the state again and computes from the updated state.
# ---------------------------------------------------------------------------

def spectral_linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.utils.parametrizations.spectral_norm(nn.Linear(4, 4))


def old_spectral_linear() -> nn.Module:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # torch suggests the parametrization instead
        return nn.utils.spectral_norm(nn.Linear(4, 4))


def batch_norm_1d(**kwargs) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, **kwargs), nn.Tanh())


class BatchNorm2dBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.bn = nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3)

    def forward(self, x):
        return self.bn(self.conv(x)).relu()


STATEFUL = {
    "spectral_norm": (spectral_linear, (6, 4)),
    "old spectral_norm": (old_spectral_linear, (6, 4)),
    "BatchNorm1d": (batch_norm_1d, (8, 4)),
    "BatchNorm1d momentum=None": (lambda: batch_norm_1d(momentum=None), (8, 4)),
    "BatchNorm2d": (BatchNorm2dBlock, (4, 2, 5, 5)),
}


def steps(make, shape, wrap, count=2, train=True):
    """``count`` training steps of a fresh model under ``wrap``: the gradients of the input and
    the parameters of each step, then the buffers."""
    model = make().train(train)
    torch.manual_seed(1)
    inputs = [torch.randn(shape) for _ in range(count)]
    results = []
    for x in inputs:
        x.requires_grad_()
        model.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("error")   # no warning either
            wrap(model, x).square().sum().backward()
        results += [x.grad, *(p.grad for p in model.parameters())]
    return results, [b.clone() for b in model.buffers()]


@pytest.mark.parametrize("case", STATEFUL)
def test_state_updated_in_place_gives_plain_gradients_and_buffers_bitwise(case):
    """Gradients and buffers (``running_mean``, ``running_var``, ``num_batches_tracked``, ``u``,
    ``v``) bitwise equal to plain autograd's after two steps. torch's checkpoint differs: its
    buffers move twice per step, and under spectral_norm its gradients differ too."""
    make, shape = STATEFUL[case]
    expected, expected_buffers = steps(make, shape, plain)
    got, got_buffers = steps(make, shape, checkpoint)
    assert_bitwise_equal(got, expected)
    assert_bitwise_equal(got_buffers, expected_buffers)
    torch_got, torch_buffers = steps(make, shape, torch_checkpoint)
    assert not bitwise_equal(torch_buffers, expected_buffers)
    if "spectral_norm" in case:
        assert not bitwise_equal(torch_got, expected)


@pytest.mark.parametrize("case", STATEFUL)
def test_eval_mode_state_is_untouched(case):
    """In eval mode nothing is updated: the buffers stay as they were made, with every wrap."""
    make, shape = STATEFUL[case]
    untouched = [b.clone() for b in make().buffers()]
    expected, _ = steps(make, shape, plain, train=False)
    for wrap in (checkpoint, torch_checkpoint):
        got, buffers = steps(make, shape, wrap, train=False)
        assert_bitwise_equal(got, expected)
        assert_bitwise_equal(buffers, untouched)


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Conv2d(c, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
              for c in (2, 4, 4)]
    return nn.Sequential(nn.Sequential(*blocks), nn.Flatten(), nn.Linear(4 * 5 * 5, 3))


def test_apply_checkpointing_on_a_cnn_with_batch_norm_is_plain_autograd_bitwise():
    import ckptlib

    def checkpointed():
        model = small_cnn()
        ckptlib.apply_checkpointing(model)
        return model

    expected, expected_buffers = steps(small_cnn, (2, 2, 5, 5), plain, count=3)
    got, got_buffers = steps(checkpointed, (2, 2, 5, 5), plain, count=3)
    assert_bitwise_equal(got, expected)
    assert_bitwise_equal(got_buffers, expected_buffers)


def two_backwards(wrap):
    """One forward, two backward passes (``retain_graph=True``), then the buffers."""
    model = nn.Sequential(spectral_linear(), nn.BatchNorm1d(4))
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(2), requires_grad=True)
    loss = wrap(model, x).square().sum()
    loss.backward(retain_graph=True)
    loss.backward()
    return [x.grad, *(p.grad for p in model.parameters())], list(model.buffers())


def test_retain_graph_two_backwards_rerun_from_the_forwards_state_each_time():
    expected, expected_buffers = two_backwards(plain)
    got, got_buffers = two_backwards(checkpoint)
    assert_bitwise_equal(got, expected)
    assert_bitwise_equal(got_buffers, expected_buffers)
    assert not bitwise_equal(two_backwards(torch_checkpoint)[0], expected)


def test_nested_checkpoints_restore_the_state_at_every_level():
    """An outer checkpoint whose function checkpoints a spectral-norm layer and a batch norm: the
    outer rerun runs the inner checkpoints' forwards again, and each inner rerun must still run
    from the state its forward saw."""
    def run(inner, outer):
        model = nn.Sequential(spectral_linear(), nn.BatchNorm1d(4), spectral_linear())

        def body(t):
            t = inner(model[0], t)
            return inner(model[2], inner(model[1], t).tanh())

        results = []
        for seed in (3, 4):
            x = torch.randn(6, 4, generator=torch.Generator().manual_seed(seed),
                            requires_grad=True)
            model.zero_grad()
            outer(body, x).square().sum().backward()
            results += [x.grad, *(p.grad for p in model.parameters())]
        return results, list(model.buffers())

    expected, expected_buffers = run(plain, plain)
    for inner, outer in ((checkpoint, checkpoint), (plain, checkpoint), (checkpoint, plain)):
        got, got_buffers = run(inner, outer)
        assert_bitwise_equal(got, expected)
        assert_bitwise_equal(got_buffers, expected_buffers)


def test_a_rerun_that_raises_leaves_the_state_as_the_forward_left_it():
    model = nn.Sequential(spectral_linear(), nn.BatchNorm1d(4))
    calls = []

    def fails_in_the_rerun(t):
        out = model(t)
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("boom")
        return out.exp()

    out = checkpoint(fails_in_the_rerun, torch.randn(6, 4, requires_grad=True))
    after_forward = [b.clone() for b in model.buffers()]
    versions = [b._version for b in model.buffers()]
    with pytest.raises(ValueError, match="boom"):
        out.sum().backward()
    assert_bitwise_equal(list(model.buffers()), after_forward)
    # the rerun's own updates moved versions, the restores none: the next step runs as usual
    assert [b._version for b in model.buffers()] != versions
    checkpoint(model, torch.randn(6, 4, requires_grad=True)).sum().backward()


def test_an_optimizer_step_between_forward_and_backward_is_still_refused():
    model = nn.Sequential(spectral_linear(), nn.BatchNorm1d(4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = checkpoint(model, torch.randn(6, 4, requires_grad=True))
    model(torch.randn(6, 4)).sum().backward()   # another step's gradients
    optimizer.step()
    with pytest.raises(CheckpointError, match="modified in place"):
        out.sum().backward()


def test_a_module_reached_but_not_run_on_its_first_call_is_learned_when_it_runs():
    """The first call's function reaches the whole model and runs only its first layer: the
    batch norm it did not run is asked again on a later call, which then restores it."""
    def run(wrap):
        model = nn.Sequential(spectral_linear(), batch_norm_1d())
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(5), requires_grad=True)
        wrap(lambda t: model[0](t), x).sum().backward()
        for _ in range(2):
            wrap(model[1], x).square().sum().backward()
        return [x.grad, *(p.grad for p in model.parameters())], list(model.buffers())

    expected, expected_buffers = run(plain)
    got, got_buffers = run(checkpoint)
    assert_bitwise_equal(got, expected)
    assert_bitwise_equal(got_buffers, expected_buffers)


class Rotary(nn.Module):
    """A buffer the forward reads and never updates, as a rotary embedding's ``inv_freq``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("inv_freq", torch.linspace(1.0, 0.1, 4))

    def forward(self, x):
        return self.fc(x * self.inv_freq).sin()


def copies_before_the_forward(module: nn.Module) -> int:
    """How many buffers a checkpoint of ``module`` copies before its forward now."""
    from ckptlib.core.checks import Checks

    checks = Checks(module, [])
    return len(checks.state) + sum(len(buffers) for _, buffers in checks.probed.values())


def test_a_module_that_updates_no_state_is_copied_on_its_first_call_only():
    """A buffer the forward never updates is copied on the module's first call only (to learn
    that): no extra bytes in the steps after. A causal mask (a boolean buffer) is never copied;
    BatchNorm's three buffers are copied on every call."""
    from ckptlib.models import TinyTransformer

    rotary, block = Rotary(), TinyTransformer(depth=1, d_model=8, heads=2, seq=4).blocks[0]
    copied = []
    for _ in range(2):
        copied.append((copies_before_the_forward(rotary), copies_before_the_forward(block)))
        checkpoint(rotary, torch.randn(2, 4, requires_grad=True)).sum().backward()
        checkpoint(block, torch.randn(2, 4, 8, requires_grad=True)).sum().backward()
    assert copied == [(1, 0), (0, 0)]
    bn = batch_norm_1d()
    for _ in range(2):
        checkpoint(bn, torch.randn(6, 4, requires_grad=True)).sum().backward()
        assert copies_before_the_forward(bn) == 3


class Counted(nn.Module):
    """Counts its calls in a buffer and scales by the count: state its forward updates and then
    computes with."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.fc(x) * self.calls


def test_state_the_rerun_cannot_restore_is_refused_naming_the_modules_path():
    """In eval mode ckptlib copies no buffers: a module that still updates one, and computes with
    it, would get other gradients from the rerun. Refused, naming the module by its path under
    apply_checkpointing; the buffer is left as the forward left it. In training mode the same
    model is restored and gives plain gradients."""
    import ckptlib

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), Counted()) for _ in range(4)]).eval()
    ckptlib.apply_checkpointing(model, lambda name, module: name == "3")
    out = model(torch.randn(5, 4, requires_grad=True)).sum()
    with pytest.raises(CheckpointError, match=r"`3\.1` \(buffer calls\).*gradients can differ"):
        out.backward()
    assert model[3][1].calls.item() == 1
    assert ckptlib.StateUpdatedTwiceWarning.__mro__[1] is UserWarning   # importable, not emitted

    def train_step(wrap):
        torch.manual_seed(0)
        counted = Counted()
        x = torch.randn(5, 4, requires_grad=True)
        wrap(counted, x).sum().backward()
        return [x.grad, *(p.grad for p in counted.parameters())], list(counted.buffers())

    assert_bitwise_equal(train_step(checkpoint)[0], train_step(plain)[0])
    assert_bitwise_equal(train_step(checkpoint)[1], train_step(plain)[1])


def test_a_parameter_the_forward_renormalises_in_place_runs_bitwise():
    """``Embedding(max_norm)`` renormalises rows of its weight in place in forward; ckptlib does not
    copy parameters, but the rerun leaves them as the forward did: plain gradients and weights,
    over steps whose updates push rows past ``max_norm`` again."""
    def run(wrap):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(10, 4, max_norm=1.0), nn.Linear(4, 4))
        tokens = torch.tensor([[1, 2, 3], [3, 4, 1]])
        for _ in range(3):
            model.zero_grad()
            wrap(model, tokens).square().sum().backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.5 * p.grad
        return [p.detach().clone() for p in model.parameters()]

    expected = run(plain)
    assert_bitwise_equal(run(checkpoint), expected)
    assert_bitwise_equal(run(torch_checkpoint), expected)


def test_a_forward_that_raises_on_a_modules_first_call_leaves_no_hook_behind():
    """The global forward pre-hook that tells which modules ran is removed with the forward."""
    from torch.nn.modules import module as module_hooks

    class Fails(nn.Module):
        def forward(self, x):
            raise ValueError("boom")

    model = nn.Sequential(nn.BatchNorm1d(4), Fails())
    before = len(module_hooks._global_forward_pre_hooks)
    with pytest.raises(ValueError, match="boom"):
        checkpoint(model, torch.randn(6, 4, requires_grad=True))
    assert len(module_hooks._global_forward_pre_hooks) == before
    assert model[0].num_batches_tracked.item() == 1   # the forward's own update, as plain's


class CountsWhenAsked(nn.Module):
    """Updates (and computes with) a buffer only once ``counting`` is set: on its first
    checkpointed call, before that, ckptlib learns that it updates nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))
        self.counting = False

    def forward(self, x):
        if self.counting:
            self.calls.add_(1)
        return self.fc(x) * (1 + self.calls)


def test_a_buffer_a_module_starts_updating_later_is_refused_once_then_restored():
    torch.manual_seed(0)
    module = CountsWhenAsked()
    x = torch.randn(5, 4, requires_grad=True)
    checkpoint(module, x).sum().backward()            # learned: updates nothing
    module.counting = True
    out = checkpoint(module, x).sum()
    with pytest.raises(CheckpointError, match=r"buffer calls.*from the next call on"):
        out.backward()
    assert module.calls.item() == 1                   # as the forward left it
    expected_module = copy.deepcopy(module)
    module.zero_grad()
    expected_module.zero_grad()
    expected_module(x).sum().backward()
    checkpoint(module, x).sum().backward()            # copied now: plain's, bitwise
    assert_bitwise_equal([module.calls, *(p.grad for p in module.parameters())],
                         [expected_module.calls, *(p.grad for p in expected_module.parameters())])


@pytest.mark.parametrize("case", STATEFUL)
def test_selective_checkpointing_restores_the_state_too(case):
    """The selective rerun runs through the same checks: gradients and buffers plain's."""
    from ckptlib import save_matmuls, selective_checkpoint

    make, shape = STATEFUL[case]
    expected, expected_buffers = steps(make, shape, plain)
    got, got_buffers = steps(
        make, shape, lambda model, x: selective_checkpoint(model, x, policy=save_matmuls))
    assert_bitwise_equal(got, expected)
    assert_bitwise_equal(got_buffers, expected_buffers)
