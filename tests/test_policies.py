"""Selective checkpointing (ckptlib.policies): gradients, what is replayed, and when the cache dies."""
from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from ckptlib.checkpoint import CheckpointError, checkpoint, is_recomputing
from ckptlib.memory import MemoryMeter
from ckptlib.models import TransformerBlock
from ckptlib.policies import (
    CostProfile, OpCall, OpCost, choose_ops, measure_op_costs, megatron_attention, policy_from_costs,
    save_matmuls, selective_checkpoint, selective_contexts,
)

from tests.test_checkpoint import UNARY, assert_bitwise, grads_of, saved_hooks_installed

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
    result = [x.grad.clone(), *(p.grad.clone() for p in block.parameters())]
    x.grad = None
    block.zero_grad(set_to_none=True)
    return result


def plain(block, x):
    return block(x)


def assert_bitwise_equal(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert torch.equal(a, e)


POLICIES = {
    "save_matmuls": save_matmuls,
    "megatron_attention": megatron_attention,
    "nothing (full checkpoint)": set(),
    "everything": lambda op, *args, **kwargs: True,
    "views and in-place ops only": {aten.view, aten.t, aten.transpose, aten.expand, aten._unsafe_view,
                                    aten.div_, aten.bernoulli_},
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
    assert_bitwise_equal(grads(lambda b, inp: selective_checkpoint(b, inp, policy=policy), block, x), expected)


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
        (actual,) = torch.autograd.grad(selective_checkpoint(fn, x, policy={aten.rand_like}).sum(), x)
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
        selective_checkpoint(fn, x, policy={aten.rand_like}, preserve_rng_state=False).sum().backward()
    assert counter.recompute["rand_like"] == 1


def test_output_modified_in_place_after_saving_is_recomputed():
    w = torch.randn(8, 8, requires_grad=True)

    def fn(t):
        y = t @ w
        y.mul_(3)            # the cached mm output is now 3x the mm: stale
        return y.sin()

    x = torch.randn(4, 8, requires_grad=True)
    expected = torch.autograd.grad(fn(x).sum(), (x, w))
    forward_mode, recompute_mode = selective_contexts({aten.mm})
    out = checkpoint(fn, x, context_fn=lambda: (forward_mode, recompute_mode))
    assert forward_mode.cache.saved[aten.mm.default] == {}   # dropped when forward ended
    with OpCounter() as counter:
        actual = torch.autograd.grad(out.sum(), (x, w))
    assert_bitwise_equal(list(actual), list(expected))
    assert counter.recompute["mm"] == 1


def test_view_of_saved_output_modified_in_place_later():
    def fn(t):
        y = t * 2            # mul by a number saves nothing, so y may be modified in place
        y[0].zero_()         # through a view of the saved output
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
        assert meter.live_bytes == 2 * 64 * 64 * 4   # the first mm in the cache, the output
        del out
        assert meter.live_bytes == 0


def test_changed_control_flow_raises():
    calls = []

    def fn(t):
        calls.append(None)
        if len(calls) > 1:   # one more mm in the recomputation
            with torch.no_grad():
                t @ t
        return (t @ t).relu()

    x = torch.randn(4, 4, requires_grad=True)
    out = selective_checkpoint(fn, x, policy=save_matmuls)
    with pytest.raises(CheckpointError, match=r"recomputation called aten.mm.default 2 times, the forward"):
        out.sum().backward()


def test_changed_shapes_raise():
    sizes = [4, 2]

    def fn(t):
        with torch.no_grad():   # nothing saved here, so ckptlib.checkpoint's own checks cannot see it
            scale = (t[: sizes.pop(0)] @ t.T).sum()
        return t.sin() * scale

    x = torch.randn(4, 4, requires_grad=True)
    out = selective_checkpoint(fn, x, policy=save_matmuls)
    with pytest.raises(CheckpointError, match=r"call #0 of aten.mm.default got inputs of shapes"):
        out.sum().backward()


@pytest.mark.parametrize("policy, message", [
    ({torch.mm}, "not an aten op"),
    (["aten.mm"], "not an aten op"),
    ("aten.mm", "must be a callable"),
])
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
    assert (first.calls, first.output_bytes, relu.output_bytes, last.output_bytes) == (1, 4096, 4096, 0)
    assert first.time_s > 0 and relu.time_s > 0
    # The last mm starts after autograd saved its last tensor: a rerun stops before it.
    assert last.time_s == 0
    assert profile.activation_bytes == 16 * 64 * 4     # relu's output; x and the weights are no activations
    assert "aten.mm.default(16x32, 32x64)" in str(profile)


def test_choose_ops_is_greedy_by_time_per_byte_and_deterministic():
    def call(op):
        return OpCall(op, ((4, 4),))

    ops = {call(aten.addmm.default): OpCost(4, 0.050, 9000), call(aten.gelu.default): OpCost(1, 0.004, 4000),
           call(aten.mul.Tensor): OpCost(1, 0.001, 4000), call(aten.add.Tensor): OpCost(2, 0.0005, 2000),
           call(aten.clone.default): OpCost(2, 0.0005, 2000), call(aten.sin.default): OpCost(1, 0.0, 10)}
    profile = CostProfile(ops, activation_bytes=30000)
    assert choose_ops(profile, 9000).chosen == {call(aten.addmm.default)}
    # gelu fits, mul does not any more; add and clone tie on time per byte: name order, only add fits.
    policy = choose_ops(profile, 15000)
    assert policy.chosen == {call(aten.addmm.default), call(aten.gelu.default), call(aten.add.Tensor)}
    assert policy.used_bytes == 15000
    assert choose_ops(profile, 10**9).chosen == set(ops) - {call(aten.sin.default)}   # saves no time
    assert choose_ops(profile, 0).chosen == frozenset()
    assert choose_ops(CostProfile(dict(reversed(ops.items())), 30000), 15000) == policy
    assert policy(aten.gelu.default, torch.zeros(4, 4)) and not policy(aten.gelu.default, torch.zeros(4, 5))


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
    torch_y = torch_checkpoint(block, x, use_reentrant=False, context_fn=functools.partial(
        create_selective_checkpoint_contexts, [aten._softmax.default]))
    with OpCounter() as theirs:      # torch's rerun is not ckptlib's: all its ops count as "other"
        torch_y.sum().backward()
    ran = ours.recompute
    assert ran["_softmax"] == ran["masked_fill"] == ran["mul"] == 0
    assert ran["bmm"] == 1                                     # weights @ v: its output is needed
    assert ran["addmm"] == 3 and ran["native_layer_norm"] == 2   # the rest still reruns
    ours_total = ours.recompute + ours.other
    for op, skipped in {"masked_fill": 1, "bmm": 1, "mul": 1}.items():
        assert theirs.other[op] - ours_total[op] == skipped, op


@pytest.mark.parametrize("policy", [{aten._softmax}, {aten.clone}, {aten.addmm, aten.add}, save_matmuls])
def test_skipping_keeps_gradients_bitwise(policy):
    block = make_block(0.1)
    x = torch.randn(2, 16, 32, requires_grad=True)
    expected = grads(plain, block, x)
    actual = grads(lambda b, inp: selective_checkpoint(b, inp, policy=policy), block, x)
    assert_bitwise_equal(actual, expected)


def test_no_skipping_once_the_cache_is_gone():
    # The plan skips mm because softmax is replayed. A first backward (through the softmax) frees
    # the cache; a second one (through b, which saved s but does not lead back to the softmax)
    # reruns softmax, which then needs mm's real output: the plan must not be used again.
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)

    def f(t):
        s = (t @ w).softmax(-1)
        return s * 2, s.detach() * t

    def both_grads(run):
        a, b = run()
        return torch.autograd.grad(a.sum(), (x, w)) + torch.autograd.grad(b.sum(), (x,))

    expected = both_grads(lambda: f(x))
    actual = both_grads(lambda: selective_checkpoint(f, x, policy={aten._softmax}))
    assert_bitwise_equal(list(actual), list(expected))


def test_plan_is_made_only_when_the_checkpoint_reports_saved_tensors():
    # With torch.utils.checkpoint, nobody tells the modes what autograd saved: nothing is skipped.
    forward_mode, recompute_mode = selective_contexts({aten._softmax})
    block = make_block(0.0)
    x = torch.randn(2, 16, 32, requires_grad=True)
    y = torch_checkpoint(block, x, use_reentrant=False, context_fn=lambda: (forward_mode, recompute_mode))
    assert forward_mode.cache.skippable is None
    with OpCounter() as counter:
        y.sum().backward()
    assert counter.other["masked_fill"] == 2       # rerun and backward
    forward_mode, _ = selective_contexts({aten._softmax})
    assert callable(forward_mode.observe_saved_tensors())


# ---------------------------------------------------------------------------
# Random chains of ops, random policies
# ---------------------------------------------------------------------------

POLICY_OPS = [aten.mm, aten.sin, aten.exp, aten.tanh, aten.relu, aten.mul, aten._softmax, aten.gelu,
              aten.native_layer_norm, aten.clone, aten.clamp, aten.bernoulli_, aten.div_, aten.expand,
              aten.slice, aten.transpose]


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
    actual = grads_of(lambda: run(lambda f, t: selective_checkpoint(f, t, policy=policy)), [x], seed=1)
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
    profile.graph.calls = [call._replace(seconds=seconds.get(call.key[0].overloadpacket.__name__, 0.0))
                           for call in profile.graph.calls]
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
    assert not choose_ops(profile, budget_bytes=10**9, worth=2.0).chosen   # nothing saves 2x the average
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
    assert_bitwise(expected, grads_of(lambda: selective_checkpoint(outer, x, policy=policy), [x, w]))
    assert_bitwise(expected, grads_of(
        lambda: checkpoint(lambda t: selective_checkpoint(outer, t, policy=policy), x), [x, w]))
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


@pytest.mark.parametrize("policy", [
    set(), save_matmuls, megatron_attention, {aten._softmax, aten.clone, aten.add}, {aten.native_layer_norm},
    {aten._scaled_dot_product_flash_attention_for_cpu}, lambda op, *args, **kwargs: True,
], ids=["nothing", "save_matmuls", "megatron", "softmax_clone_add", "layer_norm", "fused_attention", "everything"])
@pytest.mark.parametrize("model", ["encoder_layer", "fused_attention", "embedding_loss"])
def test_skipping_on_other_modules_matches_plain_bitwise(model, policy):
    torch.manual_seed(0)
    if model == "embedding_loss":
        embedding = torch.nn.Embedding(50, 32)
        fn, inp, params = functools.partial(token_loss, embedding), torch.randint(50, (2, 8)), [embedding.weight]
    else:
        module = (torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
                  if model == "encoder_layer" else FusedAttention())
        fn, inp, params = module, torch.randn(2, 8, 32, requires_grad=True), list(module.parameters())
    tensors = ([inp] if inp.requires_grad else []) + params
    expected = grads_of(lambda: fn(inp), tensors, seed=1)
    assert_bitwise(expected, grads_of(lambda: selective_checkpoint(fn, inp, policy=policy), tensors, seed=1))
