"""Selective checkpointing (ckptlib.selective): gradients, what is replayed, and when the cache
dies."""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from ckptlib import CheckpointError, checkpoint, is_recomputing
from ckptlib.core.checkpoint import Observer
from ckptlib.memory import MemoryMeter
from ckptlib.models import TransformerBlock
from ckptlib.selective import (
    CostProfile,
    OpCall,
    OpCost,
    SaveChosenOps,
    SelectivePlans,
    choose_ops,
    measure_op_costs,
    megatron_attention,
    policy_from_costs,
    save_matmuls,
    selective_checkpoint,
    selective_contexts,
)

from tests._grads import assert_bitwise_equal, take_grads
from tests.core.test_checkpoint import UNARY, assert_bitwise, grads_of, saved_hooks_installed

aten = torch.ops.aten


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that really run, split into recomputation and the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.recompute: Counter[str] = Counter()
        self.other: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        (self.recompute if is_recomputing() else self.other)[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def make_block(dropout: float = 0.1) -> TransformerBlock:
    torch.manual_seed(0)
    return TransformerBlock(d_model=32, heads=4, seq=16, dropout=dropout)


def grads(run, block: torch.nn.Module, x: torch.Tensor, seed: int = 1) -> list[torch.Tensor]:
    """Gradients of a two-block chain w.r.t. the input and the parameters, RNG seeded."""
    torch.manual_seed(seed)
    out = run(block, run(block, x))
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return take_grads(x, block)


def plain(block, x):
    return block(x)


POLICIES = {
    "save_matmuls": save_matmuls,
    "megatron_attention": megatron_attention,
    "nothing (full checkpoint)": set(),
    "everything": lambda op, *args, **kwargs: True,
    "views and in-place ops only": {
        aten.view,
        aten.t,
        aten.transpose,
        aten.expand,
        aten._unsafe_view,
        aten.div_,
        aten.bernoulli_,
    },
}


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("name", list(POLICIES))
def test_transformer_block_gradients_equal_plain_bitwise(name, dropout):
    block = make_block(dropout)
    x = torch.randn(2, 16, 32, requires_grad=True)
    expected = grads(plain, block, x)
    policy = POLICIES[name]
    actual = grads(lambda b, inp: selective_checkpoint(b, inp, policy=policy), block, x)
    assert_bitwise_equal(actual, expected)


def test_policy_from_costs_gradients_equal_plain_bitwise():
    block = make_block(0.1)
    x = torch.randn(2, 16, 32, requires_grad=True)
    policy = policy_from_costs(block, x, memory_ratio=0.5, repeats=1)
    assert policy.chosen and 0 < policy.used_bytes <= policy.budget_bytes
    expected = grads(plain, block, x)
    assert_bitwise_equal(
        grads(lambda b, inp: selective_checkpoint(b, inp, policy=policy), block, x), expected
    )


def test_caller_rng_stream_is_not_moved():
    block = make_block(0.5)
    x = torch.randn(2, 16, 32, requires_grad=True)
    torch.manual_seed(3)
    block(block(x)).sum().backward()
    after_plain = torch.rand(4)
    torch.manual_seed(3)
    x2 = selective_checkpoint(block, x, policy=lambda op, *a, **k: True)
    selective_checkpoint(block, x2, policy=lambda op, *a, **k: True).sum().backward()
    assert torch.equal(torch.rand(4), after_plain)


def test_saved_matmuls_are_not_run_again():
    block = make_block(0.0)
    x = torch.randn(2, 16, 32, requires_grad=True)
    with OpCounter() as full:
        checkpoint(block, x).sum().backward()
    with OpCounter() as selective:
        selective_checkpoint(block, x, policy=save_matmuls).sum().backward()
    # 3 of the 4 linears: early stop ends the rerun at the input fc2 saves, before fc2.
    assert full.recompute["addmm"] == 3 and full.recompute["bmm"] == 2
    assert selective.recompute["addmm"] == 0 and selective.recompute["bmm"] == 0
    assert selective.recompute["_softmax"] == full.recompute["_softmax"] == 1


def test_megatron_attention_recomputes_exactly_the_attention_core():
    block = make_block(0.1)
    x = torch.randn(2, 16, 32, requires_grad=True)
    with OpCounter() as counter:
        selective_checkpoint(block, x, policy=megatron_attention).sum().backward()
    ran_again = {op for op, count in counter.recompute.items() if count}
    assert {"bmm", "_softmax", "masked_fill"} <= ran_again
    assert not {"addmm", "native_layer_norm", "gelu"} & ran_again
    # Dropout: the attention's (on 4-d scores) is rerun, the two residual ones are replayed.
    assert counter.recompute["bernoulli_"] == 1
    forward_mode, _ = selective_contexts(megatron_attention)
    with forward_mode:
        block(x)
    kept = {op.overloadpacket.__name__ for op, saved in forward_mode.cache.saved.items() if saved}
    assert {"addmm", "native_layer_norm", "gelu", "add"} <= kept
    assert not {"bmm", "_softmax", "masked_fill"} & kept


def test_megatron_attention_finds_a_per_head_tensor_wherever_the_op_takes_it():
    flat, per_head = torch.zeros(4, 8), torch.zeros(2, 4, 16, 16)
    recomputed = [  # (arguments, recomputed: the policy says "do not keep")
        ((flat, flat), False),
        ((per_head, flat), True),
        ((flat, per_head), True),
        ((flat, [flat, per_head]), True),   # a list argument (aten.cat, aten.stack)
        ((flat, (3, [per_head])), True),    # nested
        ((flat, [flat], None, 2.0), False),
    ]
    for args, expected in recomputed:
        assert megatron_attention(aten.add.Tensor, *args) is not expected, args
    assert megatron_attention(aten.add.Tensor, flat, other=per_head) is False   # a keyword
    assert megatron_attention(aten.add.Tensor, flat, other=flat) is True
    assert megatron_attention(aten.bmm.default, flat, flat) is False   # the core, any shape
    with pytest.raises(TypeError, match="Pass it as policy=megatron_attention"):
        megatron_attention("add", flat)


def test_random_op_replay_moves_the_generator_like_the_op():
    # The first draw is replayed from the cache, the second is rerun: the second
    # only matches the forward if the replay left the generator where the op did.
    def fn(t):
        first = t * torch.rand_like(t)
        return first * torch.bernoulli(torch.full_like(t, 0.5))

    x = torch.randn(1000, requires_grad=True)
    torch.manual_seed(0)
    expected = torch.autograd.grad(fn(x).sum(), x)[0]
    with OpCounter() as counter:
        torch.manual_seed(0)
        (actual,) = torch.autograd.grad(
            selective_checkpoint(fn, x, policy={aten.rand_like}).sum(), x
        )
    assert torch.equal(actual, expected)
    assert counter.recompute["rand_like"] == 0 and counter.recompute["bernoulli"] == 1


def test_dropout_mask_is_replayed_by_copying_it_back():
    # F.dropout is empty_like, bernoulli_ (random, in place), div_ (in place), mul.
    def fn(t):
        return F.dropout(F.dropout(t, 0.5).exp(), 0.5)

    chosen = []

    def first_mask_only(op, *args, **kwargs):
        if op is aten.bernoulli_.float and not chosen:
            chosen.append(op)
            return True
        return False

    x = torch.randn(1000, requires_grad=True)
    torch.manual_seed(0)
    expected = torch.autograd.grad(fn(x).sum(), x)[0]
    with OpCounter() as counter:
        torch.manual_seed(0)
        out = selective_checkpoint(fn, x, policy=first_mask_only)
        (actual,) = torch.autograd.grad(out.sum(), x)
    assert torch.equal(actual, expected)
    # Only the first mask was chosen: the second is drawn again from the replayed generator state.
    assert counter.recompute["bernoulli_"] == 1 and counter.recompute["copy_"] == 1
    assert counter.recompute["div_"] == 2


def test_random_ops_are_rerun_without_rng_replay():
    def fn(t):
        return t * torch.rand_like(t)

    x = torch.randn(10, requires_grad=True)
    with OpCounter() as counter:
        selective_checkpoint(
            fn, x, policy={aten.rand_like}, preserve_rng_state=False
        ).sum().backward()
    assert counter.recompute["rand_like"] == 1


def test_output_modified_in_place_after_saving_is_recomputed():
    w = torch.randn(8, 8, requires_grad=True)

    def fn(t):
        y = t @ w
        y.mul_(3)  # the cached mm output is now 3x the mm: stale
        return y.sin()

    x = torch.randn(4, 8, requires_grad=True)
    expected = torch.autograd.grad(fn(x).sum(), (x, w))
    forward_mode, recompute_mode = selective_contexts({aten.mm})
    out = checkpoint(fn, x, context_fn=lambda: (forward_mode, recompute_mode))
    assert forward_mode.cache.saved[aten.mm.default] == {}  # dropped when forward ended
    with OpCounter() as counter:
        actual = torch.autograd.grad(out.sum(), (x, w))
    assert_bitwise_equal(list(actual), list(expected))
    assert counter.recompute["mm"] == 1


def test_view_of_saved_output_modified_in_place_later():
    def fn(t):
        y = t * 2  # mul by a number saves nothing, so y may be modified in place
        y[0].zero_()  # through a view of the saved output
        return y.sin()

    x = torch.randn(4, 8, requires_grad=True)
    expected = torch.autograd.grad(fn(x).sum(), x)[0]
    with OpCounter() as counter:
        (actual,) = torch.autograd.grad(selective_checkpoint(fn, x, policy={aten.mul}).sum(), x)
    assert torch.equal(actual, expected)
    assert counter.recompute["mul"] == 1


def test_retain_graph_twice_replays_both_times_then_frees():
    w = torch.randn(8, 8, requires_grad=True)

    def fn(t):
        return (t @ w).tanh() @ w

    x = torch.randn(4, 8, requires_grad=True)
    expected = torch.autograd.grad(fn(x).sum(), w)[0]
    forward_mode, recompute_mode = selective_contexts(save_matmuls)
    out = checkpoint(fn, x, context_fn=lambda: (forward_mode, recompute_mode)).sum()
    cached_bytes = forward_mode.cache.saved_bytes
    assert cached_bytes == 2 * 4 * 8 * 4
    for retain in (True, False):
        with OpCounter() as counter:
            (grad,) = torch.autograd.grad(out, w, retain_graph=retain)
        assert torch.equal(grad, expected)
        assert counter.recompute["mm"] == 0
        assert forward_mode.cache.saved_bytes == (cached_bytes if retain else 0)


def test_dropping_the_graph_frees_the_cache():
    x = torch.randn(64, 64, requires_grad=True)
    with MemoryMeter() as meter:
        out = selective_checkpoint(lambda t: (t @ t).relu() @ t, x, policy=save_matmuls)
        assert meter.live_bytes == 2 * 64 * 64 * 4  # the first mm in the cache, the output
        del out
        assert meter.live_bytes == 0


def test_changed_control_flow_raises():
    calls = []

    def fn(t):
        calls.append(None)
        if len(calls) > 1:  # one more mm in the recomputation
            with torch.no_grad():
                t @ t
        return (t @ t).relu()

    x = torch.randn(4, 4, requires_grad=True)
    out = selective_checkpoint(fn, x, policy=save_matmuls)
    with pytest.raises(
        CheckpointError, match=r"recomputation called aten.mm.default 2 times, the forward"
    ):
        out.sum().backward()


def test_changed_shapes_raise():
    sizes = [4, 2]

    def fn(t):
        with (
            torch.no_grad()
        ):  # nothing saved here, so ckptlib.checkpoint's own checks cannot see it
            scale = (t[: sizes.pop(0)] @ t.T).sum()
        return t.sin() * scale

    x = torch.randn(4, 4, requires_grad=True)
    out = selective_checkpoint(fn, x, policy=save_matmuls)
    with pytest.raises(CheckpointError, match=r"call #0 of aten.mm.default got inputs of shapes"):
        out.sum().backward()


@pytest.mark.parametrize(
    "policy, message",
    [
        ({torch.mm}, "not an aten op"),
        (["aten.mm"], "not an aten op"),
        ("aten.mm", "must be a callable"),
    ],
)
def test_bad_policies_are_rejected(policy, message):
    x = torch.randn(2, 2, requires_grad=True)
    with pytest.raises(TypeError, match=message):
        selective_checkpoint(torch.sin, x, policy=policy)


def test_single_op_policy_and_packets_match_overloads():
    x = torch.randn(4, 4, requires_grad=True)
    for policy in (aten.mm.default, aten.mm, {aten.mm}):
        forward_mode, _ = selective_contexts(policy)
        with forward_mode:
            x @ x
        assert 0 in forward_mode.cache.saved[aten.mm.default]


def test_works_as_torch_utils_checkpoint_context_fn():
    block = make_block(0.1)
    x = torch.randn(2, 16, 32, requires_grad=True)
    expected = grads(plain, block, x)
    context_fn = functools.partial(selective_contexts, save_matmuls)

    def run(b, inp):
        return torch.utils.checkpoint.checkpoint(b, inp, use_reentrant=False, context_fn=context_fn)

    assert_bitwise_equal(grads(run, block, x), expected)


def test_nested_inside_a_full_checkpoint():
    block = make_block(0.1)
    x = torch.randn(2, 16, 32, requires_grad=True)
    expected = grads(plain, block, x)

    def two_selective(b, inp):
        return selective_checkpoint(b, inp, policy=save_matmuls)

    actual = grads(lambda b, inp: checkpoint(two_selective, b, inp), block, x)
    assert_bitwise_equal(actual, expected)


def test_no_grad_is_a_plain_call():
    x = torch.randn(3)
    with torch.no_grad():
        assert torch.equal(selective_checkpoint(torch.exp, x, policy=save_matmuls), x.exp())


def test_measure_op_costs_per_call_signature():
    w_in, w_out = torch.randn(32, 64, requires_grad=True), torch.randn(64, 8, requires_grad=True)
    x = torch.randn(16, 32)
    profile = measure_op_costs(lambda t: (t @ w_in).relu() @ w_out, x, repeats=2)
    first = profile.ops[OpCall(aten.mm.default, ((16, 32), (32, 64)))]
    relu = profile.ops[OpCall(aten.relu.default, ((16, 64),))]
    last = profile.ops[OpCall(aten.mm.default, ((16, 64), (64, 8)))]
    # The last mm's output is the function's output, alive anyway: caching it costs no bytes.
    assert (first.calls, first.output_bytes, relu.output_bytes, last.output_bytes) == (
        1,
        4096,
        4096,
        0,
    )
    assert first.time_s > 0 and relu.time_s > 0
    # The last mm starts after autograd saved its last tensor: a rerun stops before it.
    assert last.time_s == 0
    assert (
        profile.activation_bytes == 16 * 64 * 4
    )  # relu's output; x and the weights are no activations
    assert "aten.mm.default(16x32, 32x64)" in str(profile)


def test_measure_op_costs_does_not_count_a_transposed_weight_as_an_activation():
    # F.linear saves weight.t(), a view of the parameter: it allocates nothing, and counting
    # it inflated activation_bytes, so memory_ratio=0.5 let the cost policy keep more than half.
    lin = torch.nn.Linear(32, 64)
    x = torch.randn(16, 32, requires_grad=True)  # so addmm saves weight.t() to compute x's gradient
    profile = measure_op_costs(lambda t: lin(t).relu(), x, repeats=1)
    assert profile.activation_bytes == 16 * 64 * 4  # relu's output only


def test_choose_ops_is_greedy_by_time_per_byte_and_deterministic():
    def call(op):
        return OpCall(op, ((4, 4),))

    ops = {
        call(aten.addmm.default): OpCost(4, 0.050, 9000),
        call(aten.gelu.default): OpCost(1, 0.004, 4000),
        call(aten.mul.Tensor): OpCost(1, 0.001, 4000),
        call(aten.add.Tensor): OpCost(2, 0.0005, 2000),
        call(aten.clone.default): OpCost(2, 0.0005, 2000),
        call(aten.sin.default): OpCost(1, 0.0, 10),
    }
    profile = CostProfile(ops, activation_bytes=30000)
    assert choose_ops(profile, 9000).chosen == {call(aten.addmm.default)}
    # gelu fits, mul does not any more; add and clone tie on time per byte: name order, only add
    # fits.
    policy = choose_ops(profile, 15000)
    assert policy.chosen == {
        call(aten.addmm.default),
        call(aten.gelu.default),
        call(aten.add.Tensor),
    }
    assert policy.used_bytes == 15000
    assert choose_ops(profile, 10**9).chosen == set(ops) - {call(aten.sin.default)}  # saves no time
    assert choose_ops(profile, 0).chosen == frozenset()
    assert choose_ops(CostProfile(dict(reversed(ops.items())), 30000), 15000) == policy
    assert policy(aten.gelu.default, torch.zeros(4, 4)) and not policy(
        aten.gelu.default, torch.zeros(4, 5)
    )


def test_policy_from_costs_needs_exactly_one_budget():
    x = torch.randn(4, 4, requires_grad=True)
    with pytest.raises(ValueError, match="exactly one budget"):
        policy_from_costs(torch.sin, x)
    with pytest.raises(ValueError, match="exactly one budget"):
        policy_from_costs(torch.sin, x, memory_ratio=0.5, budget_bytes=10)


# ---------------------------------------------------------------------------
# The rerun skips what nothing needs
# ---------------------------------------------------------------------------


def test_rerun_skips_the_ops_that_only_fed_a_kept_output():
    # Keep the softmax's output: q @ k^T, the scaling and the mask only fed it, so the rerun skips
    # them (PyTorch's SAC with the same op list reruns them and then discards the result).
    block = make_block(0.0)
    x = torch.randn(2, 16, 32, requires_grad=True)
    y = selective_checkpoint(block, x, policy={aten._softmax})
    with OpCounter() as ours:
        y.sum().backward()
    torch_y = torch_checkpoint(
        block,
        x,
        use_reentrant=False,
        context_fn=functools.partial(create_selective_checkpoint_contexts, [aten._softmax.default]),
    )
    with OpCounter() as theirs:  # torch's rerun is not ckptlib's: all its ops count as "other"
        torch_y.sum().backward()
    ran = ours.recompute
    assert ran["_softmax"] == ran["masked_fill"] == ran["mul"] == 0
    assert ran["bmm"] == 1  # weights @ v: its output is needed
    assert ran["addmm"] == 3 and ran["native_layer_norm"] == 2  # the rest still reruns
    ours_total = ours.recompute + ours.other
    for op, skipped in {"masked_fill": 1, "bmm": 1, "mul": 1}.items():
        assert theirs.other[op] - ours_total[op] == skipped, op


@pytest.mark.parametrize(
    "policy", [{aten._softmax}, {aten.clone}, {aten.addmm, aten.add}, save_matmuls]
)
def test_skipping_keeps_gradients_bitwise(policy):
    block = make_block(0.1)
    x = torch.randn(2, 16, 32, requires_grad=True)
    expected = grads(plain, block, x)
    actual = grads(lambda b, inp: selective_checkpoint(b, inp, policy=policy), block, x)
    assert_bitwise_equal(actual, expected)


@pytest.mark.parametrize("reuse_plans", [False, True])
def test_no_skipping_once_the_cache_is_gone(reuse_plans):
    # The plan skips mm because softmax is replayed. A retained backward replays twice; a
    # backward that frees the graph (through the softmax) frees the cache; a last one (through
    # b, which saved s but does not lead back to the softmax) reruns softmax, which then needs
    # mm's real output: the skip plan must not be used again. Also with plans reused.
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)

    def f(t):
        s = (t @ w).softmax(-1)
        return s * 2, s.detach() * t

    def both_grads(run):
        a, b = run()
        first = torch.autograd.grad(a.sum(), (x, w), retain_graph=True)
        again = torch.autograd.grad(a.sum(), (x, w))
        return first + again + torch.autograd.grad(b.sum(), (x,))

    expected = both_grads(lambda: f(x))
    plans = SelectivePlans() if reuse_plans else None
    for step in range(3):
        actual = both_grads(lambda: selective_checkpoint(f, x, policy={aten._softmax}, plans=plans))
        assert_bitwise_equal(list(actual), list(expected))
    assert plans is None or plans.reused == 2


def test_plan_is_made_only_when_the_checkpoint_reports_saved_tensors():
    # With torch.utils.checkpoint, nobody tells the modes what autograd saved: nothing is skipped.
    forward_mode, recompute_mode = selective_contexts({aten._softmax})
    block = make_block(0.0)
    x = torch.randn(2, 16, 32, requires_grad=True)
    y = torch_checkpoint(
        block, x, use_reentrant=False, context_fn=lambda: (forward_mode, recompute_mode)
    )
    assert forward_mode.cache.skippable is None
    with OpCounter() as counter:
        y.sum().backward()
    assert counter.other["masked_fill"] == 2  # rerun and backward
    forward_mode, _ = selective_contexts({aten._softmax})
    assert isinstance(forward_mode, Observer)   # ckptlib.checkpoint reports to it


# ---------------------------------------------------------------------------
# Random chains of ops, random policies
# ---------------------------------------------------------------------------

POLICY_OPS = [
    aten.mm,
    aten.sin,
    aten.exp,
    aten.tanh,
    aten.relu,
    aten.mul,
    aten._softmax,
    aten.gelu,
    aten.native_layer_norm,
    aten.clone,
    aten.clamp,
    aten.bernoulli_,
    aten.div_,
    aten.expand,
    aten.slice,
    aten.transpose,
]


@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(st.sampled_from(sorted(UNARY)), min_size=1, max_size=6),
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    split=st.integers(0, 6),
    policy=st.sets(st.sampled_from(POLICY_OPS)),
)
def test_random_chains_and_policies_match_plain_bitwise(ops, shape, split, policy):
    split = min(split, len(ops))
    x = torch.randn(*shape, requires_grad=True)

    def chain(t, names):
        for name in names:
            t = UNARY[name](t)
        return t

    def run(wrap):
        return chain(wrap(lambda t: chain(t, ops[:split]), x), ops[split:])

    expected = grads_of(lambda: run(lambda f, t: f(t)), [x], seed=1)
    actual = grads_of(
        lambda: run(lambda f, t: selective_checkpoint(f, t, policy=policy)), [x], seed=1
    )
    assert_bitwise(expected, actual)
    assert not saved_hooks_installed()


# ---------------------------------------------------------------------------
# Choosing on the op graph
# ---------------------------------------------------------------------------


def two_halves_profile() -> CostProfile:
    """h = x @ w feeds two exps of different widths; autograd saves only the exps' outputs.
    Times are set by hand (mm 1 s, each exp 10 ms): the choice, not the clock, is under test."""
    w = torch.randn(64, 64)
    x = torch.randn(16, 64, requires_grad=True)

    def f(t):
        h = t @ w
        return torch.cat([h[:, :24].exp(), h[:, 24:].exp()], dim=1)

    profile = measure_op_costs(f, x, repeats=1)
    seconds = {"mm": 1.0, "exp": 0.01}
    profile.graph.calls = [
        call._replace(seconds=seconds.get(call.key[0].overloadpacket.__name__, 0.0))
        for call in profile.graph.calls
    ]
    return profile


def test_choose_ops_finds_outputs_that_only_pay_off_together():
    profile = two_halves_profile()
    h_bytes = 16 * 64 * 4
    policy = choose_ops(profile, budget_bytes=h_bytes, worth=0.5)
    # Keeping both exps' outputs (the same bytes as h) spares the mm *and* the exps; either
    # alone spares one exp; h alone spares only the mm.
    assert {call.op for call in policy.chosen} == {aten.exp.default}
    assert len(policy.chosen) == 2 and policy.used_bytes == h_bytes


def test_choose_ops_keeps_nothing_not_worth_its_bytes():
    profile = two_halves_profile()
    assert not choose_ops(
        profile, budget_bytes=10**9, worth=2.0
    ).chosen  # nothing saves 2x the average
    assert choose_ops(profile, budget_bytes=10**9, worth=0.0).chosen


def test_data_leaving_through_numpy_fails_loudly_unless_skipping_is_off():
    # h only feeds numpy, which the op graph cannot see: the rerun skips the mm, and the skipped
    # result (on the meta device) cannot be read. skip_unneeded=False reruns every op.
    w = torch.randn(6, 6)
    x = torch.randn(3, 6, requires_grad=True)

    def f(t):
        h = t @ w
        mask = torch.from_numpy(h.detach().numpy() > 0)
        return (t * mask).sin()

    y = selective_checkpoint(f, x, policy={aten.sin})
    with pytest.raises(TypeError, match="meta"):
        y.sum().backward()
    assert not saved_hooks_installed()
    x.grad = None
    selective_checkpoint(f, x, policy={aten.sin}, skip_unneeded=False).sum().backward()
    assert torch.equal(x.grad, torch.autograd.grad(f(x).sum(), x)[0])


@pytest.mark.parametrize("policy", [set(), {aten._softmax}, {aten.mm}, {aten.sin, aten.mul}])
def test_skipping_with_nested_checkpoints_inside(policy):
    # Inside the outer region: a full checkpoint whose result nothing uses (the outer rerun skips
    # its inner ops, hands it meta stand-ins, and its frame is never unpacked) and a selective one.
    x = torch.randn(5, 6, requires_grad=True)
    w = torch.randn(6, 6, requires_grad=True)

    def outer(t):
        a = (t @ w).sin()
        checkpoint(lambda u: (u @ w).exp(), a * 3)
        h = selective_checkpoint(lambda u: (u @ w).softmax(-1) @ w, a.cos(), policy={aten._softmax})
        return h.tanh() + a

    expected = grads_of(lambda: outer(x), [x, w])
    assert_bitwise(
        expected, grads_of(lambda: selective_checkpoint(outer, x, policy=policy), [x, w])
    )
    assert_bitwise(
        expected,
        grads_of(
            lambda: checkpoint(lambda t: selective_checkpoint(outer, t, policy=policy), x), [x, w]
        ),
    )
    assert not saved_hooks_installed()


def test_skipping_under_bf16_autocast():
    block = make_block(0.0)
    x = torch.randn(2, 16, 32, requires_grad=True)

    def under_autocast(run):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return grads(run, block, x)

    expected = under_autocast(plain)
    for policy in ({aten._softmax}, save_matmuls):
        actual = under_autocast(lambda b, inp: selective_checkpoint(b, inp, policy=policy))
        assert_bitwise_equal(actual, expected)


class FusedAttention(torch.nn.Module):
    """Attention through F.scaled_dot_product_attention (a fused op with several outputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(32, 96), torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 8, 3, 4, 8).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1)
        return self.out(attended.transpose(1, 2).reshape(2, 8, 32))


def token_loss(embedding: torch.nn.Embedding, tokens: torch.Tensor) -> torch.Tensor:
    hidden = embedding(tokens)
    return F.cross_entropy(hidden.view(-1, 32) @ embedding.weight.t(), tokens.view(-1)).unsqueeze(0)


def other_module(model: str) -> tuple[Callable, torch.Tensor, list[torch.Tensor]]:
    """``(fn, input, tensors to differentiate)``: an encoder layer, fused attention or an embedding
    loss."""
    torch.manual_seed(0)
    if model == "embedding_loss":
        embedding = torch.nn.Embedding(50, 32)
        return (
            functools.partial(token_loss, embedding),
            torch.randint(50, (2, 8)),
            [embedding.weight],
        )
    module = (
        torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
        if model == "encoder_layer"
        else FusedAttention()
    )
    inp = torch.randn(2, 8, 32, requires_grad=True)
    return module, inp, [inp, *module.parameters()]


@pytest.mark.parametrize(
    "policy",
    [
        set(),
        save_matmuls,
        megatron_attention,
        {aten._softmax, aten.clone, aten.add},
        {aten.native_layer_norm},
        {aten._scaled_dot_product_flash_attention_for_cpu},
        lambda op, *args, **kwargs: True,
    ],
    ids=[
        "nothing",
        "save_matmuls",
        "megatron",
        "softmax_clone_add",
        "layer_norm",
        "fused_attention",
        "everything",
    ],
)
@pytest.mark.parametrize("model", ["encoder_layer", "fused_attention", "embedding_loss"])
def test_skipping_on_other_modules_matches_plain_bitwise(model, policy):
    fn, inp, tensors = other_module(model)
    expected = grads_of(lambda: fn(inp), tensors, seed=1)
    assert_bitwise(
        expected, grads_of(lambda: selective_checkpoint(fn, inp, policy=policy), tensors, seed=1)
    )


# ---------------------------------------------------------------------------
# SelectivePlans: a plan recorded once, reused by later calls with no forward mode
# ---------------------------------------------------------------------------

SOFTMAX_CLONE_ADD = {aten._softmax, aten.clone, aten.add}


class ForwardModeCalls:
    """Counts the ops SaveChosenOps sees (zero when a call reuses a plan)."""

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        original = SaveChosenOps.__torch_dispatch__

        def counting(mode, func, types, args=(), kwargs=None):
            self.count += 1
            return original(mode, func, types, args, kwargs)

        monkeypatch.setattr(SaveChosenOps, "__torch_dispatch__", counting)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize(
    "policy",
    [
        save_matmuls,
        megatron_attention,
        SOFTMAX_CLONE_ADD,
        {aten._softmax},
        set(),
        lambda op, *args, **kwargs: True,
    ],
    ids=["save_matmuls", "megatron", "softmax_clone_add", "softmax", "nothing", "everything"],
)
def test_reused_plans_give_gradients_bitwise_equal_to_plain(policy, dropout):
    block = make_block(dropout)
    x = torch.randn(2, 16, 32, requires_grad=True)
    expected = grads(plain, block, x)
    plans = SelectivePlans()
    for step in range(3):  # the chain calls the block twice: 1 recording, then 5 reuses
        actual = grads(
            lambda b, inp: selective_checkpoint(b, inp, policy=policy, plans=plans), block, x
        )
        assert_bitwise_equal(actual, expected)
    assert (plans.recorded, plans.reused, plans.fallbacks, plans.mismatches) == (1, 5, 0, 0)
    assert len(plans) == 1


def test_reused_call_runs_no_forward_mode_and_reruns_like_the_recording(monkeypatch):
    block = make_block(0.0)
    x = torch.randn(2, 16, 32, requires_grad=True)
    plans = SelectivePlans()
    seen = ForwardModeCalls(monkeypatch)
    ran, kept = [], []
    for step in range(2):
        before = seen.count
        y = selective_checkpoint(block, x, policy=SOFTMAX_CLONE_ADD, plans=plans)
        kept.append(y.grad_fn is not None and seen.count - before)
        with OpCounter() as counter:
            y.sum().backward()
        ran.append(counter.recompute)
    assert kept[0] > 0 and kept[1] == 0  # the reused call's forward saw no dispatch mode
    # The reused rerun skips and replays exactly what the recording call's did: only the layer
    # norms, the first MLP linear and the GELU run again (the softmax, q/k/v and the residual
    # sum are saved by autograd, so they come back from the saved tensors).
    assert ran[0] == ran[1]
    assert ran[1]["_softmax"] == ran[1]["bmm"] == ran[1]["masked_fill"] == 0
    assert ran[1]["native_layer_norm"] == 2 and ran[1]["addmm"] == 1 and ran[1]["gelu"] == 1


def test_reused_call_keeps_what_the_recording_call_kept():
    block = make_block(0.0)
    x = torch.randn(2, 16, 32, requires_grad=True)
    plans = SelectivePlans()
    peaks = []
    for step in range(3):
        with MemoryMeter() as meter:
            y = selective_checkpoint(block, x, policy=SOFTMAX_CLONE_ADD, plans=plans)
            kept = meter.live_bytes
            y.sum().backward()
        peaks.append((kept, meter.peak_bytes))
        block.zero_grad(set_to_none=True)
        x.grad = None
    assert peaks[0] == peaks[1] == peaks[2]
    assert plans.reused == 2


def test_changed_saved_tensors_fall_back_to_full_recompute_and_stop_reusing():
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    flags = {"sin": False}

    def f(t):
        h = (t @ w).tanh()
        if flags["sin"]:
            h = h.sin()  # saves its input: the saved tensors differ from the plan's
        return h @ w

    plans = SelectivePlans()
    # (recorded, reused, fallbacks): after the fallback, the signature runs without plans
    for sin, expected_counts in [
        (False, (1, 0, 0)),
        (False, (1, 1, 0)),
        (True, (1, 2, 1)),
        (True, (1, 2, 1)),
        (False, (1, 2, 1)),
    ]:
        flags["sin"] = sin
        expected = grads_of(lambda: f(x), [x, w], seed=0)
        actual = grads_of(
            lambda: selective_checkpoint(f, x, policy=save_matmuls, plans=plans), [x, w], seed=0
        )
        assert_bitwise(expected, actual)
        assert (plans.recorded, plans.reused, plans.fallbacks) == expected_counts
    assert len(plans) == 0


def test_changed_ops_with_the_same_saved_tensors_rerun_as_full_checkpointing():
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    flags = {"twice": False}

    def f(t):
        scale = torch.full((4, 8), 2.0)
        if flags["twice"]:
            scale = scale.neg().neg()  # no grad: no autograd node, nothing saved
        return ((t @ w) * scale) @ w

    plans = SelectivePlans()
    with OpCounter():  # the caller's dispatch modes are part of the signature: the same here
        selective_checkpoint(f, x, policy=save_matmuls, plans=plans).sum().backward()
    flags["twice"] = True
    counters = []
    for step in range(2):
        x.grad = w.grad = None
        expected = grads_of(lambda: f(x), [x, w], seed=0)
        with OpCounter() as counter:
            actual = grads_of(
                lambda: selective_checkpoint(f, x, policy=save_matmuls, plans=plans), [x, w], seed=0
            )
        assert_bitwise(expected, actual)
        assert not saved_hooks_installed()
        counters.append(counter.recompute)
    # The saved tensors matched the plan; the rerun met an op the plan does not have, dropped
    # the cached outputs and ran the function again as full checkpointing does.
    assert (plans.recorded, plans.reused, plans.fallbacks, plans.mismatches, len(plans)) == (
        1,
        1,
        0,
        1,
        0,
    )
    assert counters[0]["full"] == 2 and counters[0]["neg"] == 2 and counters[0]["mm"] == 1
    assert counters[1]["full"] == 1 and counters[1]["mm"] == 0  # then: no plans, plain selective


def test_changed_node_order_falls_back_in_forward():
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    flags = {"twice": False}

    def f(t):
        h = torch.neg(t @ w)
        if flags["twice"]:
            h = torch.neg(h)  # saves nothing, but it is an autograd node: later ones move
        return h @ w

    plans = SelectivePlans()
    selective_checkpoint(f, x, policy=save_matmuls, plans=plans).sum().backward()
    flags["twice"] = True
    x.grad = w.grad = None
    expected = grads_of(lambda: f(x), [x, w], seed=0)
    assert_bitwise(
        expected,
        grads_of(
            lambda: selective_checkpoint(f, x, policy=save_matmuls, plans=plans), [x, w], seed=0
        ),
    )
    assert (plans.fallbacks, plans.mismatches) == (1, 0)


def test_cached_output_is_never_rebuilt_from_another_ops_tensor():
    # Same ops, same saved shapes and node kinds; only which matmul's output each consumer reads
    # changes with the flag. The node places in the fingerprint tell the two apart.
    x = torch.randn(4, 8, requires_grad=True)
    w1, w2, w3 = (torch.randn(8, 8, requires_grad=True) for _ in range(3))
    flags = {"swap": False}

    def f(t):
        a, b = t @ w1, t @ w2
        if flags["swap"]:
            a, b = b, a
        return (a @ w3) * b.sin()

    plans = SelectivePlans()
    for swap in (False, True, True):
        flags["swap"] = swap
        expected = grads_of(lambda: f(x), [x, w1, w2, w3], seed=0)
        assert_bitwise(
            expected,
            grads_of(
                lambda: selective_checkpoint(f, x, policy=save_matmuls, plans=plans),
                [x, w1, w2, w3],
                seed=0,
            ),
        )
    assert plans.fallbacks == 1


def test_rerun_that_needs_a_skipped_result_runs_again_without_skipping():
    # The function makes a tensor on q's device in Python: the op graph sees no dependency of
    # `ones` on q, so the rerun skips q's matmul and `ones` lands on the meta device.
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)

    def f(t):
        q = t @ w
        k = q.exp()  # kept: q is not needed for k...
        mask = torch.ones(4, 8, device=q.device).tril()  # ...except for its device
        return (k * mask).sin()

    expected = grads_of(lambda: f(x), [x, w], seed=0)
    with OpCounter() as counter:
        actual = grads_of(lambda: selective_checkpoint(f, x, policy={aten.exp}), [x, w], seed=0)
    assert_bitwise(expected, actual)
    assert (
        counter.recompute["tril"] == 2 and counter.recompute["mm"] == 1
    )  # two runs, the second in full
    plans = SelectivePlans()
    for step in range(3):
        assert_bitwise(
            expected,
            grads_of(
                lambda: selective_checkpoint(f, x, policy={aten.exp}, plans=plans), [x, w], seed=0
            ),
        )
    assert (plans.recorded, plans.reused, plans.mismatches) == (1, 1, 1)


def test_plans_are_per_signature():
    block = make_block(0.1)
    plans = SelectivePlans()
    for shape in [(2, 16, 32), (2, 16, 32), (3, 16, 32), (2, 8, 32)]:
        x = torch.randn(*shape, requires_grad=True)
        selective_checkpoint(block, x, policy=save_matmuls, plans=plans).sum().backward()
    x = torch.randn(2, 16, 32)  # no requires_grad: another signature
    selective_checkpoint(block, x, policy=save_matmuls, plans=plans).sum().backward()
    block.eval()  # dropout off: another signature
    selective_checkpoint(block, x, policy=save_matmuls, plans=plans).sum().backward()
    selective_checkpoint(
        block, x, policy={aten._softmax}, plans=plans
    ).sum().backward()  # another policy
    assert (len(plans), plans.recorded, plans.reused, plans.fallbacks) == (6, 6, 1, 0)


def test_plans_hold_no_tensors_and_die_with_their_function():
    import gc
    import weakref

    block = make_block(0.0)
    plans = SelectivePlans()
    x = torch.randn(2, 16, 32, requires_grad=True)
    selective_checkpoint(block, x, policy=SOFTMAX_CLONE_ADD, plans=plans).sum().backward()
    (plan,) = next(iter(plans._tables.values())).values()

    def tensors_in(value) -> int:
        if isinstance(value, torch.Tensor):
            return 1
        if isinstance(value, dict):
            return sum(tensors_in(k) + tensors_in(v) for k, v in value.items())
        if isinstance(value, (list, tuple)):
            return sum(tensors_in(item) for item in value)
        return 0

    assert plan.entries and tensors_in(tuple(plan)) == 0
    alive = weakref.ref(block)
    del block
    gc.collect()
    assert alive() is None and len(plans) == 0


def test_reused_plans_under_bf16_autocast():
    block = make_block(0.0)
    x = torch.randn(2, 16, 32, requires_grad=True)

    def step(run):
        with torch.autocast(
            "cpu", dtype=torch.bfloat16
        ):  # a new region: the weights are cast again
            out = run(block, x)
        out.float().sum().backward()
        return take_grads(x, block)

    expected = step(plain)
    plans = SelectivePlans()
    for _ in range(3):
        assert_bitwise_equal(
            step(
                lambda b, inp: selective_checkpoint(b, inp, policy=SOFTMAX_CLONE_ADD, plans=plans)
            ),
            expected,
        )
    assert (plans.recorded, plans.reused, plans.fallbacks) == (1, 2, 0)
    # Twice in one autocast region, the second call reuses the first's weight casts: it makes
    # fewer autograd nodes, so its saved tensors do not match the plan: it falls back, correctly.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = grads(plain, block, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        twice = SelectivePlans()
        actual = grads(
            lambda b, inp: selective_checkpoint(b, inp, policy=SOFTMAX_CLONE_ADD, plans=twice),
            block,
            x,
        )
    assert_bitwise_equal(actual, expected)
    assert twice.fallbacks == 1
    selective_checkpoint(
        block, x, policy=SOFTMAX_CLONE_ADD, plans=plans
    ).sum().backward()  # no autocast
    assert plans.recorded == 2


@pytest.mark.parametrize("model", ["encoder_layer", "fused_attention", "embedding_loss"])
def test_reused_plans_on_other_modules_match_plain_bitwise(model):
    fn, inp, tensors = other_module(model)
    expected = grads_of(lambda: fn(inp), tensors, seed=1)
    plans = SelectivePlans()
    for policy in (
        save_matmuls,
        megatron_attention,
        SOFTMAX_CLONE_ADD,
        lambda op, *args, **kwargs: True,
    ):
        for step in range(2):
            assert_bitwise(
                expected,
                grads_of(
                    lambda: selective_checkpoint(fn, inp, policy=policy, plans=plans),
                    tensors,
                    seed=1,
                ),
            )
    # The math attention makes its causal mask with ones(device=q.device): with softmax, clone
    # and add kept, a reused plan skips q, the mask lands on the meta device and that rerun runs
    # again without skipping (one mismatch); the gradients are right every time.
    assert (plans.reused, plans.fallbacks, plans.mismatches) == (
        4,
        0,
        int(model == "fused_attention"),
    )


@settings(max_examples=30, deadline=None)
@given(
    ops=st.lists(st.sampled_from(sorted(UNARY)), min_size=1, max_size=6),
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    policy=st.sets(st.sampled_from(POLICY_OPS)),
)
def test_random_chains_with_reused_plans_match_plain_bitwise(ops, shape, policy):
    x = torch.randn(*shape, requires_grad=True)

    def chain(t):
        for name in ops:
            t = UNARY[name](t)
        return t

    expected = grads_of(lambda: chain(x).exp(), [x], seed=1)
    plans = SelectivePlans()
    for step in range(3):
        actual = grads_of(
            lambda: selective_checkpoint(chain, x, policy=policy, plans=plans).exp(), [x], seed=1
        )
        assert_bitwise(expected, actual)
    assert plans.mismatches == 0 and not saved_hooks_installed()


def test_bad_plans_arguments():
    x = torch.randn(4, requires_grad=True)
    with pytest.raises(TypeError, match="plans must be a SelectivePlans"):
        selective_checkpoint(torch.sin, x, policy=set(), plans={})
    with pytest.raises(ValueError, match="needs skip_unneeded=True"):
        selective_checkpoint(
            torch.sin, x, policy=set(), plans=SelectivePlans(), skip_unneeded=False
        )
    plans = SelectivePlans()
    with pytest.warns(UserWarning, match="cannot keep plans for TensorBase.sin"):
        for step in range(
            2
        ):  # a method descriptor cannot be weakly referenced: never reused, no error
            selective_checkpoint(torch.Tensor.sin, x, policy=set(), plans=plans).sum().backward()
    assert len(plans) == 0 and plans.reused == 0

    def g(t, extra):
        return t.sin()

    with pytest.warns(UserWarning, match="not hashable, so it has no signature"):
        for step in range(2):  # an unhashable argument (a set): no signature, never reused
            selective_checkpoint(g, x, {1.0}, policy=set(), plans=plans).sum().backward()
    assert len(plans) == 0 and plans.reused == 0


def test_a_forward_that_raised_records_no_plan():
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    fail = {"now": True}

    def f(t):
        h = (t @ w).tanh()
        if fail["now"]:
            raise ValueError("boom")
        return h @ w

    plans = SelectivePlans()
    with pytest.raises(ValueError, match="boom"):
        selective_checkpoint(f, x, policy=save_matmuls, plans=plans)
    assert len(plans) == 0 and plans.recorded == 0 and not saved_hooks_installed()
    fail["now"] = False
    expected = grads_of(lambda: f(x), [x, w], seed=0)
    for step in range(2):
        assert_bitwise(
            expected,
            grads_of(
                lambda: selective_checkpoint(f, x, policy=save_matmuls, plans=plans), [x, w], seed=0
            ),
        )
    assert (plans.recorded, plans.reused, plans.fallbacks) == (1, 1, 0)


def test_plans_are_per_ambient_dispatch_mode():
    # Under a dispatch mode of the caller's (here FlopCounterMode, which also tracks modules with
    # autograd functions), a call makes other autograd nodes: it gets its own plan, no fallback.
    from torch.utils.flop_counter import FlopCounterMode

    block = make_block(0.0)
    x = torch.randn(2, 16, 32, requires_grad=True)

    def step(run):  # .backward(): FlopCounterMode's module tracking does not support autograd.grad
        run().square().sum().backward()
        return take_grads(x, block)

    expected = step(lambda: block(x))
    plans = SelectivePlans()
    for counting in (False, True, False, True):
        with FlopCounterMode(display=False) if counting else contextlib.nullcontext():
            actual = step(
                lambda: selective_checkpoint(block, x, policy=SOFTMAX_CLONE_ADD, plans=plans)
            )
        assert_bitwise_equal(actual, expected)
    assert (len(plans), plans.recorded, plans.reused, plans.fallbacks, plans.mismatches) == (
        2,
        2,
        2,
        0,
        0,
    )


@pytest.mark.parametrize("policy", [set(), {aten._softmax}, {aten.mm}, {aten.sin, aten.mul}])
def test_reused_plans_with_nested_checkpoints(policy):
    # Plans for the outer region and for a selective region inside it; the inner one runs in the
    # outer forward (reused: no outer mode), in the outer rerun (under the replay mode: its own
    # signature) and plainly. Also inside a full checkpoint around everything.
    x = torch.randn(5, 6, requires_grad=True)
    w = torch.randn(6, 6, requires_grad=True)
    plans = SelectivePlans()

    def unused(u):
        return (u @ w).exp()

    def inner(u):
        return (u @ w).softmax(-1) @ w

    def outer(t):
        a = (t @ w).sin()
        checkpoint(unused, a * 3)
        h = selective_checkpoint(inner, a.cos(), policy={aten._softmax}, plans=plans)
        return h.tanh() + a

    expected = grads_of(lambda: outer(x), [x, w])
    for step in range(3):
        assert_bitwise(
            expected,
            grads_of(lambda: selective_checkpoint(outer, x, policy=policy, plans=plans), [x, w]),
        )
        assert_bitwise(
            expected,
            grads_of(
                lambda: checkpoint(
                    lambda t: selective_checkpoint(outer, t, policy=policy, plans=plans), x
                ),
                [x, w],
            ),
        )
    assert plans.reused > 0 and plans.fallbacks == plans.mismatches == 0
    assert not saved_hooks_installed()


def test_plans_that_die_with_a_function_made_per_call_are_named_once():
    import warnings

    plans = SelectivePlans()
    linear = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            selective_checkpoint(
                lambda t: linear(t).tanh(), x, policy=save_matmuls, plans=plans
            ).sum().backward()
    messages = [str(w.message) for w in caught]
    assert (plans.recorded, plans.reused) == (3, 0)
    assert len(messages) == 1 and "2 calls recorded a plan and none reused one" in messages[0]
    assert (
        "<lambda>), a new object at every call" in messages[0]
        and "Define the function once" in messages[0]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one function, defined once: reused, nothing to say
        plans = SelectivePlans()
        block = lambda t: linear(t).tanh()  # noqa: E731
        for _ in range(3):
            selective_checkpoint(block, x, policy=save_matmuls, plans=plans).sum().backward()
    assert (plans.recorded, plans.reused) == (1, 2)
