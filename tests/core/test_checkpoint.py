"""ckptlib.checkpoint against plain autograd (bitwise) and torch.utils.checkpoint
(non-reentrant)."""

from __future__ import annotations

import contextlib
import gc
import math
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import ckptlib
from ckptlib import CheckpointError, checkpoint, record_trace
from ckptlib import RecomputeAgain, is_recomputing, peek_saved
from ckptlib.selective.modes import RecomputesAgainOnRequest
from tests._grads import assert_bitwise_equal


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


class Block(nn.Module):
    """A pre-LN Transformer block written with explicit ops (attention scores are saved)."""

    def __init__(self, d: int = 16, heads: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(s, s, dtype=torch.bool).triu(1)
        att = F.dropout(
            scores.masked_fill(mask, float("-inf")).softmax(-1), self.dropout, self.training
        )
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, s, d))
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))), self.dropout, self.training)


def mlp(width: int = 8, depth: int = 3) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def grads_of(run, tensors, seed: int = 0):
    """Output and gradients of ``run()`` w.r.t. ``tensors``, with the RNG seeded first."""
    torch.manual_seed(seed)
    out = run()
    loss = out.float().square().sum() if isinstance(out, torch.Tensor) else out
    return out.detach(), torch.autograd.grad(loss, tensors)


def assert_bitwise(a, b) -> None:
    """Two ``grads_of`` results, output then gradients, equal to the bit; NaN equal to NaN, since
    a random op chain may overflow."""
    (out_a, grads_a), (out_b, grads_b) = a, b
    assert_bitwise_equal([out_a, *grads_a], [out_b, *grads_b], equal_nan=True)


def three_ways(fn, inputs, params=()):
    """(plain, ckptlib, torch non-reentrant) results for ``fn(*inputs)``."""
    tensors = [t for t in (*inputs, *params) if t.requires_grad]
    plain = grads_of(lambda: fn(*inputs), tensors)
    ours = grads_of(lambda: checkpoint(fn, *inputs), tensors)
    theirs = grads_of(lambda: torch_checkpoint(fn, *inputs, use_reentrant=False), tensors)
    return plain, ours, theirs


def saved_hooks_installed() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


# ---------------------------------------------------------------------------
# bitwise equality on a matrix of models
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(4, 8), (1, 8), (3, 5, 8)])
def test_mlp_bitwise_equal_to_plain_and_torch(shape):
    torch.manual_seed(0)
    model = mlp()
    x = torch.randn(*shape, requires_grad=True)
    plain, ours, theirs = three_ways(model, (x,), tuple(model.parameters()))
    assert_bitwise(plain, ours)
    assert_bitwise(theirs, ours)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_transformer_block_bitwise_with_dropout(dropout):
    torch.manual_seed(0)
    block = Block(dropout=dropout).train()
    x = torch.randn(2, 6, 16, requires_grad=True)
    plain, ours, theirs = three_ways(block, (x,), tuple(block.parameters()))
    assert_bitwise(plain, ours)
    assert_bitwise(theirs, ours)


def test_inplace_ops_and_views_inside_region():
    def fn(x, w):
        h = x @ w
        h.relu_()                      # in-place on an intermediate
        v = h.view(-1)[: h.numel() // 2]  # a view of it
        t = h.t().contiguous().sin()   # transpose, then a copy
        g = h.sin()
        g.mul_(2.0)                    # in-place on a tensor no backward formula saved
        return v.sum() + t.sum() + g.exp().sum()

    torch.manual_seed(0)
    x = torch.randn(4, 6, requires_grad=True)
    w = torch.randn(6, 6, requires_grad=True)
    plain, ours, theirs = three_ways(fn, (x, w))
    assert_bitwise(plain, ours)
    assert_bitwise(theirs, ours)


def test_view_of_input_as_input():
    torch.manual_seed(0)
    base = torch.randn(6, 6, requires_grad=True)
    fn = lambda a: (a.sin() * a).cumsum(0)  # noqa: E731
    plain = grads_of(lambda: fn(base[1:, ::2]), [base])
    ours = grads_of(lambda: checkpoint(fn, base[1:, ::2]), [base])
    assert_bitwise(plain, ours)


def test_kwargs_and_nested_structures_pass_through_untouched():
    def fn(inputs, *, scale, name, extra=None, flag=3):
        assert name == "block" and extra is None and flag == 3
        h = inputs["x"] * scale + inputs["pair"][1].exp()
        return {"out": h.tanh(), "tag": name, "count": flag, "nothing": None, "pair": (h, 7)}

    x = torch.randn(3, requires_grad=True)
    y = torch.randn(3, requires_grad=True)
    inputs = {"x": x, "pair": ("left", y)}
    out = checkpoint(fn, inputs, scale=torch.tensor(2.0), name="block", extra=None)
    assert (
        out["tag"] == "block"
        and out["count"] == 3
        and out["nothing"] is None
        and out["pair"][1] == 7
    )
    (out["out"].sum() + out["pair"][0].sum()).backward()
    gx, gy = x.grad.clone(), y.grad.clone()
    x.grad = y.grad = None
    ref = fn(inputs, scale=torch.tensor(2.0), name="block")
    (ref["out"].sum() + ref["pair"][0].sum()).backward()
    assert torch.equal(gx, x.grad) and torch.equal(gy, y.grad)


def test_only_some_outputs_used():
    torch.manual_seed(0)
    x = torch.randn(5, requires_grad=True)
    fn = lambda t: (t.sin(), t.cos() * t, t.exp())  # noqa: E731
    plain = grads_of(lambda: fn(x)[1], [x])
    ours = grads_of(lambda: checkpoint(fn, x)[1], [x])
    theirs = grads_of(lambda: torch_checkpoint(fn, x, use_reentrant=False)[1], [x])
    assert_bitwise(plain, ours)
    assert_bitwise(theirs, ours)


def test_bf16_autocast_on_cpu_is_replayed():
    torch.manual_seed(0)
    model = mlp(16, 2)
    x = torch.randn(4, 16, requires_grad=True)
    tensors = [x, *model.parameters()]

    def run(wrap):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return wrap(model, x)

    plain = grads_of(lambda: run(lambda m, t: m(t)), tensors)
    ours = grads_of(lambda: run(checkpoint), tensors)
    theirs = grads_of(
        lambda: run(lambda m, t: torch_checkpoint(m, t, use_reentrant=False)), tensors
    )
    assert plain[0].dtype == torch.bfloat16
    assert_bitwise(plain, ours)
    assert_bitwise(theirs, ours)


def test_backward_outside_autocast_still_recomputes_in_bf16():
    # The recomputation runs in backward, outside the autocast block: the state must be replayed.
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    x = torch.randn(2, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = checkpoint(lambda t: lin(t).relu(), x)
    out.float().sum().backward()  # would raise a dtype-mismatch CheckpointError without replay
    assert x.grad is not None


# ---------------------------------------------------------------------------
# nesting
# ---------------------------------------------------------------------------


def nested_fn(inner_wrap):
    lin = [nn.Linear(6, 6) for _ in range(4)]

    def inner(t):
        return lin[1](lin[0](t).tanh()).sin()

    def outer(t):
        h = lin[2](t).relu()
        h = inner_wrap(inner, h)
        return lin[3](h).tanh()

    params = [p for layer in lin for p in layer.parameters()]
    return outer, params


@pytest.mark.parametrize(
    "outer_wrap,inner_wrap",
    [
        (checkpoint, checkpoint),
        (checkpoint, lambda f, t: torch_checkpoint(f, t, use_reentrant=False)),
        (lambda f, t: torch_checkpoint(f, t, use_reentrant=False), checkpoint),
    ],
    ids=["ckptlib-in-ckptlib", "torch-in-ckptlib", "ckptlib-in-torch"],
)
def test_nested_checkpoints(outer_wrap, inner_wrap):
    torch.manual_seed(0)
    outer, params = nested_fn(inner_wrap)
    x = torch.randn(3, 6, requires_grad=True)
    torch.manual_seed(0)
    plain_outer, plain_params = nested_fn(lambda f, t: f(t))
    plain = grads_of(lambda: plain_outer(x), [x, *plain_params])
    nested = grads_of(lambda: outer_wrap(outer, x), [x, *params])
    assert_bitwise(plain, nested)


def test_nested_region_keeps_no_activation_of_outer():
    # The inner checkpoint's input is an activation of the outer region: it must be dropped too.
    x = torch.randn(64, requires_grad=True)
    refs = []

    def inner(t):
        return t.sin().cos()

    def outer(t):
        h = t.exp()
        refs.append(StorageWeakRef(h.untyped_storage()))
        return checkpoint(inner, h).tanh()

    out = checkpoint(outer, x)
    gc.collect()
    assert refs[0].expired(), "outer activation (inner's input) is still alive after forward"
    out.sum().backward()
    x_grad = x.grad.clone()
    x.grad = None
    outer_plain = lambda t: t.exp().sin().cos().tanh()  # noqa: E731
    outer_plain(x).sum().backward()
    assert torch.equal(x_grad, x.grad)


# ---------------------------------------------------------------------------
# backward variants
# ---------------------------------------------------------------------------


def counting(fn):
    calls = {"n": 0}

    def wrapped(*args, **kwargs):
        calls["n"] += 1
        return fn(*args, **kwargs)

    return wrapped, calls


def test_recompute_lazily_exactly_once_per_backward_and_retain_graph_twice():
    x = torch.randn(5, requires_grad=True)
    fn, calls = counting(lambda t: t.sin().exp().cos())
    out = checkpoint(fn, x).sum()
    assert calls["n"] == 1
    out.backward(retain_graph=True)
    assert calls["n"] == 2
    first = x.grad.clone()
    out.backward()
    assert calls["n"] == 3
    assert torch.equal(x.grad, 2 * first)


def test_grad_on_subset_of_inputs_releases_unused_recomputed_tensors():
    x = torch.randn(100, requires_grad=True)
    y = torch.randn(100, requires_grad=True)
    recomputed: list[StorageWeakRef] = []

    def fn(a, b):
        e = b.exp()  # ExpBackward is not on the path to x: its saved result is never unpacked
        if is_recomputing():
            recomputed.append(StorageWeakRef(e.untyped_storage()))
        return a.sin() * e

    out = checkpoint(fn, x, y).sum()
    with record_trace() as trace:
        (gx,) = torch.autograd.grad(out, [x], retain_graph=True)
    assert torch.equal(gx, torch.autograd.grad((x.sin() * y.exp()).sum(), [x])[0])
    assert trace.count("recompute") == 1 and trace.count("release") == 1
    gc.collect()
    assert len(recomputed) == 1 and recomputed[0].expired(), (
        "unused recomputed tensor outlived backward"
    )
    (gy,) = torch.autograd.grad(
        out, [y]
    )  # the graph was retained: a second backward recomputes again
    assert torch.equal(gy, torch.autograd.grad((x.sin() * y.exp()).sum(), [y])[0])
    assert len(recomputed) == 2


def test_double_backward_create_graph():
    torch.manual_seed(0)
    x = torch.randn(4, requires_grad=True)
    fn = lambda t: (t.sin() * t.exp()).tanh()  # noqa: E731

    def second_derivative(wrap):
        out = wrap(fn, x).sum()
        (g,) = torch.autograd.grad(out, x, create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), x)
        return g.detach(), gg

    plain = second_derivative(lambda f, t: f(t))
    ours = second_derivative(checkpoint)
    theirs = second_derivative(lambda f, t: torch_checkpoint(f, t, use_reentrant=False))
    assert torch.equal(plain[0], ours[0]) and torch.equal(plain[1], ours[1])
    assert torch.equal(theirs[1], ours[1])


def test_backward_from_another_thread():
    torch.manual_seed(0)
    model = mlp()
    x = torch.randn(4, 8, requires_grad=True)
    out = checkpoint(model, x).sum()
    errors: list[BaseException] = []

    def run():
        try:
            out.backward()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=30)
    assert not errors and not thread.is_alive()
    got = x.grad.clone()
    x.grad = None
    model.zero_grad()
    model(x).sum().backward()
    assert torch.equal(got, x.grad)


def test_plain_call_under_no_grad_and_inference_mode():
    fn, calls = counting(lambda t: t * 2)
    x = torch.randn(3, requires_grad=True)
    with torch.no_grad():
        out = checkpoint(fn, x)
    assert not out.requires_grad and calls["n"] == 1
    with torch.inference_mode():
        assert torch.equal(checkpoint(fn, x), x * 2)


def test_region_that_saves_nothing_is_never_recomputed():
    fn, calls = counting(lambda t: t + 1)  # add saves no tensor
    x = torch.randn(3, requires_grad=True)
    out = checkpoint(fn, x)
    out.sum().backward()
    assert calls["n"] == 1
    assert torch.equal(x.grad, torch.ones(3))


def test_early_stop_skips_ops_after_the_last_saved_tensor():
    reached = {"tail": 0}

    def fn(t):
        h = t.sin().cos()        # the last op that saves something
        reached["tail"] += 1
        return (h + 1) * 2.0     # add / mul-by-scalar save nothing

    x = torch.randn(4, requires_grad=True)
    checkpoint(fn, x).sum().backward()
    assert reached["tail"] == 1  # forward only: recomputation stopped after cos saved its input
    reached["tail"] = 0
    checkpoint(fn, x, early_stop=False).sum().backward()
    assert reached["tail"] == 2


def test_checkpointed_function_that_sees_requires_grad_false_input():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)  # no grad on the input, only on the parameters
    checkpoint(lin, x).sum().backward()
    w_grad = lin.weight.grad.clone()
    lin.zero_grad()
    lin(x).sum().backward()
    assert torch.equal(w_grad, lin.weight.grad)


# ---------------------------------------------------------------------------
# RNG
# ---------------------------------------------------------------------------


def test_dropout_matches_and_callers_rng_stream_does_not_move():
    x = torch.randn(64, requires_grad=True)
    fn = lambda t: F.dropout(t.sin(), 0.5, True).exp()  # noqa: E731

    torch.manual_seed(3)
    fn(x).sum().backward()
    after_plain = torch.rand(3)
    plain_grad, x.grad = x.grad.clone(), None

    torch.manual_seed(3)
    checkpoint(fn, x).sum().backward()
    after_ckpt = torch.rand(3)
    assert torch.equal(plain_grad, x.grad)
    assert torch.equal(after_plain, after_ckpt), "recomputation moved the caller's RNG stream"


def test_preserve_rng_state_false_draws_a_different_mask():
    x = torch.randn(256, requires_grad=True)
    fn = lambda t: F.dropout(t.sin(), 0.5, True).exp()  # noqa: E731
    torch.manual_seed(3)
    fn(x).sum().backward()
    plain_grad, x.grad = x.grad.clone(), None
    torch.manual_seed(3)
    checkpoint(fn, x, preserve_rng_state=False).sum().backward()
    assert not torch.equal(plain_grad, x.grad)


def test_is_recomputing_flag():
    seen = []
    x = torch.randn(3, requires_grad=True)
    checkpoint(lambda t: (seen.append(is_recomputing()), t.sin())[1], x).sum().backward()
    assert seen == [False, True] and not is_recomputing()


# ---------------------------------------------------------------------------
# lifetimes (StorageWeakRef sees what autograd keeps; a Python weakref does not)
# ---------------------------------------------------------------------------


def test_no_intermediate_survives_forward_and_recomputed_ones_die_after_backward():
    refs: list[StorageWeakRef] = []

    def fn(t):
        a = t.sin()
        refs.append(StorageWeakRef(a.untyped_storage()))
        b = a.exp()
        refs.append(StorageWeakRef(b.untyped_storage()))
        return b.cos()  # recomputation stops inside cos, once its input is saved

    x = torch.randn(1000, requires_grad=True)
    out = checkpoint(fn, x)
    gc.collect()
    assert all(r.expired() for r in refs), "an activation from inside fn outlived forward"
    refs.clear()
    captured: list[StorageWeakRef] = []

    def grab(grad):
        captured.append(StorageWeakRef(grad.untyped_storage()))

    out.register_hook(grab)
    out.sum().backward()
    gc.collect()
    assert len(refs) == 2 and all(r.expired() for r in refs), (
        "a recomputed tensor outlived backward"
    )


def test_recomputed_tensor_released_right_after_its_use():
    # b is recomputed for ExpBackward; it must be gone before the backward reaches x.
    x = torch.randn(1000, requires_grad=True)
    refs: list[StorageWeakRef] = []
    expired_when_x_grad_ready: list[bool] = []

    def fn(t):
        b = t.sin().exp()
        if is_recomputing():
            refs.append(StorageWeakRef(b.untyped_storage()))
        return b.cos() * 3.0

    out = checkpoint(fn, x)
    x.register_hook(lambda grad: expired_when_x_grad_ready.append(refs[0].expired()))
    out.sum().backward()
    assert expired_when_x_grad_ready == [True]


def live_tensor_storages() -> int:
    gc.collect()
    return sum(1 for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor))


def test_live_tensor_count_flat_over_many_training_steps():
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(2, 6, 16)

    def step():
        opt.zero_grad(set_to_none=True)
        out = x
        for block in model:
            out = checkpoint(block, out)
        out.square().mean().backward()
        opt.step()

    for _ in range(3):
        step()
    before = live_tensor_storages()
    for _ in range(20):
        step()
    assert live_tensor_storages() == before


def test_frame_is_freed_with_the_graph():
    x = torch.randn(10, requires_grad=True)
    out = checkpoint(lambda t: t.sin().exp(), x)
    with peek_saved() as peek:
        _ = out.grad_fn._saved_result
        info = peek.take()
    assert info is not None and info.recompute_count == 0
    out.sum().backward()
    with pytest.raises(RuntimeError, match="freed|backward through the graph a second time"):
        _ = out.grad_fn._saved_result


# ---------------------------------------------------------------------------
# misuse: clear errors, nothing left behind
# ---------------------------------------------------------------------------


def test_non_callable_fn_is_a_type_error():
    with pytest.raises(TypeError, match="callable"):
        checkpoint(torch.randn(3), torch.randn(3))
    with pytest.raises(ValueError, match="non-reentrant"):
        checkpoint(torch.sin, torch.randn(3), use_reentrant=True)
    assert not saved_hooks_installed()


def test_shape_mismatch_names_tensor_and_metadata():
    x = torch.randn(6, requires_grad=True)
    state = {"n": 6}

    def fn(t):
        return t[: state["n"]].sin()

    out = checkpoint(fn, x)
    state["n"] = 4  # global state changes between forward and backward
    with pytest.raises(CheckpointError) as info:
        out.sum().backward()
    message = str(info.value)
    assert "#0" in message and "6 float32" in message and "4 float32" in message
    assert "non-deterministic" in message and "global state" in message
    assert not saved_hooks_installed()


def test_dtype_mismatch():
    x = torch.randn(4, requires_grad=True)
    state = {"dtype": torch.float32}
    out = checkpoint(lambda t: t.to(state["dtype"]).sin(), x)
    state["dtype"] = torch.float64
    with pytest.raises(CheckpointError, match="float64"):
        out.sum().backward()


def test_fewer_and_more_saved_tensors():
    x = torch.randn(4, requires_grad=True)
    state = {"extra": True}

    def fn(t):
        h = t.sin()
        if state["extra"]:
            h = h.exp()
        return h * 1.0

    out = checkpoint(fn, x)
    state["extra"] = False
    with pytest.raises(CheckpointError, match="fewer tensors"):
        out.sum().backward()

    state["extra"] = False
    out = checkpoint(fn, x, early_stop=False)
    state["extra"] = True
    with pytest.raises(CheckpointError, match="more tensors"):
        out.sum().backward()
    assert not saved_hooks_installed()


def test_input_modified_in_place_after_forward():
    x = torch.randn(4, requires_grad=True)
    h = x * 1.0
    out = checkpoint(torch.sin, h)
    with torch.no_grad():
        h.add_(1.0)
    with pytest.raises(
        (CheckpointError, RuntimeError), match="modified (by an inplace operation|in place)"
    ):
        out.sum().backward()


class DoubleRead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        ctx.save_for_backward(t)
        return t * 2

    @staticmethod
    def backward(ctx, grad):
        (t,) = ctx.saved_tensors
        (t,) = ctx.saved_tensors  # a second unpack of the same tensor
        return grad * 2


def test_unpack_twice_in_one_backward_is_an_error():
    x = torch.randn(3, requires_grad=True)
    out = checkpoint(lambda t: DoubleRead.apply(t.sin()), x)
    with pytest.raises(CheckpointError, match="unpacked twice"):
        out.sum().backward()
    assert not saved_hooks_installed()


def test_error_inside_forward_leaves_no_hook_and_no_trace():
    def broken(t):
        t.sin()
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        checkpoint(broken, torch.randn(3, requires_grad=True))
    assert not saved_hooks_installed()
    # and the library still works afterwards
    x = torch.randn(3, requires_grad=True)
    checkpoint(torch.sin, x).sum().backward()
    assert torch.equal(x.grad, x.detach().cos())


def test_error_in_recomputation_releases_what_was_recomputed():
    x = torch.randn(1000, requires_grad=True)
    state = {"fail": False}
    refs: list[StorageWeakRef] = []

    def fn(t):
        a = t.sin()
        if is_recomputing():
            refs.append(StorageWeakRef(a.untyped_storage()))
        if state["fail"]:
            raise RuntimeError("changed")
        return a.exp()

    out = checkpoint(fn, x)
    state["fail"] = True
    with pytest.raises(RuntimeError, match="changed"):
        out.sum().backward()
    gc.collect()
    assert refs and all(r.expired() for r in refs)
    assert not saved_hooks_installed()


# ---------------------------------------------------------------------------
# trace for learners, peek, fallback path
# ---------------------------------------------------------------------------


def test_trace_events_in_order():
    x = torch.randn(4, requires_grad=True)

    def fn(t):
        return t.sin().exp() + 1

    with record_trace() as trace:
        out = checkpoint(fn, x)
        out.sum().backward()
    kinds = [e.kind for e in trace.events]
    assert kinds == ["pack", "pack", "forward_done", "recompute", "unpack", "unpack"]
    packs = [e for e in trace.events if e.kind == "pack"]
    assert [p.op for p in packs] == ["sin", "exp"] and packs[0].meta.nbytes == 16
    unpacks = [e for e in trace.events if e.kind == "unpack"]
    assert [u.op for u in unpacks] == ["ExpBackward0", "SinBackward0"]
    assert "fn@" in str(trace) and repr(trace).startswith("CheckpointTrace(")


def test_trace_reports_early_stop():
    with record_trace() as trace:
        checkpoint(
            lambda t: t.sin().exp().cos(), torch.randn(3, requires_grad=True)
        ).sum().backward()
    # all three saved tensors are needed, so recomputation runs to the end
    assert trace.count("early_stop") == 0
    x = torch.randn(3, requires_grad=True)
    first = checkpoint(lambda t: (t.sin(), t.exp()), x)[0]  # exp's node dies with the unused output
    with record_trace() as trace:
        first.sum().backward()
    assert trace.count("early_stop") == 1
    assert "skipped 1 later saves" in str(trace)


def test_debug_prints_trace(capsys):
    checkpoint(torch.sin, torch.randn(2, requires_grad=True), debug=True).sum().backward()
    printed = capsys.readouterr().out
    assert (
        "pack #0 sin" in printed and "recompute" in printed and "unpack #0 SinBackward0" in printed
    )


def test_unpack_outside_backward_recomputes_for_that_read_only():
    x = torch.randn(5, requires_grad=True)
    fn, calls = counting(lambda t: t.exp())
    out = checkpoint(fn, x)
    assert torch.equal(out.grad_fn._saved_result, x.exp())  # a hand read triggers a recompute
    assert calls["n"] == 2
    out.sum().backward()
    assert torch.equal(x.grad, x.detach().exp())


def test_inputs_kept_as_saved_tensors_give_plain_gradients_alone_and_nested():
    torch.manual_seed(0)
    model = mlp()
    x = torch.randn(4, 8, requires_grad=True)
    assert_bitwise(grads_of(lambda: model(x), [x]), grads_of(lambda: checkpoint(model, x), [x]))
    x = torch.randn(3, 6, requires_grad=True)
    torch.manual_seed(0)
    outer, params = nested_fn(checkpoint)
    torch.manual_seed(0)
    plain_outer, plain_params = nested_fn(lambda f, t: f(t))
    assert_bitwise(
        grads_of(lambda: plain_outer(x), [x, *plain_params]),
        grads_of(lambda: checkpoint(outer, x), [x, *params]),
    )


def test_public_api_names():
    for name in [
        "checkpoint",
        "CheckpointError",
        "checkpoint_sequential",
        "Plan",
        "selective_checkpoint",
        "MemoryMeter",
        "measure",
        "autograd_graph",
        "MLPChain",
        "TinyTransformer",
    ]:
        assert name in ckptlib.__all__
    assert callable(ckptlib.checkpoint) and issubclass(ckptlib.CheckpointError, RuntimeError)


# ---------------------------------------------------------------------------
# randomised: random chains of ops, random shapes
# ---------------------------------------------------------------------------

UNARY = {
    "sin": torch.sin,
    "exp": lambda t: t.clamp(max=5).exp(),
    "tanh": torch.tanh,
    "relu": F.relu,
    "square": lambda t: t * t,
    "softmax": lambda t: t.softmax(-1),
    "gelu": F.gelu,
    "transpose_mm": lambda t: t @ t.transpose(-2, -1) @ t if t.dim() >= 2 else t * 2,
    "inplace_mul": lambda t: t.clone().mul_(1.5),
    "slice": lambda t: t[..., :1].expand_as(t).sin(),
    "layer_norm": lambda t: F.layer_norm(t, t.shape[-1:]),
    "dropout": lambda t: F.dropout(t, 0.25, True),
}


@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(st.sampled_from(sorted(UNARY)), min_size=1, max_size=6),
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    split=st.integers(0, 6),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_random_op_chains_match_plain_bitwise(ops, shape, split, dtype):
    split = min(split, len(ops))
    x = torch.randn(*shape, dtype=dtype, requires_grad=True)

    def chain(t, names):
        for name in names:
            t = UNARY[name](t)
        return t

    def head(t):
        return chain(t, ops[:split])

    def run(wrap):
        return chain(wrap(head, x), ops[split:])

    plain = grads_of(lambda: run(lambda f, t: f(t)), [x], seed=1)
    ours = grads_of(lambda: run(checkpoint), [x], seed=1)
    assert_bitwise(plain, ours)
    assert not saved_hooks_installed()


def test_frame_and_its_inputs_die_during_backward_not_after():
    # Two checkpoints in a chain: the first one's input (an activation of an earlier op) must be
    # freed as soon as the first region's backward is done, while the backward still runs.
    x = torch.randn(1000, requires_grad=True)
    h = x.exp()
    h_ref = StorageWeakRef(h.untyped_storage())
    out = checkpoint(torch.sin, checkpoint(torch.cos, h).exp())
    del h
    seen: list[bool] = []
    x.register_hook(lambda grad: seen.append(h_ref.expired()))
    out.sum().backward()
    # ExpBackward of x.exp() saved h itself, so h lives until that node ran; x's hook runs after.
    assert seen == [True]


def test_record_trace_hands_each_event_over_as_it_happens():
    # What a live view (the BackwardStepper) needs: each event while the checkpoint runs, in
    # order, the same objects the trace records.
    seen: list[tuple[str, bool, int]] = []
    outputs: list[torch.Tensor] = []

    def on_event(event) -> None:
        seen.append((event.kind, is_recomputing(), len(outputs)))

    x = torch.randn(3, requires_grad=True)
    with record_trace(on_event=on_event) as trace:
        outputs.append(checkpoint(lambda t: t.sin().exp(), x))
        outputs[0].sum().backward()
    assert [kind for kind, _, _ in seen] == [event.kind for event in trace.events] == [
        "pack", "pack", "forward_done", "recompute", "unpack", "unpack"]
    assert [made_before_return for _, _, made_before_return in seen[:3]] == [
        0,
        0,
        0,
    ]  # inside the call
    assert not any(recomputing for _, recomputing, _ in seen)   # the rerun's packs are not events
    with record_trace() as quiet:      # without on_event: recorded only, as before
        checkpoint(torch.sin, x)
    assert quiet.on_event is None and quiet.count("pack") == 1


def test_an_on_event_that_raises_ends_the_checkpointed_call_and_closes_the_trace():
    def on_event(event) -> None:
        raise RuntimeError("viewer broke")

    x = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="viewer broke"), record_trace(on_event=on_event):
        checkpoint(torch.sin, x)
    assert not saved_hooks_installed() and not ckptlib.core.trace.open_traces


def test_trace_tells_which_dropped_tensors_free_memory():
    layer = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with record_trace() as trace:
        checkpoint(layer, torch.randn(3, 4, requires_grad=True))
    packs = [e for e in trace.events if e.kind == "pack"]
    frees_nothing = ["frees nothing" in e.detail for e in packs]
    assert frees_nothing == [True, True, False]  # the input, weight.t(), then relu's own output
    done = next(e for e in trace.events if e.kind == "forward_done")
    # relu's output is also the region's output: dropping it frees nothing (3 x 4 float32 stay
    # alive)
    assert (
        "0 bytes of activations freed (48 more are the region's output, alive while it is)"
        in done.detail
    )


@pytest.mark.parametrize(
    "returns", ["the saved tensor", "a view of it", "it in a tuple", "something else"]
)
def test_trace_does_not_count_a_saved_tensor_the_region_returns_as_freed(returns):
    def fn(t):
        e = t.exp()          # exp saves its result e (16 bytes), and sin saves e again
        s = e.sin()          # sin's result: saved by nobody
        return {"the saved tensor": e, "a view of it": e.view(2, 2), "it in a tuple": (s, {"e": e}),
                "something else": s * 1.0}[returns]

    with record_trace() as trace:
        out = checkpoint(fn, torch.randn(4, requires_grad=True))
    done = next(e for e in trace.events if e.kind == "forward_done")
    if returns == "something else":
        assert "16 bytes of activations freed;" in done.detail
    else:
        assert (
            "0 bytes of activations freed (16 more are the region's output, alive while it is);"
            in done.detail
        )
    alive = out if isinstance(out, torch.Tensor) else out[1]["e"]
    assert alive.untyped_storage().nbytes() == 16   # it did stay alive


def test_tensors_made_inside_without_grad_free_memory():
    # Dropout's mask and layer norm's mean and rstd need no grad, so autograd calls them leaves; but
    # they are made inside the region, and dropping them frees memory like any activation.
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    fn = lambda v: F.dropout(F.layer_norm(v * 2, (8,)), 0.5, True)  # noqa: E731
    with record_trace() as trace:
        out = checkpoint(fn, x)
    packs = [e for e in trace.events if e.kind == "pack"]
    assert [(e.op, "frees nothing" in e.detail) for e in packs] == [
        ("layer_norm", False), ("layer_norm", False), ("layer_norm", False), ("dropout", False)]
    done = next(e for e in trace.events if e.kind == "forward_done")
    assert (
        "288 bytes of activations freed" in done.detail
    )  # v * 2 and the mask (128 each), mean, rstd (16 each)
    with peek_saved() as peek:
        out.grad_fn._saved_other   # the dropout mask
        mask = peek.take()
    assert (mask.meta.shape, mask.frees_memory) == ((4, 8), True)
    assert_bitwise(grads_of(lambda: checkpoint(fn, x), [x]), grads_of(lambda: fn(x), [x]))


GLOBAL_NORM = nn.BatchNorm1d(8).eval()
GLOBAL_SCALE = torch.full((8,), 3.0)


def scaled_norm_through_globals(v):
    return GLOBAL_NORM(v) * GLOBAL_SCALE * torch.full((8,), 2.0)


class ScaledNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(8).eval()
        self.register_buffer("scale", torch.full((8,), 3.0))

    def forward(self, v):
        return self.norm(v) * self.scale * torch.full((8,), 2.0)


def scaled_norm_through_a_closure():
    norm, scale = nn.BatchNorm1d(8).eval(), torch.full((8,), 3.0)
    return lambda v: norm(v) * scale * torch.full((8,), 2.0)


@pytest.mark.parametrize("reached", ["module", "closure", "globals"])
def test_tensors_from_outside_without_grad_free_nothing(reached):
    fn = {"module": ScaledNorm, "closure": scaled_norm_through_a_closure,
          "globals": lambda: scaled_norm_through_globals}[reached]()
    with record_trace() as trace:
        checkpoint(fn, torch.randn(4, 8, requires_grad=True) * 1)
    frees_nothing = ["frees nothing" in e.detail for e in trace.events if e.kind == "pack"]
    # batch_norm saves its input, running_mean, running_var, weight and two empty statistics (eval
    # mode); then the products save the constant 3 (from outside) and the constant 2 (made inside).
    assert frees_nothing == [True, True, True, True, False, False, True, False]
    done = next(e for e in trace.events if e.kind == "forward_done")
    assert "32 bytes of activations freed" in done.detail   # only the constant made inside


def test_a_saved_input_without_grad_frees_nothing():
    mask = torch.rand(4) > 0.5
    with record_trace() as trace:
        checkpoint(lambda t, m: t * m, torch.randn(4, requires_grad=True), mask.float())
    assert ["frees nothing" in e.detail for e in trace.events if e.kind == "pack"] == [True]


def test_trace_counts_a_tensor_saved_twice_once():
    def fn(a, b):
        e = b.exp()             # exp saves its result e ...
        return a.sin() * e      # ... and mul saves e again (and sin(a))

    with record_trace() as trace:
        checkpoint(fn, torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True))
    done = next(e for e in trace.events if e.kind == "forward_done")
    assert "32 bytes of activations freed" in done.detail  # e and sin(a), 16 bytes each


def test_context_fn_pair_sharing_state_torch_selective_checkpointing():
    # torch's SAC contexts share a cache between forward and recomputation: context_fn is called
    # once.
    from functools import partial

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return (
            CheckpointPolicy.MUST_SAVE
            if op == torch.ops.aten.mm.default
            else CheckpointPolicy.PREFER_RECOMPUTE
        )

    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    fn = lambda t: (t @ w).relu() @ w  # noqa: E731
    plain = grads_of(lambda: fn(x).sin(), [x, w])
    ours = grads_of(
        lambda: checkpoint(
            fn, x, context_fn=partial(create_selective_checkpoint_contexts, policy)
        ).sin(),
        [x, w],
    )
    assert_bitwise(plain, ours)


def test_input_modified_before_checkpoint_with_a_copying_outer_hook_is_fine():
    # An outer pack hook that copies (like CPU offload) hands back a fresh tensor with its own
    # version counter; only in-place changes *after* the checkpoint are errors.
    x = torch.randn(4, requires_grad=True)
    h = x * 1.0
    h.add_(1.0)  # before the checkpoint: fine
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        out = checkpoint(torch.sin, h)
    out.sum().backward()
    assert torch.equal(x.grad, (x.detach() + 1.0).cos())


# ---------------------------------------------------------------------------
# RecomputeAgain: selective checkpointing's observer of the recomputation, on any context
# ---------------------------------------------------------------------------

class MetaForSin(torch.utils._python_dispatch.TorchDispatchMode, RecomputesAgainOnRequest):
    """A recompute context that, while ``wrong``, hands back a meta tensor for ``sin`` (as a
    wrong skip would), and agrees to run again, putting itself right, when asked."""

    def __init__(self, answer: bool = True) -> None:
        super().__init__()
        self.wrong, self.answer, self.asked = True, answer, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.wrong and func is torch.ops.aten.sin.default:
            return torch.empty_like(args[0], device="meta")
        return func(*args, **(kwargs or {}))

    def recompute_again(self) -> bool:
        self.asked += 1
        self.wrong = False
        return self.answer


def test_a_meta_saved_tensor_asks_the_context_to_run_again():
    x = torch.randn(4, 4, requires_grad=True)
    f = lambda t: t.sin().exp()  # noqa: E731  exp saves its output, computed from the (meta) sin
    expected = grads_of(lambda: f(x), [x])
    context = MetaForSin()
    assert_bitwise(expected, grads_of(
        lambda: checkpoint(f, x, context_fn=lambda: (contextlib.nullcontext(), context)), [x]))
    assert context.asked == 1 and not saved_hooks_installed()
    refusing = MetaForSin(answer=False)     # a context that says no: the mismatch is an error
    y = checkpoint(f, x, context_fn=lambda: (contextlib.nullcontext(), refusing))
    with pytest.raises(CheckpointError, match="differs between forward and recomputation"):
        y.sum().backward()
    assert not saved_hooks_installed()


def test_recompute_again_is_honoured_once():
    runs = []

    class Again(RecomputesAgainOnRequest):
        def __enter__(self):
            runs.append(1)

        def __exit__(self, *exc_info):
            return False

    def f(t):
        if is_recomputing() and len(runs) <= limit:
            raise RecomputeAgain
        return t.sin().exp()

    x = torch.randn(3, requires_grad=True)
    expected = grads_of(lambda: f(x), [x])
    limit = 1  # the first rerun asks again, the second runs
    assert_bitwise(
        expected,
        grads_of(
            lambda: checkpoint(f, x, context_fn=lambda: (contextlib.nullcontext(), Again())), [x]
        ),
    )
    assert len(runs) == 2
    runs.clear()
    limit = 2              # both ask: a clear error, and nothing left behind
    y = checkpoint(f, x, context_fn=lambda: (contextlib.nullcontext(), Again()))
    with pytest.raises(CheckpointError, match="asked for a second recomputation, then for a third"):
        y.sum().backward()
    assert len(runs) == 2 and not saved_hooks_installed()
