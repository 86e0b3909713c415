"""No silent wrong gradients: torch.compile, a rerun that changed its ops, weights
modified between forward and backward, inputs torch accepts, failed backwards, state updated
twice, threads. Each test names the case it guards; most of them failed before the guards."""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import gc
import subprocess
import sys
import textwrap
import threading
import warnings
from typing import NamedTuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from ckptlib import CheckpointError, checkpoint
from ckptlib import is_recomputing
from ckptlib.selective import SelectivePlans, save_matmuls, selective_checkpoint
from ckptlib.sequential import checkpoint_sequential
from tests._grads import assert_bitwise_equal, gradients


def torch_nonreentrant(fn, *args, **kwargs):
    return torch_checkpoint(fn, *args, use_reentrant=False, **kwargs)


# ---------------------------------------------------------------------------
# 1. torch.compile: the checkpoint runs eagerly between compiled graphs
# ---------------------------------------------------------------------------


@pytest.fixture
def quiet_dynamo():
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # Dynamo's advice about the graph break
        yield
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compiled_program_with_a_checkpoint_gives_plain_gradients(backend, quiet_dynamo):
    # Before: aot_eager/inductor handed the compiled forward's saved tensors to the eager rerun's
    # holders by position (silently wrong gradients; with a matmul, a CheckpointError).
    torch.manual_seed(0)
    x = torch.randn(4, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)

    def region(u):
        return (u @ w).exp().sin().tanh()

    compiled = torch.compile(lambda t: checkpoint(region, t * 2), backend=backend)
    assert_bitwise_equal(
        gradients(lambda: compiled(x), (x, w)), gradients(lambda: region(x * 2), (x, w))
    )


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_checkpoint_as_the_whole_compiled_program_is_bitwise(backend, quiet_dynamo):
    # The smallest case: the compiled program is one checkpointed function and nothing else.
    x = torch.randn(4, 4, requires_grad=True)
    region = lambda u: u.exp().sin().tanh()  # noqa: E731
    compiled = torch.compile(lambda t: checkpoint(region, t), backend=backend)
    assert_bitwise_equal(gradients(lambda: compiled(x), (x,)), gradients(lambda: region(x), (x,)))


def test_fullgraph_compile_is_a_clear_error(quiet_dynamo):
    compiled = torch.compile(lambda t: checkpoint(torch.sin, t), backend="eager", fullgraph=True)
    with pytest.raises(
        torch._dynamo.exc.Unsupported, match="ckptlib.checkpoint runs eagerly under torch.compile"
    ):
        compiled(torch.randn(3, requires_grad=True))


def test_if_dynamo_traces_into_checkpoint_it_still_runs_eagerly(monkeypatch, quiet_dynamo):
    # Without the marks Dynamo inlines checkpoint; its first line hands over to the decorated copy.
    module = sys.modules["ckptlib.core.compile"]
    monkeypatch.delattr(checkpoint, "_torchdynamo_disable")
    monkeypatch.setattr(module, "_disabled", {})
    x = torch.randn(4, 4, requires_grad=True)
    region = lambda u: u.exp().sin().tanh()  # noqa: E731
    compiled = torch.compile(lambda t: checkpoint(region, t * 2), backend="aot_eager")
    assert_bitwise_equal(
        gradients(lambda: compiled(x), (x,)), gradients(lambda: region(x * 2), (x,))
    )
    assert checkpoint in module._disabled                  # the hand-over happened


def test_import_stays_cheap_and_fullgraph_names_the_reason_in_a_fresh_process():
    # Importing Dynamo costs a second: ckptlib marks checkpoint as disabled without importing it.
    script = textwrap.dedent("""
        import sys, warnings, torch, ckptlib
        assert "torch._dynamo" not in sys.modules, "import ckptlib imported Dynamo"
        warnings.simplefilter("ignore")
        try:
            torch.compile(lambda t: ckptlib.checkpoint(torch.sin, t * 2), backend="eager",
                          fullgraph=True)(torch.randn(3, requires_grad=True))
        except torch._dynamo.exc.Unsupported as error:
            print(error)
    """)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert (
        "ckptlib.checkpoint runs eagerly under torch.compile" in result.stdout
        and "drop fullgraph=True" in result.stdout
    )


def small_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))


@pytest.mark.parametrize(
    "wrap", ["selective", "selective_plans", "nested", "sequential", "compiled_inside"]
)
def test_compiled_selective_nested_and_sequential_checkpoints(wrap, quiet_dynamo):
    mlp = small_mlp()
    x = torch.randn(4, 8, requires_grad=True)
    tensors = (x, *mlp.parameters())
    plans = SelectivePlans()
    inner = torch.compile(mlp, backend="aot_eager")
    programs = {
        "selective": lambda t: selective_checkpoint(mlp, t * 2, policy=save_matmuls).sin(),
        "selective_plans": lambda t: selective_checkpoint(
            mlp, t * 2, policy=save_matmuls, plans=plans
        ).sin(),
        "nested": lambda t: checkpoint(lambda u: checkpoint(mlp, u).cos(), t * 2).sin(),
        "sequential": lambda t: checkpoint_sequential(mlp, 2, t * 2).sin(),
        "compiled_inside": lambda t: checkpoint(
            inner, t * 2
        ).sin(),  # compiled code inside a checkpoint
    }
    plain = {"nested": lambda t: mlp(t * 2).cos().sin()}.get(wrap, lambda t: mlp(t * 2).sin())
    expected = gradients(lambda: plain(x), tensors)
    program = (
        programs[wrap]
        if wrap == "compiled_inside"
        else torch.compile(programs[wrap], backend="aot_eager")
    )
    for _ in range(2):      # the second call runs what the first compiled (and reuses the plan)
        assert_bitwise_equal(gradients(lambda: program(x), tensors), expected)


# ---------------------------------------------------------------------------
# 2. An op that changes between forward and rerun, with the same shapes
# ---------------------------------------------------------------------------


def flag_region(flag):
    def region(t):
        h = t * 2
        return h.sin() if flag["sin"] else h.exp()
    return region


def test_an_op_changed_by_a_global_flag_is_refused():
    x = torch.randn(5, requires_grad=True)
    flag = {"sin": False}
    out = checkpoint(flag_region(flag), x)
    flag["sin"] = True
    with pytest.raises(
        CheckpointError,
        match="saved tensor #0 differs.*made by ExpBackward0; recomputation "
        "produced one made by MulBackward0 \\(same shape, another operation\\)",
    ):
        out.sum().backward()
    # torch.utils.checkpoint compares shapes only: a wrong gradient, silently.
    flag["sin"] = False
    expected = gradients(lambda: flag_region(flag)(x), (x,))
    out = torch_nonreentrant(flag_region(flag), x)
    flag["sin"] = True
    (wrong,) = torch.autograd.grad(out.sum(), x)
    assert not torch.equal(wrong, expected[0])


class Passthrough(torch.utils._python_dispatch.TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_views_made_by_another_dispatch_path_are_not_a_mismatch():
    # reshape makes a ReshapeAliasBackward0 view normally and a ViewBackward0 under a dispatch mode.
    x = torch.randn(4, 6, requires_grad=True)
    region = lambda t: (t * 2).reshape(6, 4).t().sin()  # noqa: E731
    out = checkpoint(region, x, context_fn=lambda: (contextlib.nullcontext(), Passthrough()))
    assert_bitwise_equal(torch.autograd.grad(out.sum(), x), gradients(lambda: region(x), (x,)))


# ---------------------------------------------------------------------------
# 3. Weights (and other tensors read from outside) modified between forward and backward
# ---------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)

    def forward(self, t):
        return self.fc1(t).tanh()


def test_an_optimizer_step_before_backward_is_refused_like_plain_autograd():
    torch.manual_seed(0)
    layer = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    for p in layer.parameters():
        p.grad = torch.ones_like(p)
    plain = layer(x).tanh()
    out = checkpoint(layer, x).tanh()
    optimizer.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        plain.sum().backward()
    with pytest.raises(
        CheckpointError,
        match="parameter `Linear.weight` \\(4x4 float32 on cpu \\(64 bytes\\)\\) was "
        "modified in place between the forward pass and this recomputation",
    ):
        out.sum().backward()


GLOBAL_WEIGHTS: dict[str, torch.Tensor] = {}


class PlainHolder:
    """A plain object (not a module): the walk does not look into its attributes."""

    w: torch.Tensor
    constant: torch.Tensor


UNREACHABLE = PlainHolder()


def captured(tensor):
    return lambda t: (t @ tensor).tanh()


@pytest.mark.parametrize(
    "case", ["bias", "bound_method", "closure", "partial", "global", "saved_leaf"]
)
def test_tensors_read_from_outside_are_checked_and_named(case):
    torch.manual_seed(0)
    layer, block, w = (
        nn.Sequential(nn.Linear(4, 4), nn.Tanh()),
        Block(),
        torch.randn(4, 4, requires_grad=True),
    )
    UNREACHABLE.w = torch.randn(4, 4, requires_grad=True)
    GLOBAL_WEIGHTS["w"] = torch.randn(4, 4, requires_grad=True)
    cases = {  # (fn, the tensor an in-place update changes, the name in the message)
        "bias": (
            layer,
            layer[0].bias,
            "parameter `Sequential.0.bias`",
        ),  # read by addmm, saved by nobody
        "bound_method": (block.forward, block.fc1.weight, "parameter `Block.fc1.weight`"),
        "closure": (captured(w), w, "captured tensor `tensor`"),
        "partial": (
            functools.partial(F.linear, weight=w),
            w,
            "captured tensor `partial.keywords\\['weight'\\]`",
        ),
        "global": (
            lambda t: (t @ GLOBAL_WEIGHTS["w"]).tanh(),
            GLOBAL_WEIGHTS["w"],  # a global name the code reads, one level into a dict
            "captured tensor `GLOBAL_WEIGHTS\\['w'\\]`",
        ),
        "saved_leaf": (
            lambda t: (t @ UNREACHABLE.w).tanh(),
            UNREACHABLE.w,  # an attribute of a plain object: not reached
            "a tensor the region reads \\(4x4 float32 on cpu \\(64 bytes\\), a leaf that requires "
            "grad",
        ),
    }
    fn, changed, name = cases[case]
    x = torch.randn(2, 4, requires_grad=True)
    out = checkpoint(fn, x).exp()
    with torch.no_grad():
        changed.add_(1.0)
    with pytest.raises(
        CheckpointError, match=f"{name}.*version \\d+ -> \\d+.*call backward first, then step"
    ):
        out.sum().backward()


UNREACHABLE.constant = torch.full((4,), 3.0)


@pytest.mark.parametrize("case", ["parameter", "buffer", "saved_unreached_constant"])
def test_weights_buffers_and_saved_constants_changed_before_the_rerun_are_refused(case):
    # Which saved tensors free memory no longer treats every tensor without grad as one from
    # outside;
    # the version check must still see those that are (a buffer, a constant saved by an op).
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(4).eval()
    cases = {  # (fn, the tensor an in-place update changes, the name in the message)
        "parameter": (norm, norm.weight, "parameter `BatchNorm1d.weight`"),
        "buffer": (norm, norm.running_mean, "buffer `BatchNorm1d.running_mean`"),
        "saved_unreached_constant": (
            lambda t: t * UNREACHABLE.constant,
            UNREACHABLE.constant,  # an attribute of a plain object: not reached
            "a tensor the region reads \\(4 float32 on cpu \\(16 bytes\\), a leaf that "
            "does not require grad: a constant",
        ),
    }
    fn, changed, name = cases[case]
    out = checkpoint(fn, torch.randn(2, 4, requires_grad=True) * 1).exp()
    with torch.no_grad():
        changed.add_(1.0)
    with pytest.raises(
        CheckpointError, match=f"{name}.*was modified in place.*version \\d+ -> \\d+"
    ):
        out.sum().backward()


def test_torch_recomputes_silently_with_the_new_bias():
    # What the check prevents: torch.utils.checkpoint reruns with the updated bias.
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    x = torch.randn(2, 4, requires_grad=True)
    expected = gradients(lambda: layer(x).exp(), (x,))
    out = torch_nonreentrant(layer, x).exp()
    with torch.no_grad():
        layer[0].bias.add_(1.0)
    assert not torch.equal(torch.autograd.grad(out.sum(), x)[0], expected[0])


class BuffersRestored:
    """A recompute context that puts a module's buffers back as they were (entered once per
    rerun)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __enter__(self) -> None:
        self.saved = [b.clone() for b in self.module.buffers()]

    def __exit__(self, *exc_info) -> None:
        with torch.no_grad():
            for b, value in zip(self.module.buffers(), self.saved):
                b.copy_(value)


def test_state_the_region_writes_itself_is_not_an_error():
    # BatchNorm bumps num_batches_tracked in forward and again in the rerun; a context that restores
    # the buffers bumps every buffer's version. Neither is a modification from outside.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    x = torch.randn(8, 4, requires_grad=True)

    out = checkpoint(
        model, x, context_fn=lambda: (contextlib.nullcontext(), BuffersRestored(model))
    )
    first = torch.autograd.grad(out.sum(), x, retain_graph=True)
    assert_bitwise_equal(torch.autograd.grad(out.sum(), x), first)  # a second backward: no error


def test_plain_autograds_inplace_check_still_applies_outside_checkpoints():
    x = torch.randn(4, requires_grad=True)
    kept = x.exp()                                   # saved by ExpBackward0, outside any checkpoint
    out = checkpoint(torch.sin, x) + kept
    with torch.no_grad():
        kept.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


# ---------------------------------------------------------------------------
# 5. Inputs torch accepts: exact pytree leaves, sparse tensors
# ---------------------------------------------------------------------------


class Pair(NamedTuple):
    left: torch.Tensor
    right: int


@dataclasses.dataclass
class Scaled:
    tensor: torch.Tensor
    scale: float


torch.utils._pytree.register_dataclass(Scaled)


def test_every_leaf_comes_back_with_its_exact_type():
    seen = []

    def fn(t, size, pair, ordered, counts, scaled, *, dtype, device, nothing, name):
        seen.append(
            (
                type(size),
                type(pair),
                type(ordered),
                type(counts),
                counts.default_factory,
                type(scaled),
                dtype,
                device,
                nothing,
                name,
            )
        )
        h = (
            t.reshape(size.numel()).sin()
            * (pair.left * ordered["a"] * counts["b"] * scaled.tensor).sum()
        )
        return h * scaled.scale * pair.right

    x = torch.randn(2, 3, requires_grad=True)
    y = torch.randn(3, requires_grad=True)

    def call(wrap):
        args = (
            x,
            x.shape,
            Pair(y, 2),
            collections.OrderedDict(a=y.cos()),
            collections.defaultdict(int, b=y.exp()),
            Scaled(y * 3, 0.5),
        )
        return wrap(
            fn, *args, dtype=torch.float32, device=torch.device("cpu"), nothing=None, name="block"
        )

    expected = gradients(lambda: call(lambda f, *a, **k: f(*a, **k)), (x, y))
    for wrap in (checkpoint, torch_nonreentrant):
        seen.clear()
        assert_bitwise_equal(gradients(lambda: call(wrap), (x, y)), expected)
        assert len(seen) == 2 and seen[0] == seen[1]  # forward and rerun saw the same types
    assert seen[0][:6] == (
        torch.Size,
        Pair,
        collections.OrderedDict,
        collections.defaultdict,
        int,
        Scaled,
    )


def test_sparse_tensors_as_input_and_saved_inside():
    torch.manual_seed(0)
    dense = torch.randn(5, 5).relu()
    w = torch.randn(5, 3, requires_grad=True)

    def run(wrap):
        sparse = dense.to_sparse().requires_grad_()
        out = wrap(
            lambda a, b: torch.sparse.mm(a, b).sin(), sparse, w
        )  # sparse.mm saves the sparse input
        grad_sparse, grad_w = torch.autograd.grad(out.sum(), (sparse, w))
        return grad_sparse.to_dense(), grad_w

    expected = run(lambda f, *a: f(*a))
    assert_bitwise_equal(run(checkpoint), expected)
    assert_bitwise_equal(run(torch_nonreentrant), expected)


def test_a_sparse_tensor_made_and_saved_inside_the_region():
    torch.manual_seed(0)
    a = torch.randn(5, 5, requires_grad=True)
    w = torch.randn(5, 3, requires_grad=True)
    region = lambda m, b: torch.sparse.mm(m.relu().to_sparse(), b).sin()   # noqa: E731  saves a sparse non-leaf
    expected = gradients(lambda: region(a, w), (a, w))
    assert_bitwise_equal(gradients(lambda: checkpoint(region, a, w), (a, w)), expected)
    assert_bitwise_equal(gradients(lambda: torch_nonreentrant(region, a, w), (a, w)), expected)


# ---------------------------------------------------------------------------
# 7. A backward that fails after the rerun releases what it recomputed
# ---------------------------------------------------------------------------


class FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward failed")


def test_a_failed_backward_releases_the_recomputed_tensors():
    recomputed: list[StorageWeakRef] = []

    def region(t):
        e = t.exp()  # saved by sin (and exp): recomputed, not yet used when backward fails
        if is_recomputing():
            recomputed.append(StorageWeakRef(e.untyped_storage()))
        return FailsInBackward.apply(e.sin()).tanh()

    x = torch.randn(1000, requires_grad=True)
    out = checkpoint(region, x)
    with pytest.raises(RuntimeError, match="backward failed"):
        out.sum().backward(retain_graph=True)
    gc.collect()
    assert len(recomputed) == 1 and recomputed[0].expired(), (
        "the graph still holds a recomputed tensor"
    )
    assert out.grad_fn is not None          # the graph is alive: only what it recomputed is gone


# ---------------------------------------------------------------------------
# 8. BatchNorm's running statistics: updated once, as in plain autograd, with no warning
# ---------------------------------------------------------------------------


def bn_model(**kwargs) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, **kwargs), nn.ReLU())


def test_running_statistics_end_as_plain_autograd_leaves_them_without_a_warning():
    """Two steps: the statistics move once per step, bitwise as in plain autograd (the rerun runs
    with the statistics the forward saw and leaves them as the forward did)."""
    model, plain_model = bn_model(), bn_model()
    x = torch.randn(8, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checkpoint(model, x).sum().backward()
        checkpoint(model, x).sum().backward()
    plain_model(x).sum().backward()
    plain_model(x).sum().backward()
    assert model[1].num_batches_tracked.item() == 2
    assert_bitwise_equal(list(model.buffers()), list(plain_model.buffers()))
    assert_bitwise_equal([p.grad for p in model.parameters()],
                         [p.grad for p in plain_model.parameters()])


@pytest.mark.parametrize("case", ["eval", "no_running_stats", "restored", "bn_outside"])
def test_no_warning_when_statistics_move_once(case):
    """No warning, and the buffers end bitwise as plain autograd leaves them (a recompute context
    that restores the buffers itself is run inside ckptlib's own restore)."""
    model = bn_model(track_running_stats=case != "no_running_stats")
    plain_model = bn_model(track_running_stats=case != "no_running_stats")
    if case == "eval":
        model.eval()
        plain_model.eval()

    x = torch.randn(8, 4, requires_grad=True)
    plain_model(x).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if case == "restored":
            out = checkpoint(
                model, x, context_fn=lambda: (contextlib.nullcontext(), BuffersRestored(model))
            )
        elif case == "bn_outside":
            out = checkpoint(model[2], model[1](checkpoint(model[0], x)))
        else:
            out = checkpoint(model, x)
        out.sum().backward()
    assert_bitwise_equal(list(model.buffers()), list(plain_model.buffers()))


# ---------------------------------------------------------------------------
# 9. Threads share one generator: concurrent checkpointed backward with dropout
# ---------------------------------------------------------------------------


def dropout_region(barrier):
    calls = []

    def region(t):
        calls.append(1)
        rerun = len(calls) == 2        # (of ckptlib or torch)
        if rerun:
            barrier.wait(timeout=30)   # both reruns have set the one generator to their own state
        h = F.dropout(t.sin(), 0.5, True)
        if rerun:
            barrier.wait(timeout=30)   # both drew from it before either put it back
        return h.exp()
    return region


def run_in_threads(*jobs):
    results: list = [None] * len(jobs)

    def run(index, job):
        try:
            results[index] = job()
        except BaseException as error:    # reported to the test
            results[index] = error

    threads = [threading.Thread(target=run, args=(i, job)) for i, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results


def test_concurrent_reruns_that_draw_random_numbers_are_refused():
    barrier = threading.Barrier(2)
    xs = [torch.randn(256, requires_grad=True) for _ in range(2)]
    outs = []
    for seed, x in enumerate(xs):
        torch.manual_seed(seed)
        outs.append(checkpoint(dropout_region(barrier), x))
    results = run_in_threads(
        *(lambda out=out, x=x: torch.autograd.grad(out.sum(), x) for out, x in zip(outs, xs))
    )
    assert all(isinstance(r, CheckpointError) for r in results), results
    assert "another thread's checkpoint used the random number generator (cpu)" in str(results[0])


def test_concurrent_reruns_without_random_numbers_are_fine():
    barrier = threading.Barrier(2)

    def region(t):
        if is_recomputing():
            barrier.wait(timeout=30)
        return t.sin().exp()

    xs = [torch.randn(16, requires_grad=True) for _ in range(2)]
    outs = [checkpoint(region, x) for x in xs]
    results = run_in_threads(
        *(lambda out=out, x=x: torch.autograd.grad(out.sum(), x) for out, x in zip(outs, xs))
    )
    for x, (grad,) in zip(xs, results):
        assert torch.equal(grad, (x.sin().exp() * x.cos()).detach())


def test_torch_gives_wrong_gradients_silently_in_the_same_race():
    barrier = threading.Barrier(2)
    xs = [torch.randn(256, requires_grad=True) for _ in range(2)]
    outs, expected = [], []
    for seed, x in enumerate(xs):
        torch.manual_seed(seed)
        expected.append(torch.autograd.grad(F.dropout(x.sin(), 0.5, True).exp().sum(), x)[0])
        torch.manual_seed(seed)
        outs.append(torch_nonreentrant(dropout_region(barrier), x))
    results = run_in_threads(
        *(lambda out=out, x=x: torch.autograd.grad(out.sum(), x) for out, x in zip(outs, xs))
    )
    assert not all(torch.equal(grad, e) for (grad,), e in zip(results, expected))


def test_limit_plain_random_draws_in_another_thread_are_not_seen():
    # Documented limit (README, troubleshooting): code outside any checkpoint does not register
    # as a user of the generator, so its draws during a rerun go unnoticed.
    entered, drawn = threading.Event(), threading.Event()

    def region(t):
        if is_recomputing():
            entered.set()
            assert drawn.wait(timeout=30)
        return F.dropout(t.sin(), 0.5, True).exp()

    x = torch.randn(256, requires_grad=True)
    torch.manual_seed(0)
    expected = torch.autograd.grad(region(x).sum(), x)[0]
    torch.manual_seed(0)
    out = checkpoint(region, x)

    def other_thread():
        assert entered.wait(timeout=30)
        torch.rand(100)                     # plain draws while the rerun replays the generator
        drawn.set()

    results = run_in_threads(lambda: torch.autograd.grad(out.sum(), x)[0], other_thread)
    assert not torch.equal(results[0], expected)      # a wrong gradient, and no error
