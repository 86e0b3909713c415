"""Edge cases at the reach of the library: what the guards watch, user objects they walk, what the
memory meter counts, graphs too big to draw, NumPy numbers as arguments.

Each checkpoint case is compared with plain autograd (bitwise) and, where it runs, with
``torch.utils.checkpoint(use_reentrant=False)``. Where ckptlib is right and torch is not, the
test says so in a comment starting ``torch differs:``.
"""
from __future__ import annotations

import copy
import stat
import time
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as torch_checkpoint_module

from ckptlib import CheckpointError, checkpoint, checkpoint_sequential, record_trace
from ckptlib.graph import autograd_graph, render_svg, to_dot
from ckptlib.graph import render as render_module
from ckptlib.graph.render import node_count
from ckptlib.memory import MemoryMeter, measure
from tests._grads import assert_bitwise_equal
from tests._misuse import assert_nothing_installed


def torch_checkpoint(fn, *args):
    return torch_checkpoint_module.checkpoint(fn, *args, use_reentrant=False)


def grads(loss: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, tensors))


# ---------------------------------------------------------------------------
# The version guard watches what the region reads
# ---------------------------------------------------------------------------


def bn_chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.BatchNorm1d(4))


def test_a_batchnorm_in_a_later_segment_does_not_trip_an_earlier_one():
    # Segment layers[0:2] is checkpointed; the BatchNorm runs (and bumps its buffers) after it.
    x = torch.randn(5, 4, requires_grad=True)
    plain, ours, theirs = bn_chain(), bn_chain(), bn_chain()
    expected = grads(plain(x).square().sum(), [x, *plain.parameters()])
    got = grads(checkpoint_sequential(ours, 2, x).square().sum(), [x, *ours.parameters()])
    assert_bitwise_equal(got, expected)
    torch_got = grads(
        torch_checkpoint_module.checkpoint_sequential(theirs, 2, x, use_reentrant=False)
        .square()
        .sum(),
        [x, *theirs.parameters()],
    )
    assert_bitwise_equal(torch_got, expected)
    # the BatchNorm ran once, outside any checkpoint
    assert_bitwise_equal(list(ours.buffers()), list(plain.buffers()))


def test_a_lambda_over_a_whole_model_that_checkpoints_one_layer_of_it():
    x = torch.randn(5, 4, requires_grad=True)

    def loss_of(model, run):
        hidden = run(lambda t: model[1](model[0](t)), x)   # the lambda reaches the whole model
        return model[3](model[2](hidden)).square().sum()

    plain, ours, theirs = bn_chain(), bn_chain(), bn_chain()
    expected = grads(loss_of(plain, lambda fn, t: fn(t)), [x, *plain.parameters()])
    assert_bitwise_equal(grads(loss_of(ours, checkpoint), [x, *ours.parameters()]), expected)
    assert_bitwise_equal(
        grads(loss_of(theirs, torch_checkpoint), [x, *theirs.parameters()]), expected
    )


def test_a_step_on_a_weight_the_region_saved_still_raises():
    torch.manual_seed(0)
    layer = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    loss = checkpoint(layer, x).tanh().sum()
    with torch.no_grad():
        layer.weight.add_(1)
    with pytest.raises(
        CheckpointError,
        match=r"parameter `Linear.weight` .* was modified in place between the "
        r"forward pass and this recomputation .* and the recomputation reads it",
    ):
        loss.backward()
    assert_nothing_installed()
    # Plain autograd raises too: it saved the weight.
    plain_loss = layer(x).tanh().sum()
    with torch.no_grad():
        layer.weight.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        plain_loss.backward()


def test_a_step_on_a_bias_the_region_reads_raises_where_torch_is_silently_wrong():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    x = torch.randn(5, 4, requires_grad=True)

    def step_then_backward(run):
        model_copy = copy.deepcopy(model)
        out = run(
            lambda t: model_copy[0](t).tanh(), x
        )  # tanh saves its output, which used the bias
        model_copy[1](out).sum()   # the rest of the model runs too: its buffers change, harmlessly
        with torch.no_grad():
            model_copy[0].bias.add_(1)   # the bias is read, not saved: plain autograd does not mind
        return grads(out.square().sum(), [x])

    expected = step_then_backward(lambda fn, t: fn(t))
    with pytest.raises(
        CheckpointError, match=r"parameter `model_copy.0.bias` .* and the recomputation reads it"
    ):
        step_then_backward(checkpoint)
    assert_nothing_installed()
    # torch differs: its rerun computes with the stepped bias and gives another gradient, silently.
    assert not torch.equal(step_then_backward(torch_checkpoint)[0], expected[0])


def test_a_step_on_a_layer_the_region_does_not_read_is_no_reason_to_refuse():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    expected = grads(model[0](x).tanh().square().sum(), [x, model[0].weight])
    out = checkpoint(lambda t: model[0](t).tanh(), x)
    with torch.no_grad():
        model[1].weight.add_(1)   # reachable from the lambda, never read by it
    assert_bitwise_equal(grads(out.square().sum(), [x, model[0].weight]), expected)


def test_a_second_backward_after_a_refused_read_is_refused_again():
    torch.manual_seed(0)
    layer = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    loss = checkpoint(lambda t: layer(t).tanh(), x).sum()
    with torch.no_grad():
        layer.bias.add_(1)
    for _ in range(2):   # the refused rerun must not make the changed bias the new normal
        with pytest.raises(CheckpointError, match="and the recomputation reads it"):
            loss.backward(retain_graph=True)
    assert_nothing_installed()


def first_cnn() -> nn.Sequential:
    """A learner's first own model: two conv blocks with batch norm and dropout, then a
    classifier."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.2),
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.2),
        nn.Flatten(), nn.Linear(8 * 6 * 6, 10),
    )


def test_a_first_cnn_with_batchnorm_and_dropout_under_checkpoint_sequential_gives_plain_gradients():
    """Gradients bitwise equal to plain autograd's, and the batch-norm statistics too: ckptlib's
    rerun runs with the statistics the forward saw and leaves them as the forward did, with no
    warning. torch.utils.checkpoint gives the same gradients but updates the statistics twice."""
    images = torch.randn(4, 3, 6, 6)
    labels = torch.tensor([1, 3, 5, 7])

    def step(model, run):
        torch.manual_seed(1)   # the same dropout masks in every run
        loss = nn.functional.cross_entropy(run(model, images), labels)
        return grads(loss, list(model.parameters())), list(model.buffers())

    plain, ours, theirs = first_cnn(), first_cnn(), first_cnn()
    expected, expected_buffers = step(plain, lambda model, t: model(t))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got, got_buffers = step(ours, lambda model, t: checkpoint_sequential(model, 3, t))
    assert_bitwise_equal(got, expected)
    assert_bitwise_equal(got_buffers, expected_buffers)
    torch_grads, torch_buffers = step(
        theirs,
        lambda model, t: torch_checkpoint_module.checkpoint_sequential(
            model, 3, t, use_reentrant=False
        ),
    )
    assert_bitwise_equal(torch_grads, expected)
    assert [b.item() for b in torch_buffers if b.ndim == 0] == [2, 2]   # torch: twice


# ---------------------------------------------------------------------------
# The guard walk and the region name meet user objects
# ---------------------------------------------------------------------------


def traced_layer() -> tuple[nn.Linear, torch.jit.ScriptModule]:
    torch.manual_seed(0)
    layer = nn.Linear(4, 4)
    return layer, torch.jit.trace(layer, torch.randn(2, 4))


@pytest.mark.filterwarnings("ignore:`torch.jit.trace:DeprecationWarning")
def test_a_traced_module_and_a_lambda_around_one_give_plain_gradients():
    # Early stop inside TorchScript is another matter (the interpreter wraps the exception that
    # stops the rerun, torch's as well as ckptlib's): off here, for both.
    layer, traced = traced_layer()
    x = torch.randn(3, 4, requires_grad=True)
    expected = grads(traced(x).tanh().sum(), [x, layer.weight])
    for fn in (traced, lambda t: traced(t)):
        assert_bitwise_equal(
            grads(checkpoint(fn, x, early_stop=False).tanh().sum(), [x, layer.weight]), expected
        )
        with torch_checkpoint_module.set_checkpoint_early_stop(False):
            assert_bitwise_equal(
                grads(torch_checkpoint(fn, x).tanh().sum(), [x, layer.weight]), expected
            )


@pytest.mark.filterwarnings("ignore:`torch.jit.trace:DeprecationWarning")
def test_a_traced_module_with_early_stop_on_gives_plain_gradients_where_torch_fails():
    # The rerun marks its own stop, so a stop wrapped by the TorchScript interpreter is still a
    # stop.
    layer, traced = traced_layer()
    for _ in range(3):          # TorchScript's profiling executor: run 1 may differ from run 2
        traced(torch.randn(3, 4))
    x = torch.randn(3, 4, requires_grad=True)
    expected = grads(traced(x).tanh().sum(), [x, layer.weight])
    for fn in (traced, lambda t: traced(t)):
        assert_bitwise_equal(grads(checkpoint(fn, x).tanh().sum(), [x, layer.weight]), expected)
    # torch.utils.checkpoint is wrong here: its early stop comes out of the interpreter as an error.
    with pytest.raises(RuntimeError, match="TorchScript interpreter"):
        torch_checkpoint(traced, x).tanh().sum().backward()


@pytest.mark.filterwarnings("ignore:`torch.jit.trace:DeprecationWarning")
def test_a_step_on_a_weight_read_inside_torchscript_is_refused():
    layer, traced = traced_layer()
    x = torch.randn(3, 4, requires_grad=True)
    loss = checkpoint(lambda t: traced(t).tanh(), x, early_stop=False).sum()
    with torch.no_grad():
        layer.bias.add_(1)
    with pytest.raises(CheckpointError, match=r"`traced.bias` .* and the recomputation reads it"):
        loss.backward()
    assert_nothing_installed()


class AnswersEverything:
    """A proxy: every attribute exists, and is another proxy."""

    def __init__(self, fn):
        object.__setattr__(self, "_fn", fn)

    def __getattr__(self, name):
        return AnswersEverything(self._fn)

    def __call__(self, *args):
        return self._fn(*args)


class RaisesOnEveryAttribute:
    def __getattr__(self, name):
        raise RuntimeError(f"no attribute {name} today")

    def __call__(self, t):
        return t.exp().sin()


class RaisingProperties:
    @property
    def __self__(self):
        raise RuntimeError("no self")

    @property
    def __func__(self):
        raise RuntimeError("no func")

    @property
    def __code__(self):
        raise RuntimeError("no code")

    def __call__(self, t):
        return t.exp().sin()


@pytest.mark.parametrize(
    "make",
    [lambda: AnswersEverything(lambda t: t.exp().sin()), RaisesOnEveryAttribute, RaisingProperties],
    ids=["proxy", "raising getattr", "raising properties"],
)
def test_user_objects_never_crash_the_walk_or_the_region_name(make):
    x = torch.randn(3, requires_grad=True)
    expected = grads(x.exp().sin().sum(), [x])
    with record_trace() as trace:
        got = grads(checkpoint(make(), x).sum(), [x])
    assert_bitwise_equal(got, expected)
    assert_bitwise_equal(grads(torch_checkpoint(make(), x).sum(), [x]), expected)
    region = trace.events[0].region
    assert region.name == type(make()).__name__
    assert_nothing_installed()


# ---------------------------------------------------------------------------
# The memory meter counts every kind of tensor, exactly
# ---------------------------------------------------------------------------

DENSE = torch.tensor([[1.0, 0.0], [0.0, 2.0]])   # two non-zeros, made before every block


def assert_counted_until_it_dies(make, nbytes: int) -> None:
    with MemoryMeter() as meter:
        kept = make()
        assert meter.live_bytes == nbytes
        del kept
    assert meter.live_bytes == 0 and meter.peak_bytes == nbytes


def test_a_sparse_coo_tensor_counts_its_indices_and_values():
    # indices: 2 dims x 2 non-zeros x int64 = 32 B; values: 2 x float32 = 8 B
    assert measure(lambda: DENSE.to_sparse()).peak_bytes == 40
    assert_counted_until_it_dies(DENSE.to_sparse, 40)


def test_a_compressed_sparse_tensor_counts_its_three_storages():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # "sparse CSR support is in beta"
        with MemoryMeter() as meter:
            kept = DENSE.to_sparse_csr()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (kept.crow_indices(), kept.col_indices(), kept.values())}
    assert len(storages) == 3
    # crow: 3 x int64, values: 2 x float32; the column indices may sit in a larger index storage
    assert storages[kept.crow_indices().untyped_storage().data_ptr()] == 24
    assert storages[kept.values().untyped_storage().data_ptr()] == 8
    assert meter.peak_bytes == meter.live_bytes == sum(storages.values())


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without MKL-DNN")
def test_an_mkldnn_tensor_counts_its_elements_until_it_dies():
    assert_counted_until_it_dies(DENSE.to_mkldnn, 4 * 4)


def test_a_wrapper_subclass_counts_its_inner_tensors():
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    pair = two_tensor.TwoTensor(torch.randn(100), torch.randn(100))
    assert measure(lambda: pair * 2).peak_bytes == 800   # two new inner tensors of 400 B
    jagged = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], layout=torch.jagged)
    assert measure(lambda: jagged * 2).peak_bytes == 6 * 3 * 4  # new values; the offsets are shared


def test_torch_tensor_from_a_list_counts_its_storage():
    assert measure(lambda: torch.tensor([1.0] * 1000)).peak_bytes == 4000
    array = np.ones(1000, dtype=np.float32)
    assert measure(lambda: torch.tensor(array)).peak_bytes == 4000     # a copy
    assert measure(lambda: torch.as_tensor(array)).peak_bytes == 0     # NumPy's memory, made before


def test_resize_and_out_count_the_memory_they_add():
    empty = torch.empty(0)
    assert measure(lambda: empty.resize_(1000)).peak_bytes == 4000
    assert measure(lambda: empty.resize_(500)).peak_bytes == 0   # a smaller size keeps the storage
    out = torch.empty(0)
    assert measure(lambda: torch.add(torch.ones(100), 1, out=out)).peak_bytes == 800
    assert (
        measure(lambda: torch.add(DENSE, 1, out=torch.empty(2, 2))).peak_bytes == 16
    )  # fits: no resize
    with MemoryMeter() as meter:
        grown = torch.ones(10)
        grown.resize_(1000)   # copied to a new block: for a moment both exist
    assert (meter.peak_bytes, meter.live_bytes) == (40 + 4000, 4000)


def test_a_storage_resized_directly_counts_its_new_size():
    with MemoryMeter() as meter:
        weight = torch.ones(1000)
        weight.untyped_storage().resize_(0)   # as FSDP frees a gathered parameter
        assert meter.live_bytes == 0
        weight.untyped_storage().resize_(4000)
        assert meter.live_bytes == 4000
    assert meter.peak_bytes == 4000
    made_before = torch.ones(10)
    with MemoryMeter() as meter:
        made_before.untyped_storage().resize_(400)   # a new block of 400 B, allocated in the block
    assert (meter.peak_bytes, meter.live_bytes) == (400, 400)
    assert_nothing_installed()   # UntypedStorage.resize_ is torch's own again


# ---------------------------------------------------------------------------
# Graphs too big to draw
# ---------------------------------------------------------------------------


def op_chain(length: int) -> torch.Tensor:
    x = torch.randn(3, requires_grad=True)
    y = x
    for step in range(length):
        y = y.sin() if step % 2 else y * 1.5
    return y


def test_a_ten_thousand_op_graph_is_refused_with_its_size_and_what_to_draw():
    y = op_chain(10_000)
    nodes = node_count(to_dot(autograd_graph(y)).source)
    assert nodes > 10_000
    with pytest.raises(ValueError) as error:
        render_svg(y)
    message = str(error.value)
    for words in (
        f"the drawing has {nodes} nodes",
        "max_nodes=1000",
        'collapse="module"',
        "print(graph)",
        "max_nodes=None",
    ):
        assert words in message


def test_node_count_reads_names_not_labels():
    assert node_count('digraph G { rankdir=LR; a [label="x -> y; z"]; a:p -> b -> "c d"; '
                      'subgraph cluster_0 { label="box"; e } }') == 4
    x = torch.randn(3, requires_grad=True)
    graph = autograd_graph(x.exp().sin(), params={"x": x})
    source = to_dot(graph, legend=False).source
    assert node_count(source) == len(graph.nodes) + 1   # and one box for the saved tensor of sin


def test_a_dot_that_does_not_finish_is_stopped(tmp_path, monkeypatch):
    slow_dot = tmp_path / "dot"
    slow_dot.write_text("#!/bin/sh\nexec sleep 30\n")
    slow_dot.chmod(slow_dot.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(
        render_module.shutil, "which", lambda name: str(slow_dot) if name == "dot" else None
    )
    began = time.monotonic()
    with pytest.raises(
        TimeoutError,
        match=r"render_svg: Graphviz `dot` did not finish laying out 2 nodes within "
        r"timeout_s=0.5 s",
    ):
        render_svg("digraph { a -> b }", timeout_s=0.5)
    assert time.monotonic() - began < 25   # killed, not waited for


@pytest.mark.skipif(render_module._TimedWebAssembly.get() is None,
                    reason="no wasmtime for Graphviz's WebAssembly build")
def test_a_webassembly_layout_that_does_not_finish_is_stopped_and_the_next_one_runs(
    monkeypatch, tmp_path
):
    monkeypatch.setenv("PATH", str(tmp_path))  # no system dot: the WebAssembly build draws
    dense = (
        "digraph {"
        + " ".join(f"n{i} -> n{i + 1}; n{i} -> n{i * 7 % 900};" for i in range(900))
        + "}"
    )
    with pytest.raises(
        TimeoutError, match=r"Graphviz \(WebAssembly\) did not finish laying out 901 nodes"
    ):
        render_svg(dense, timeout_s=0.2)
    assert "</svg>" in render_svg(
        "digraph { a -> b }"
    )  # a fresh instance after the interrupted one


# ---------------------------------------------------------------------------
# NumPy integers act as ints
# ---------------------------------------------------------------------------


def test_checkpoint_sequential_takes_a_numpy_integer():
    x = torch.randn(3, 4, requires_grad=True)
    models = [nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)) for _ in range(3)]
    for model in models[1:]:
        model.load_state_dict(models[0].state_dict())
    expected = grads(models[0](x).sum(), [x, *models[0].parameters()])
    got = grads(
        checkpoint_sequential(models[1], np.int64(2), x).sum(), [x, *models[1].parameters()]
    )
    assert_bitwise_equal(got, expected)
    torch_got = torch_checkpoint_module.checkpoint_sequential(
        models[2], np.int64(2), x, use_reentrant=False
    )
    assert_bitwise_equal(grads(torch_got.sum(), [x, *models[2].parameters()]), expected)
