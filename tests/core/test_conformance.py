"""ckptlib.checkpoint held to the behaviours PyTorch's own checkpoint tests check.

PyTorch tests its non-reentrant checkpoint (``TestCheckpoint`` in ``test/test_utils.py``, the
checkpoint tests of ``test/test_autograd.py``, ``TestNestedCheckpoint``,
``TestSelectiveActivationCheckpoint``) for nesting in every order, early stop on and off,
``context_fn``, the determinism check, custom ``autograd.Function``s and arbitrary inputs and
outputs. This file asks the same questions of ckptlib, in its own words: every result is compared
with plain autograd (bitwise, on CPU) and with ``torch.utils.checkpoint.checkpoint(...,
use_reentrant=False)``, and where torch's behaviour is a count (how often a function runs, which
ops a rerun reaches) ckptlib's count must be torch's.

Only the public API (``ckptlib.checkpoint`` and what ``ckptlib`` exports) is used, so the file
holds whatever the core looks like inside. The rerun's finer cases (forward-mode AD,
``GraphExecGroup``, a rerun that raises, Parameter arguments) are in ``test_conformance_rerun.py``.
"""
from __future__ import annotations

import contextlib
import itertools
from functools import partial
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as torch_checkpointing
from torch.utils._python_dispatch import TorchDispatchMode

import ckptlib
from tests._grads import assert_bitwise_equal

Fn = Callable[..., Any]
LIBRARIES = ("ckptlib", "torch")


def wrap(library: str, fn: Fn, **options: Any) -> Fn:
    """``fn`` checkpointed by ``library``: ``"ckptlib"``, ``"torch"`` (non-reentrant), or
    ``"plain"`` (``fn`` itself)."""
    if library == "plain":
        return fn
    if library == "ckptlib":
        return lambda *args, **kwargs: ckptlib.checkpoint(fn, *args, **options, **kwargs)
    return lambda *args, **kwargs: torch_checkpointing.checkpoint(
        fn, *args, use_reentrant=False, **options, **kwargs)


def leaves(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """An input ``x`` and a weight ``w`` that both require grad."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 4, generator=generator, requires_grad=True)
    w = torch.randn(4, 4, generator=generator, requires_grad=True)
    return x, w


def backward_results(run: Callable[[], torch.Tensor], inputs: list[torch.Tensor],
                     how: str) -> list[torch.Tensor]:
    """The output of ``run()`` and its gradients w.r.t. ``inputs``, by ``how``:
    ``"backward"`` (``.backward()``, read from ``.grad``), ``"grad"`` (``torch.autograd.grad``),
    ``"double"`` (gradients with ``create_graph=True``, then the gradients of their squares' sum:
    a second backward through the first)."""
    for tensor in inputs:
        tensor.grad = None
    out = run()
    loss = out.square().sum()
    if how == "backward":
        loss.backward()
        grads = [tensor.grad for tensor in inputs]
        for tensor in inputs:
            tensor.grad = None
        return [out.detach(), *grads]
    if how == "grad":
        return [out.detach(), *torch.autograd.grad(loss, inputs)]
    first = torch.autograd.grad(loss, inputs, create_graph=True)
    second = torch.autograd.grad(sum(g.square().sum() for g in first), inputs)
    return [out.detach(), *(g.detach() for g in first), *second]


CHECKPOINT_ERROR = {"torch": torch_checkpointing.CheckpointError,
                    "ckptlib": ckptlib.CheckpointError}


def assert_rerun_refused(library: str, fn: Fn, x: torch.Tensor, state: dict) -> None:
    """A forward with ``state["changed"]`` False, a backward with it True: the rerun differs and
    ``library``'s checkpoint refuses it with its ``CheckpointError``. Leaves the state False."""
    state["changed"] = False
    out = wrap(library, fn)(x)
    state["changed"] = True
    with pytest.raises(CHECKPOINT_ERROR[library]):
        out.sum().backward()
    state["changed"] = False


class Counted:
    """A function that counts its calls (``calls``), as torch's tests count forward runs."""

    def __init__(self, fn: Fn) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        return self.fn(*args)


# ---------------------------------------------------------------------------
# Nesting in every order
# ---------------------------------------------------------------------------


def nested_structures(w: torch.Tensor) -> dict[str, tuple[int, Callable[..., Fn]]]:
    """Each way of nesting checkpoints, as (how many checkpoints, build(wrappers, f, g) -> fn).
    ``f`` and ``g`` are the innermost functions; each wrapper checkpoints one function."""
    return {
        # one inside another
        "inside": (2, lambda A, B, f, g: A(B(f))),
        # two children in one parent
        "two-children": (2, lambda A, B, f, g: A(lambda x: B(f)(x) + B(g)(x))),
        # ops of the parent after its child: the rerun of the parent reruns the child's forward
        "child-then-ops": (2, lambda A, B, f, g: A(lambda x: B(f)(x).sin() * x)),
        # three deep, with ops on each level
        "three-deep": (3, lambda A, B, C, f, g: A(lambda x: B(lambda y: C(f)(y) * y)(x).cos())),
        # side by side, not nested: one checkpoint's output is the next one's input
        "side-by-side": (2, lambda A, B, f, g: lambda x: A(f)(B(g)(x))),
    }


NESTINGS = list(nested_structures(torch.zeros(1)))


def nested_run(structure: str, libraries: tuple[str, ...], early_stop: bool,
               how: str) -> tuple[list[torch.Tensor], list[int]]:
    """Results and the number of calls of ``f`` and ``g`` of one nesting, its checkpoints made by
    ``libraries`` (outermost first)."""
    x, w = leaves()
    f = Counted(lambda t: torch.tanh(t @ w).exp())
    g = Counted(lambda t: t.sin() * t.cos())
    _, build = nested_structures(w)[structure]
    wrappers = [partial(wrap, library) for library in libraries]
    fn = build(*wrappers, f, g)
    context = (contextlib.nullcontext() if early_stop
               else torch_checkpointing.set_checkpoint_early_stop(False))
    with context:
        results = backward_results(lambda: fn(x), [x, w], how)
    return results, [f.calls, g.calls]


@pytest.mark.parametrize("how", ["backward", "grad", "double"])
@pytest.mark.parametrize("early_stop", [True, False], ids=["early-stop", "no-early-stop"])
@pytest.mark.parametrize("structure", NESTINGS)
def test_nesting_in_every_order_gives_plain_gradients_and_runs_as_often_as_torch(
        structure, early_stop, how):
    depth = nested_structures(torch.zeros(1))[structure][0]
    plain, _ = nested_run(structure, ("plain",) * depth, early_stop, how)
    _, torch_calls = nested_run(structure, ("torch",) * depth, early_stop, how)
    for libraries in itertools.product(LIBRARIES, repeat=depth):
        got, calls = nested_run(structure, libraries, early_stop, how)
        assert_bitwise_equal(got, plain)
        assert calls == torch_calls, f"{libraries}: f, g ran {calls} times, torch {torch_calls}"


def test_early_stop_keyword_and_torchs_switch_cut_the_rerun_where_torch_does():
    # Marks record how far the rerun of the function got. exp saves its result, the last tensor
    # saved, so with early stop the rerun ends inside the exp; without it, it runs to the end.
    def run(library: str, early_stop: bool | None) -> list[str]:
        marks: list[str] = []

        def fn(t: torch.Tensor) -> torch.Tensor:
            marks.append("start")
            h = t.sin()
            marks.append("sin")
            h = h.exp()
            marks.append("exp")
            h = h + 1.0      # saves nothing
            marks.append("add")
            return h * 2.0   # saves nothing (a constant factor)

        x = torch.randn(5, requires_grad=True)
        options = {} if early_stop is None else {"early_stop": early_stop}
        out = wrap(library, fn, **(options if library == "ckptlib" else {}))(x)
        del marks[:]
        out.sum().backward()
        return marks

    torch_stopped = run("torch", None)
    assert torch_stopped == ["start", "sin"]   # stopped at exp's save, inside the exp
    assert run("ckptlib", None) == torch_stopped
    with torch_checkpointing.set_checkpoint_early_stop(False):
        torch_full = run("torch", None)
        assert run("ckptlib", None) == torch_full          # torch's switch, honoured
    assert torch_full == ["start", "sin", "exp", "add"]
    assert run("ckptlib", False) == torch_full             # ckptlib's own keyword


@pytest.mark.parametrize("library", LIBRARIES)
def test_retain_graph_reruns_for_each_backward_and_grads_accumulate_as_plain(library):
    x, w = leaves()
    f = Counted(lambda t: torch.tanh(t @ w).exp())
    out = wrap(library, f)(x)
    out.sum().backward(retain_graph=True)
    out.sum().backward()
    assert f.calls == 3   # the forward, and one rerun per backward
    got = [x.grad, w.grad]
    x.grad = w.grad = None
    plain = f.fn(x).sum()
    plain.backward(retain_graph=True)
    plain.backward()
    assert_bitwise_equal(got, [x.grad, w.grad])


def test_a_backward_on_some_inputs_and_then_the_rest_reruns_each_time_as_torch():
    def run(library: str) -> tuple[list[torch.Tensor], int]:
        x, w = leaves()
        f = Counted(lambda t: torch.tanh(t @ w).exp())
        out = wrap(library, f)(x).sum()
        grads = [*torch.autograd.grad(out, [x], retain_graph=True),
                 *torch.autograd.grad(out, [w])]
        return grads, f.calls

    plain, _ = run("plain")
    theirs, torch_calls = run("torch")
    ours, calls = run("ckptlib")
    assert_bitwise_equal(ours, plain)
    assert_bitwise_equal(theirs, plain)
    assert calls == torch_calls == 3


@pytest.mark.parametrize("library", LIBRARIES)
def test_backward_with_inputs_fills_only_those_grads(library):
    x, w = leaves()
    out = wrap(library, lambda t: (t @ w).tanh())(x)
    out.sum().backward(inputs=[w])
    assert x.grad is None
    got, w.grad = w.grad, None
    (x @ w).tanh().sum().backward(inputs=[w])
    assert_bitwise_equal([got], [w.grad])


@pytest.mark.parametrize("library", LIBRARIES)
def test_autograd_grad_inside_the_function_with_early_stop(library):
    # The function takes a gradient itself (a gradient penalty); its rerun does too. (Without
    # early stop: test_conformance_rerun.py.)
    def fn(t: torch.Tensor) -> torch.Tensor:
        inner = t.sin()
        (slope,) = torch.autograd.grad(inner.sum(), t, create_graph=True)
        return (slope * inner).exp()

    x = torch.randn(4, generator=torch.Generator().manual_seed(0), requires_grad=True)
    assert_bitwise_equal(backward_results(lambda: wrap(library, fn)(x), [x], "grad"),
                         backward_results(lambda: fn(x), [x], "grad"))


def test_hooks_fire_as_under_torch_tensor_hooks_once_module_forward_hooks_in_the_rerun_too():
    def calls(library: str) -> list[str]:
        log: list[str] = []
        layer = nn.Linear(3, 3)
        layer.register_forward_hook(lambda *args: log.append("module forward"))
        layer.register_full_backward_hook(lambda *args: log.append("module backward"))

        def fn(t: torch.Tensor) -> torch.Tensor:
            h = layer(t).exp()
            h.register_hook(lambda grad: log.append("tensor"))
            return h.sin()

        wrap(library, fn)(torch.randn(2, 3, requires_grad=True)).sum().backward()
        return log

    assert calls("plain") == ["module forward", "tensor", "module backward"]
    theirs = calls("torch")   # the rerun runs the module again: its forward hook too
    assert theirs == ["module forward", "module forward", "tensor", "module backward"]
    assert calls("ckptlib") == theirs


def assert_autograd_saves_plainly() -> None:
    """No saved-tensor hook is left behind: autograd keeps an op's tensor itself again."""
    t = torch.randn(3, requires_grad=True)
    result = t.exp()
    assert result.grad_fn._saved_result.data_ptr() == result.data_ptr()
    assert not ckptlib.is_recomputing()


def test_after_a_refused_rerun_the_next_checkpoint_works_and_nothing_is_left_installed():
    state = {"changed": False}
    x, w = leaves()

    def fn(t: torch.Tensor) -> torch.Tensor:
        return (t.repeat(2, 1) if state["changed"] else t) @ w

    for library in LIBRARIES:
        assert_rerun_refused(library, fn, x, state)
        got = backward_results(lambda: wrap(library, fn)(x), [x, w], "backward")
        assert_bitwise_equal(got, backward_results(lambda: fn(x), [x, w], "backward"))
        assert_autograd_saves_plainly()


# ---------------------------------------------------------------------------
# Arbitrary inputs and outputs
# ---------------------------------------------------------------------------


def mixed_outputs(t1: torch.Tensor, t2: torch.Tensor, scale: int, t3: torch.Tensor) -> tuple:
    """Tensors, numbers, None, a bool, a string and an input given back, as torch's test returns."""
    t4 = (t1 + t2 * t3) * scale
    t5 = (t1 * t2 + t3) * scale
    return scale, t4, None, True, t5, "bar", t1


@pytest.mark.parametrize("library", LIBRARIES)
def test_non_tensor_inputs_and_outputs_come_back_untouched_and_tensors_get_plain_grads(library):
    generator = torch.Generator().manual_seed(0)
    t1 = torch.rand(10, generator=generator, requires_grad=True)
    t2 = torch.rand(10, generator=generator, requires_grad=True)
    t3 = torch.rand(10, generator=generator)
    got = wrap(library, mixed_outputs)(t1, t2, 7, t3)
    expected = mixed_outputs(t1, t2, 7, t3)
    assert [type(value) for value in got] == [type(value) for value in expected]
    assert got[0] == 7 and got[2] is None and got[3] is True and got[5] == "bar"
    assert got[6] is t1   # an input given back is the input itself, as from a plain call
    assert_bitwise_equal([got[1], got[4]], [expected[1], expected[4]])

    def grads(results: tuple) -> list[torch.Tensor]:
        torch.autograd.backward([results[1].sum(), results[4].sum(), results[6].sum()])
        grads = [t1.grad, t2.grad]
        t1.grad = t2.grad = None
        return grads

    assert_bitwise_equal(grads(got), grads(expected))


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_call_without_any_tensor_returns_what_the_function_returns(library):
    assert wrap(library, mixed_outputs)(0.5, 0.25, 3, 2.0) == mixed_outputs(0.5, 0.25, 3, 2.0)


def nested_io(inputs: dict, *, scale: float, mode: str | None = None) -> dict:
    """A pytree in (a dict with a list holding a tensor, None and an int; keywords) and a pytree
    out (a dict of a list and a tuple, with a string and a tensor that needs no grad)."""
    a, (b, nothing, count) = inputs["a"], inputs["pair"]
    assert nothing is None and mode == "train"
    h = (a @ b).tanh() * scale
    return {"out": [h.exp(), h.sin()], "meta": (count, "done", inputs["index"] * 2)}


@pytest.mark.parametrize("library", LIBRARIES)
def test_nested_inputs_keywords_and_nested_outputs_pass_through_with_plain_grads(library):
    x, w = leaves()
    index = torch.arange(3)

    def run(how: str) -> tuple[dict, list[torch.Tensor]]:
        result = wrap(how, nested_io)({"a": x, "pair": [w, None, 3], "index": index},
                                      scale=0.5, mode="train")
        loss = result["out"][0].sum() + result["out"][1].square().sum()
        return result, torch.autograd.grad(loss, [x, w])

    got, got_grads = run(library)
    expected, expected_grads = run("plain")
    assert got["meta"][:2] == (3, "done") and torch.equal(got["meta"][2], index * 2)
    assert not got["meta"][2].requires_grad
    assert_bitwise_equal([*got["out"], *got_grads], [*expected["out"], *expected_grads])


@pytest.mark.parametrize("library", LIBRARIES)
def test_none_and_inputs_without_grad_reach_the_rerun_as_given(library):
    weight = nn.Linear(4, 4)
    x = torch.randn(3, 4)   # no grad: only the module's parameters get gradients

    def fn(t: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
        assert extra is None and not t.requires_grad
        return weight(t).relu().square()

    def grads(how: str) -> list[torch.Tensor]:
        out = wrap(how, fn)(x, None)
        return [out.detach(), *torch.autograd.grad(out.sum(), list(weight.parameters()))]

    assert_bitwise_equal(grads(library), grads("plain"))


@pytest.mark.parametrize("library", LIBRARIES)
def test_only_some_outputs_used_and_an_output_that_needs_no_grad(library):
    x, w = leaves()

    def fn(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = (t @ w).sigmoid()
        return h.exp(), h.cos(), (h > 0.5).sum()

    def grads(how: str) -> list[torch.Tensor]:
        first, _, count = wrap(how, fn)(x)
        assert not count.requires_grad
        return [count, *torch.autograd.grad(first.sum(), [x, w])]

    assert_bitwise_equal(grads(library), grads("plain"))


@pytest.mark.parametrize("library", LIBRARIES)
def test_detached_and_no_grad_parts_inside_the_function(library):
    x, w = leaves()

    def fn(t: torch.Tensor) -> torch.Tensor:
        constant = (t @ w).detach().exp()
        with torch.no_grad():
            scale = t.abs().mean()
        return (t @ w).tanh() * constant + scale

    assert_bitwise_equal(backward_results(lambda: wrap(library, fn)(x), [x, w], "backward"),
                         backward_results(lambda: fn(x), [x, w], "backward"))


@pytest.mark.parametrize("library", LIBRARIES)
def test_dropout_draws_the_forwards_mask_in_the_rerun(library):
    x, w = leaves()
    dropout = nn.Dropout(0.5)

    def fn(t: torch.Tensor) -> torch.Tensor:
        return dropout((t @ w).tanh()).exp()

    def results(how: str) -> list[torch.Tensor]:
        torch.manual_seed(3)
        out = backward_results(lambda: wrap(how, fn)(x), [x, w], "backward")
        return [*out, torch.rand(2)]   # the caller's stream moved as by a plain call

    assert_bitwise_equal(results(library), results("plain"))


@pytest.mark.parametrize("library", LIBRARIES)
def test_autocast_of_the_forward_is_the_reruns_even_when_backward_is_outside_it(library):
    x, w = leaves()

    def fn(t: torch.Tensor) -> torch.Tensor:
        return (t @ w).relu() @ w

    def results(how: str) -> list[torch.Tensor]:
        for tensor in (x, w):
            tensor.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = wrap(how, fn)(x)
        out.float().square().sum().backward()
        return [out.detach(), x.grad, w.grad]

    assert_bitwise_equal(results(library), results("plain"))


# ---------------------------------------------------------------------------
# Custom autograd.Functions inside a checkpoint
# ---------------------------------------------------------------------------


class SavesInputsIntermediateAndOutput(torch.autograd.Function):
    """Saves its inputs, an intermediate result and its output, as torch's test Function does."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, y: torch.Tensor, power: int) -> torch.Tensor:
        product = x * y
        out = product ** power
        ctx.power = power
        ctx.save_for_backward(x, y, product, out)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        x, y, product, out = ctx.saved_tensors
        grad_product = grad_out * ctx.power * out / product
        return grad_product * y, grad_product * x, None


class TwoOutputs(torch.autograd.Function):
    """Two outputs, one marked non-differentiable; a backward that is not differentiable again."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        result = x.exp()
        sign = x.sign()
        ctx.mark_non_differentiable(sign)
        ctx.save_for_backward(result)
        return result, sign

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_result: torch.Tensor, grad_sign: Any) -> torch.Tensor:
        (result,) = ctx.saved_tensors
        return grad_result * result


def with_custom_functions(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = SavesInputsIntermediateAndOutput.apply((x @ w).sigmoid() + 0.5, x + 1.5, 3)
    result, sign = TwoOutputs.apply(h.tanh())
    return result * sign


@pytest.mark.parametrize("library", LIBRARIES)
def test_custom_functions_get_their_saved_tensors_back_and_plain_gradients(library):
    x, w = leaves()
    got = backward_results(lambda: wrap(library, with_custom_functions)(x, w), [x, w], "grad")
    assert_bitwise_equal(got, backward_results(lambda: with_custom_functions(x, w), [x, w],
                                               "grad"))


class ReadsSavedTwice(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        out = x.exp()
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> torch.Tensor:
        (first,) = ctx.saved_tensors
        (again,) = ctx.saved_tensors
        return grad_out * first * again / again


def test_a_function_that_reads_its_saved_tensors_twice_is_refused_as_torch_refuses_it():
    # Plain autograd allows it; a checkpoint hands each recomputed tensor over once (torch says
    # so, and so does ckptlib), so that it can free it right after.
    x = torch.randn(4, requires_grad=True)
    ReadsSavedTwice.apply(x.sin()).sum().backward()
    with pytest.raises(torch_checkpointing.CheckpointError, match="already\\s+unpacked once"):
        wrap("torch", lambda t: ReadsSavedTwice.apply(t.sin()))(x).sum().backward()
    with pytest.raises(ckptlib.CheckpointError, match="twice"):
        wrap("ckptlib", lambda t: ReadsSavedTwice.apply(t.sin()))(x).sum().backward()


@pytest.mark.parametrize("library", LIBRARIES)
def test_saved_tensors_read_outside_backward_then_backward(library):
    # Reading grad_fn._saved_result outside a backward recomputes for that read only; a later
    # backward still gets every tensor.
    x = torch.randn(5, requires_grad=True)

    def fn(t: torch.Tensor) -> torch.Tensor:
        return (t * t * t).sin().exp()

    out = wrap(library, fn)(x)
    expected = fn(x)
    assert torch.equal(out.grad_fn._saved_result, expected.grad_fn._saved_result)
    assert torch.equal(out.grad_fn._saved_result, expected.grad_fn._saved_result)
    assert_bitwise_equal(torch.autograd.grad(out.sum(), x), torch.autograd.grad(expected.sum(), x))


# ---------------------------------------------------------------------------
# context_fn
# ---------------------------------------------------------------------------


class OpLog(TorchDispatchMode):
    """Logs the name of every aten op it sees."""

    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        self.log.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("early_stop", [True, False], ids=["early-stop", "no-early-stop"])
def test_context_fn_runs_its_contexts_around_the_same_ops_as_torchs(early_stop):
    def logs(library: str) -> tuple[list[str], list[str]]:
        forward_ops: list[str] = []
        rerun_ops: list[str] = []
        x, w = leaves()

        def context_fn() -> tuple[OpLog, OpLog]:
            return OpLog(forward_ops), OpLog(rerun_ops)

        context = (contextlib.nullcontext() if early_stop
                   else torch_checkpointing.set_checkpoint_early_stop(False))
        with context:
            out = wrap(library, lambda t: torch.tanh(t @ w).exp().sum(0),
                       context_fn=context_fn)(x)
        out.sum().backward()
        return forward_ops, rerun_ops

    def without_detach(ops: list[str]) -> list[str]:
        # Both reruns detach inputs and saved tensors under the context, at places of their own
        # (how many detaches is an implementation detail); the ops of the function are the same.
        return [op for op in ops if op != "detach.default"]

    theirs, ours = logs("torch"), logs("ckptlib")
    assert ours[0] == theirs[0]
    assert without_detach(ours[1]) == without_detach(theirs[1])
    assert "mm.default" in ours[0] and "mm.default" in ours[1]


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Keep matrix products, recompute the rest (torch's selective checkpointing policy)."""
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return torch_checkpointing.CheckpointPolicy.MUST_SAVE
    return torch_checkpointing.CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("how", ["backward", "grad"])
def test_torchs_selective_checkpointing_contexts_work_through_context_fn(how):
    x, w = leaves()
    layer = nn.Linear(4, 4)

    def fn(t: torch.Tensor) -> torch.Tensor:
        return layer((t @ w).relu()).sigmoid() @ w

    def run(library: str) -> list[torch.Tensor]:
        if library == "plain":
            checkpointed = fn
        else:
            context_fn = partial(torch_checkpointing.create_selective_checkpoint_contexts,
                                 selective_policy)
            checkpointed = wrap(library, fn, context_fn=context_fn)
        return backward_results(lambda: checkpointed(x), [x, w, *layer.parameters()], how)

    plain = run("plain")
    assert_bitwise_equal(run("torch"), plain)
    assert_bitwise_equal(run("ckptlib"), plain)


def test_torchs_selective_contexts_keep_ops_with_several_outputs():
    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        keep = op in (torch.ops.aten.var_mean.correction, torch.ops.aten.topk.default)
        return (torch_checkpointing.CheckpointPolicy.MUST_SAVE if keep
                else torch_checkpointing.CheckpointPolicy.PREFER_RECOMPUTE)

    def fn(t: torch.Tensor) -> torch.Tensor:
        variance, mean = torch.var_mean(t.sin(), dim=1, keepdim=True)
        top, _ = t.cos().topk(3, dim=1)
        return ((t - mean) / (variance + 1)).sum(1) + top.sum(1)

    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0), requires_grad=True)
    context_fn = partial(torch_checkpointing.create_selective_checkpoint_contexts, policy)
    plain = backward_results(lambda: fn(x), [x], "grad")
    for library in LIBRARIES:
        got = backward_results(lambda: wrap(library, fn, context_fn=context_fn)(x), [x], "grad")
        assert_bitwise_equal(got, plain)


def test_torchs_selective_contexts_refuse_a_double_backward_under_either():
    # torch's selective cache hands each kept output to one backward; a double backward asks
    # again, and the cache refuses, under torch's checkpoint as under ckptlib's.
    x, w = leaves()
    context_fn = partial(torch_checkpointing.create_selective_checkpoint_contexts,
                         selective_policy)
    for library in LIBRARIES:
        fn = wrap(library, lambda t: (t @ w).relu().sigmoid() @ w, context_fn=context_fn)
        with pytest.raises(RuntimeError, match="backward an extra time"):
            backward_results(lambda: fn(x), [x, w], "double")


# ---------------------------------------------------------------------------
# The determinism check
# ---------------------------------------------------------------------------


CHANGES = {
    # the rerun saves a tensor of another shape
    "shape": lambda t, changed: (t.repeat(2, 1) if changed else t).sin(),
    # of another dtype
    "dtype": lambda t, changed: (t.double() if changed else t).sin(),
    # fewer tensors
    "fewer": lambda t, changed: t.sin() if changed else t.sin().exp(),
}


@pytest.mark.parametrize("change", CHANGES)
def test_a_rerun_that_saves_other_tensors_is_refused_by_both(change):
    state = {"changed": False}
    x = torch.randn(3, 4, requires_grad=True)

    def fn(t: torch.Tensor) -> torch.Tensor:
        return CHANGES[change](t, state["changed"])

    for library in LIBRARIES:
        assert_rerun_refused(library, fn, x, state)


def test_a_rerun_that_saves_more_tensors_is_refused_without_early_stop_and_unseen_with_it():
    state = {"changed": False}
    x = torch.randn(3, 4, requires_grad=True)

    def fn(t: torch.Tensor) -> torch.Tensor:
        h = t.sin()
        return h.exp().cos() if state["changed"] else h

    for library in LIBRARIES:
        with torch_checkpointing.set_checkpoint_early_stop(False):
            state["changed"] = False
            out = wrap(library, fn)(x)
        state["changed"] = True
        with pytest.raises(CHECKPOINT_ERROR[library], match="more"):
            out.sum().backward()
        # with early stop the rerun ends at the last tensor the forward saved: the extra ops
        # after it never run, and the gradient is the forward's
        state["changed"] = False
        out = wrap(library, fn)(x)
        state["changed"] = True
        (grad,) = torch.autograd.grad(out.sum(), x)
        assert torch.equal(grad, x.cos())


def test_determinism_check_none_checks_no_metadata_in_either():
    # A rerun that computes other values with tensors of the same metadata is seen by neither
    # check; with determinism_check="none" both give the same (changed) gradients.
    state = {"scale": 1.0}
    x = torch.randn(3, 4, requires_grad=True)

    def fn(t: torch.Tensor) -> torch.Tensor:
        return (t * state["scale"]).sin()

    grads = []
    for library in LIBRARIES:
        state["scale"] = 1.0
        out = wrap(library, fn, determinism_check="none")(x)
        state["scale"] = 2.0
        grads.append(torch.autograd.grad(out.sum(), x)[0])
    assert_bitwise_equal(grads[:1], grads[1:])
    assert torch.equal(grads[0], (2.0 * x).cos())   # the rerun's values, in both
