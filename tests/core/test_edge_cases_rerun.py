"""Programs where a rerun could silently differ from the forward: each ends bitwise equal to plain
autograd, or in an error that names the cause and the fix.

Every case runs three ways: plain autograd (the reference), ``torch.utils.checkpoint(use_reentrant=
False)`` and ``ckptlib.checkpoint``. Where torch 2.13 is silently wrong or fails with an unrelated
message and ckptlib is right, the test says so with ``torch_is_wrong`` / ``torch_fails``: those
checks run only on torch 2.13, the version the course pins (another torch may have fixed them).
"""
from __future__ import annotations

import dataclasses
import functools
import random
import warnings

import numpy as np
import pytest
import torch
import torch.autograd.forward_ad as forward_ad
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint

from ckptlib import checkpoint, record_trace
from ckptlib import CheckpointError, NotReplayedRandomWarning
from ckptlib.selective import selective_checkpoint
from tests._grads import bitwise_equal
from tests._misuse import assert_nothing_installed

TORCH_2_13 = torch.__version__.startswith("2.13")


def plain(fn, *args, **kwargs):
    return fn(*args, **kwargs)


def torch_ckpt(fn, *args, **kwargs):
    return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)


def outcome(run, ckpt):
    """``run(ckpt)`` returns gradients: ("ok", gradients), or ("error", the exception)."""
    try:
        return "ok", run(ckpt)
    except Exception as error:   # noqa: BLE001 - the test compares what each way does
        return "error", error


def torch_is_wrong(run, expected) -> None:
    """torch.utils.checkpoint returns other gradients than plain autograd, without an error."""
    if TORCH_2_13:
        kind, grads = outcome(run, torch_ckpt)
        assert kind == "ok" and not bitwise_equal(grads, expected), (
            "torch.utils.checkpoint is right here now"
        )


def torch_fails(run, words: str) -> None:
    """torch.utils.checkpoint raises, with a message that does not name the cause ckptlib names."""
    if TORCH_2_13:
        kind, error = outcome(run, torch_ckpt)
        assert kind == "error" and words in str(error), (
            f"torch.utils.checkpoint did {kind}: {error}"
        )


def seeded(n: int, *shape: int, requires_grad: bool = True) -> torch.Tensor:
    """A tensor made without the global RNG (the cases that draw must not see it moved)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(n)).requires_grad_(
        requires_grad
    )


# ---------------------------------------------------------------------------
# An in-place op inside the region on a tensor autograd saved
# ---------------------------------------------------------------------------


class DoubleInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def exp_then_mul_(a):
    h = a.exp()       # ExpBackward0 saves h
    h.mul_(3)         # ...which is then changed in place
    return h.sin()


def exp_then_dirty(a):
    h = a.exp()
    DoubleInPlace.apply(h)
    return h.sin()


@pytest.mark.parametrize("fn", [exp_then_mul_, exp_then_dirty], ids=["mul_", "mark_dirty"])
def test_in_place_change_of_a_saved_tensor_inside_fn_raises_as_plain_autograd(fn):
    def run(ckpt):
        a = seeded(0, 4)
        ckpt(fn, a).sum().backward()
        return (a.grad,)

    kind, error = outcome(run, plain)
    assert kind == "error" and "modified by an inplace operation" in str(error)
    with pytest.raises(
        CheckpointError,
        match=r"saved tensor #0 .* made by ExpBackward0 was modified by an "
        r"in-place operation inside the checkpointed function .*h = h \* 3 instead of h.mul_\(3\)",
    ):
        run(checkpoint)
    assert_nothing_installed()
    if (
        TORCH_2_13
    ):  # torch.utils.checkpoint returns a gradient where plain autograd refuses: silently wrong
        assert outcome(run, torch_ckpt)[0] == "ok"


def test_in_place_change_of_a_tensor_nobody_saved_is_fine():
    def fn(a):
        h = a * 2          # multiplying by a number saves nothing
        h.add_(1)
        return h.sin()

    def run(ckpt):
        a = seeded(0, 4)
        ckpt(fn, a).sum().backward()
        return (a.grad,)

    assert bitwise_equal(run(checkpoint), run(plain))


# ---------------------------------------------------------------------------
# rrelu fills its saved noise after saving it: early stop must not cut it short
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [
    lambda a: F.rrelu(a * 2, training=True),
    lambda a: nn.RReLU()(a.exp()).sin(),
], ids=["F.rrelu last", "nn.RReLU then sin"])
def test_rrelu_in_train_mode_under_early_stop_is_bitwise(fn):
    def run(ckpt):
        a = seeded(1, 64)
        torch.manual_seed(0)
        ckpt(fn, a).sum().backward()
        return (a.grad,)

    expected = run(plain)
    assert bitwise_equal(run(checkpoint), expected)
    assert bitwise_equal(run(functools.partial(checkpoint, early_stop=False)), expected)


def test_rrelu_last_op_torch_is_wrong():
    def run(ckpt):
        a = seeded(1, 64)
        torch.manual_seed(0)
        ckpt(lambda t: F.rrelu(t * 2, training=True), a).sum().backward()
        return (a.grad,)

    expected = run(plain)
    assert bitwise_equal(run(checkpoint), expected)
    torch_is_wrong(run, expected)     # early stop hands back rrelu's unfilled noise buffer


def test_rrelu_noise_last_needed_stops_at_the_next_save_once_filled():
    # The caller drops exp's output, so rrelu's noise is the last tensor backward still needs:
    # the rerun stops at the next save (exp's), once rrelu has filled the noise.
    def fn(t):
        return F.rrelu(t * 2, training=True), t.exp()

    def run(ckpt):
        a = seeded(1, 64)
        torch.manual_seed(0)
        ckpt(fn, a)[0].sum().backward()
        return (a.grad,)

    expected = run(plain)
    with record_trace() as trace:
        assert bitwise_equal(run(checkpoint), expected)
    assert [(e.kind, e.index) for e in trace.events if e.kind == "early_stop"] == [
        ("early_stop", 1)]
    assert bitwise_equal(run(functools.partial(checkpoint, early_stop=False)), expected)


# ---------------------------------------------------------------------------
# A hook fn registers on its (non-leaf) input fires once
# ---------------------------------------------------------------------------


def test_hook_registered_by_fn_on_its_input_fires_once():
    def fn(u):
        u.register_hook(lambda grad: grad + 1)
        return (u * u).sin()

    def run(ckpt):
        a = seeded(2, 4)
        ckpt(fn, a * 2).sum().backward()
        return (a.grad,)

    expected = run(plain)
    assert bitwise_equal(run(checkpoint), expected)
    torch_is_wrong(run, expected)     # the rerun registers the hook again on the forward's node


# ---------------------------------------------------------------------------
# A torch.Generator of the caller's is replayed where the checkpoint can find it
# ---------------------------------------------------------------------------

GLOBAL_GENERATOR = torch.Generator()


class NoisyScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(3)

    def forward(self, t):
        return (t * torch.rand(t.shape, generator=self.generator)).sin()


def _closure_case():
    generator = torch.Generator().manual_seed(3)
    return (lambda t: (t * torch.rand(4, generator=generator)).sin()), (), generator


def _argument_case():
    generator = torch.Generator().manual_seed(3)
    return (lambda t, g: (t * torch.rand(4, generator=g)).sin()), (generator,), generator


def _global_case():
    GLOBAL_GENERATOR.manual_seed(3)
    return (lambda t: (t * torch.rand(4, generator=GLOBAL_GENERATOR)).sin()), (), GLOBAL_GENERATOR


def _module_case():
    module = nn.Sequential(nn.Identity(), NoisyScale())
    return module, (), module[1].generator


def _partial_case():
    generator = torch.Generator().manual_seed(3)
    return (
        functools.partial(lambda t, g: (t * torch.rand(4, generator=g)).sin(), g=generator),
        (),
        generator,
    )


@pytest.mark.parametrize(
    "make",
    [_closure_case, _argument_case, _global_case, _module_case, _partial_case],
    ids=["closure", "argument", "global name", "submodule attribute", "partial keyword"],
)
def test_a_callers_generator_is_replayed(make):
    def run(ckpt):
        fn, extra, generator = make()
        a = seeded(4, 4)
        ckpt(fn, a, *extra).sum().backward()
        return a.grad, torch.rand(2, generator=generator)    # the caller's stream moved as in plain

    expected = run(plain)
    assert bitwise_equal(run(checkpoint), expected)
    torch_is_wrong(run, expected)


def test_a_generator_on_a_plain_object_is_not_seen():
    # Documented blind spot: the generator is an attribute of an object that is not a module.
    class Holder:
        def __init__(self) -> None:
            self.generator = torch.Generator().manual_seed(3)

    def run(ckpt):
        holder = Holder()
        a = seeded(4, 4)
        ckpt(lambda t: (t * torch.rand(4, generator=holder.generator)).sin(), a).sum().backward()
        return (a.grad,)

    assert not bitwise_equal(run(checkpoint), run(plain))


# ---------------------------------------------------------------------------
# torch's checkpoint keywords, with torch's meaning
# ---------------------------------------------------------------------------


def test_torchs_keywords_are_taken_not_passed_to_fn():
    def fn(t, *, scale):
        return (t * scale).sin().exp()

    def run(ckpt):
        a = seeded(5, 4)
        ckpt(fn, a, scale=2.0, determinism_check="none", debug=False, early_stop=False,
             context_fn=torch_checkpoint.noop_context_fn, preserve_rng_state=False).sum().backward()
        return (a.grad,)

    def run_plain(_):
        a = seeded(5, 4)
        fn(a, scale=2.0).sum().backward()
        return (a.grad,)

    expected = run_plain(None)
    assert bitwise_equal(run(checkpoint), expected)
    assert bitwise_equal(run(torch_ckpt), expected)


def test_determinism_check_none_compares_no_saved_tensor():
    flag = {"exp": True}

    def fn(t):
        return (
            t.exp() if flag["exp"] else t.sin()
        )  # same shape, another op: the key check catches it

    for check, raises in (("default", True), ("none", False)):
        flag["exp"] = True
        out = checkpoint(fn, seeded(6, 4), determinism_check=check)
        flag["exp"] = False
        if raises:
            with pytest.raises(CheckpointError, match="saved tensor #0 differs"):
                out.sum().backward()
        else:
            out.sum().backward()      # torch's meaning: the user turned the check off
    assert_nothing_installed()


def test_set_checkpoint_early_stop_false_runs_the_whole_rerun():
    def fn(t):
        h = t.sin()
        return h.exp(), h.cos().tanh()

    def early_stops() -> int:
        a = seeded(8, 4)
        with record_trace() as trace:
            first, second = checkpoint(fn, a)
            del second                  # its nodes die: backward needs only sin's and exp's saves
            first.sum().backward()
        return trace.count("early_stop")

    assert early_stops() == 1
    with torch_checkpoint.set_checkpoint_early_stop(False):
        assert early_stops() == 0


# ---------------------------------------------------------------------------
# Known blind spots, loud where a cheap check can see them
# ---------------------------------------------------------------------------


def test_parameters_swapped_by_functional_call_are_refused():
    torch.manual_seed(0)
    layer = nn.Linear(4, 4)

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, x, ckpt):
            return ckpt(lambda t: self.layer(t).tanh(), x)

    def run(ckpt):
        swapped = {
            f"layer.{name}": (p.detach() * 2).requires_grad_()
            for name, p in layer.named_parameters()
        }
        a = seeded(9, 2, 4)
        # functional_call puts the module's own parameters back when it returns, before backward
        torch.func.functional_call(Outer(), swapped, (a, ckpt)).sum().backward()
        return a.grad, swapped["layer.weight"].grad

    expected = run(plain)
    with pytest.raises(
        CheckpointError,
        match=r"was a parameter .* replaced between forward and backward, "
        r"e.g. by torch.func.functional_call",
    ):
        run(checkpoint)
    assert_nothing_installed()
    torch_is_wrong(run, expected)


def test_parameters_passed_through_functional_call_inside_fn_are_fine():
    torch.manual_seed(0)
    layer = nn.Linear(4, 4)
    params = {name: (p.detach() * 2).requires_grad_() for name, p in layer.named_parameters()}

    def run(ckpt):
        a = seeded(9, 2, 4)
        ckpt(
            lambda t, p: torch.func.functional_call(layer, p, (t,)).tanh(), a, params
        ).sum().backward()
        grads = (a.grad, params["weight"].grad.clone())
        params["weight"].grad = None
        return grads

    assert bitwise_equal(run(checkpoint), run(plain))


def test_weight_data_written_in_forward_is_not_seen():
    # Documented blind spot (torch the same): writes through .data bump no version.
    def run(ckpt):
        torch.manual_seed(0)
        layer = nn.Linear(4, 4)

        def fn(t):
            layer.weight.data.mul_(0.5)
            return layer(t).tanh()

        a = seeded(10, 2, 4)
        ckpt(fn, a).sum().backward()
        return (a.grad,)

    expected = run(plain)
    assert not bitwise_equal(run(checkpoint), expected)
    torch_is_wrong(run, expected)


def test_a_number_attribute_changed_before_backward_is_not_seen():
    # Documented blind spot (torch the same): dropout's p is a Python float, not a tensor.
    def run(ckpt):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
        a = seeded(11, 2, 4)
        out = ckpt(model, a)
        model[1].p = 0.2
        out.sum().backward()
        return (a.grad,)

    expected = run(plain)
    assert not bitwise_equal(run(checkpoint), expected)
    torch_is_wrong(run, expected)


@dataclasses.dataclass
class Box:
    tensor: torch.Tensor


def test_a_saved_leaf_inside_a_dataclass_changed_after_forward_is_refused():
    def run(ckpt):
        a = seeded(12, 4)
        box = Box(seeded(13, 4, requires_grad=False))
        out = ckpt(lambda t, b: (t * b.tensor).sin(), a, box)
        box.tensor.mul_(2)
        out.sum().backward()
        return (a.grad,)

    assert outcome(run, plain)[0] == "error"
    with pytest.raises(
        CheckpointError, match="modified in place between the forward pass and this recomputation"
    ):
        run(checkpoint)
    assert_nothing_installed()


def test_a_non_leaf_inside_a_dataclass_changed_after_forward_is_not_seen():
    # Documented blind spot (torch the same): a dataclass is one opaque argument, and the tensor in
    # it is
    # neither an input the checkpoint keeps nor a leaf; plain autograd raises (it saved it).
    def run(ckpt):
        a = seeded(12, 4)
        box = Box(seeded(13, 4) * 1)
        out = ckpt(lambda t, b: (t * b.tensor).sin(), a, box)
        with torch.no_grad():
            box.tensor.mul_(2)
        out.sum().backward()
        return (a.grad,)

    assert outcome(run, plain)[0] == "error"
    assert outcome(run, checkpoint)[0] == "ok"


# ---------------------------------------------------------------------------
# Misleading errors, now naming the real cause
# ---------------------------------------------------------------------------


def test_fn_that_changes_its_own_input_is_told_so():
    def fn(u):
        u.mul_(2)
        return u.sin()

    def run(ckpt):
        a = seeded(14, 4)
        ckpt(fn, a * 1).sum().backward()
        return (a.grad,)

    assert outcome(run, plain)[0] == "ok"
    with pytest.raises(
        CheckpointError,
        match=r"the checkpointed function itself modified its input tensor #0 .* "
        r"in place during the forward pass .*u = u.clone\(\) as its first line",
    ):
        run(checkpoint)
    assert_nothing_installed()
    torch_fails(run, "modified by an inplace operation")

    def fixed(u):    # the fix the message gives
        u = u.clone()
        u.mul_(2)
        return u.sin()

    assert bitwise_equal(run(lambda f, t: checkpoint(fixed, t)), run(plain))


@pytest.mark.filterwarnings(
    "ignore::DeprecationWarning:torch.jit._script"
)  # forward AD's formulas use it
def test_dual_level_exited_before_backward_is_named():
    def run(ckpt, backward_inside=False):
        a = seeded(15, 4)
        with forward_ad.dual_level():
            out = ckpt(lambda t: t.sin().exp(), forward_ad.make_dual(a, torch.ones(4)))
            primal = forward_ad.unpack_dual(out).primal
            if backward_inside:
                primal.sum().backward()
        if not backward_inside:
            primal.sum().backward()
        return (a.grad,)

    with pytest.raises(
        CheckpointError, match=r"inside forward-mode AD .* after that level was exited"
    ):
        run(checkpoint)
    assert_nothing_installed()
    torch_fails(run, "A different number of tensors was saved")
    # the fix the message gives
    assert bitwise_equal(run(checkpoint, backward_inside=True), run(plain))


def test_backward_under_inference_mode_works():
    def run(ckpt):
        a = seeded(16, 4)
        loss = ckpt(lambda t: t.sin().exp(), a).sum()
        with torch.inference_mode():
            loss.backward()
        return (a.grad,)

    assert bitwise_equal(run(checkpoint), run(plain))
    torch_fails(run, "A different number of tensors was saved")


def test_vmap_over_a_checkpoint_with_backward_outside_is_named():
    weight = seeded(17, 4, 4)

    def run(ckpt):
        weight.grad = None
        batch = seeded(18, 3, 4, requires_grad=False)
        out = torch.func.vmap(lambda row: ckpt(lambda t: (t @ weight).sin(), row))(batch)
        out.sum().backward()
        return (weight.grad,)

    expected = run(plain)
    with pytest.raises(
        CheckpointError, match=r"inside a torch.func transform .* backward runs outside it"
    ):
        run(checkpoint)
    assert_nothing_installed()
    torch_fails(run, "vmap")

    def around(ckpt):     # the fix the message gives: checkpoint around the vmapped call
        weight.grad = None
        batch = seeded(18, 3, 4, requires_grad=False)
        ckpt(torch.func.vmap(lambda row: (row @ weight).sin()), batch).sum().backward()
        return (weight.grad,)

    assert bitwise_equal(around(checkpoint), expected)


@pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit._script")
def test_torchscript_module_inside_a_checkpoint_keeps_early_stop():
    torch.manual_seed(0)
    scripted = torch.jit.script(
        nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh())
    )

    def run(ckpt):
        a = seeded(19, 2, 4)
        ckpt(scripted, a).sum().backward()
        grads = (a.grad, *(p.grad.clone() for p in scripted.parameters()))
        scripted.zero_grad(set_to_none=True)
        return grads

    for _ in range(3):   # TorchScript's profiling executor settles on its graph after two runs
        run(plain)
    expected = run(plain)
    with record_trace() as trace:
        assert bitwise_equal(run(checkpoint), expected)
    assert trace.count("recompute") == 1
    assert bitwise_equal(run(functools.partial(checkpoint, early_stop=False)), expected)
    torch_fails(run, "The following operation failed in the TorchScript interpreter")


class Swallow:
    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return True      # swallows whatever the checkpointed function raised


def test_a_forward_context_that_swallows_the_error_is_named():
    def fn(t):
        raise ValueError("boom")

    with pytest.raises(
        RuntimeError,
        match=r"the forward context from context_fn suppressed the exception the "
        r"checkpointed function raised \(ValueError: boom\)",
    ):
        checkpoint(fn, seeded(20, 4), context_fn=lambda: (Swallow(), Swallow()))
    assert_nothing_installed()


@pytest.mark.parametrize("answer", ["yes", None, 1], ids=["str", "None", "int"])
def test_a_policy_that_returns_no_decision_is_a_type_error(answer):
    def keep_everything_maybe(op, *args, **kwargs):
        return answer

    with pytest.raises(
        TypeError,
        match=r"policy .*keep_everything_maybe returned no decision for aten.mm.default, "
        r"got .*a policy must return True .* or False",
    ):
        selective_checkpoint(
            lambda t: (t @ t).sin(), seeded(21, 4, 4), policy=keep_everything_maybe
        )
    assert_nothing_installed()


def test_torchs_checkpoint_policy_answers_mean_what_they_say():
    policy = torch_checkpoint.CheckpointPolicy

    def run(answer):
        a = seeded(22, 4, 4)
        selective_checkpoint(
            lambda t: (t @ t).sin(), a, policy=lambda op, *args, **kwargs: answer
        ).sum().backward()
        return (a.grad,)

    def run_plain():
        a = seeded(22, 4, 4)
        (a @ a).sin().sum().backward()
        return (a.grad,)

    for answer in (policy.MUST_SAVE, policy.PREFER_RECOMPUTE, np.bool_(True)):
        assert bitwise_equal(run(answer), run_plain())


# ---------------------------------------------------------------------------
# Python's random and NumPy: not replayed, warned about on a function's first call
# ---------------------------------------------------------------------------


def test_python_random_in_a_checkpoint_warns_once_per_function():
    def fn(t):
        return (t * random.random()).sin()

    def run(ckpt):
        random.seed(0)
        a = seeded(23, 4)
        ckpt(fn, a).sum().backward()
        return (a.grad,)

    expected = run(plain)
    with pytest.warns(
        NotReplayedRandomWarning, match=r"drew random numbers from Python's `random` .* torch.rand"
    ):
        assert not bitwise_equal(run(checkpoint), expected)      # the rerun drew another number
    with warnings.catch_warnings():
        warnings.simplefilter("error", NotReplayedRandomWarning)
        run(checkpoint)                                     # checked on the first call only
    torch_is_wrong(run, expected)


def test_numpy_in_a_checkpoint_warns():
    def fn(t):
        return (t * float(np.random.rand())).sin()

    with pytest.warns(NotReplayedRandomWarning, match=r"NumPy's global generator"):
        checkpoint(fn, seeded(24, 4))


def test_torch_random_in_a_checkpoint_does_not_warn():
    def fn(t):
        return F.dropout(t.sin(), 0.5, training=True)

    with warnings.catch_warnings():
        warnings.simplefilter("error", NotReplayedRandomWarning)
        checkpoint(fn, seeded(25, 4)).sum().backward()
