"""Offloading saved tensors to host memory (ckptlib.offload)."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn

import ckptlib.offload as offload
from ckptlib import checkpoint
from ckptlib.models import TransformerBlock
from ckptlib.offload import offload_saved_tensors
from tests._grads import assert_bitwise_equal, take_grads


def make_block(device: str = "cpu") -> TransformerBlock:
    torch.manual_seed(0)
    return TransformerBlock(d_model=32, heads=4, seq=16, dropout=0.0).to(device)


def gradients(block: nn.Module, x: torch.Tensor, context=None, wrap=None) -> list[torch.Tensor]:
    run = wrap or (lambda b, inp: b(inp))
    h = x * 1.5  # a non-leaf: the first block's input is an activation
    if context is None:
        out = run(block, run(block, h))
    else:
        with context:
            out = run(block, run(block, h))
    out.pow(2).sum().backward()
    return take_grads(x, block)


@pytest.fixture
def cpu_as_device(monkeypatch):
    """Pretend the CPU is an accelerator: every saved activation is copied to 'host' memory.

    On a machine without a GPU this runs the whole copy-out, copy-back path; only
    the choice of what to move is replaced (parameters are still kept in place).
    """
    def frees_memory(tensor: torch.Tensor) -> bool:
        owner = tensor._base if tensor._base is not None else tensor
        return tensor.layout == torch.strided and not (owner.is_leaf and owner.requires_grad)

    monkeypatch.setattr(offload, "_frees_device_memory", frees_memory)


def test_cpu_tensors_are_kept_without_a_copy():
    block = make_block()
    x = torch.randn(2, 16, 32, requires_grad=True)
    expected = gradients(block, x)
    hooks = offload_saved_tensors()
    assert_bitwise_equal(gradients(block, x, hooks), expected)
    assert hooks.offloaded_bytes == 0 and hooks.kept_count > 10

    x = torch.randn(3, requires_grad=True)
    with offload_saved_tensors():
        y = (x * 2).exp()
    assert y.grad_fn._saved_result.data_ptr() == y.data_ptr()      # the tensor itself, not a copy


def test_what_frees_device_memory():
    # Meta tensors stand in for device tensors: they have a device other than the CPU.
    weight = nn.Parameter(torch.empty(4, 3, device="meta"))
    activation = weight * 2
    batch = torch.empty(5, 4, device="meta")
    assert offload._frees_device_memory(activation)
    assert offload._frees_device_memory(activation.t())              # a view of an activation
    assert offload._frees_device_memory(batch)  # a leaf nobody differentiates
    assert not offload._frees_device_memory(weight)  # parameters stay where they are
    assert not offload._frees_device_memory(weight.t())              # ... and so do views of them
    assert not offload._frees_device_memory(torch.empty(4))          # already on the CPU


def test_offloaded_copies_come_back_equal(cpu_as_device):
    block = make_block()
    x = torch.randn(2, 16, 32, requires_grad=True)
    expected = gradients(block, x)
    hooks = offload_saved_tensors(
        pin_memory=True
    )  # pinning is skipped: the source is no CUDA tensor
    assert_bitwise_equal(gradients(block, x, hooks), expected)
    assert hooks.offloaded_bytes > 0
    # Per block call: 4 Linears save weight.t(), 2 LayerNorms their weight and bias.
    assert hooks.kept_count == 2 * (4 + 2 * 2)


def test_offloaded_copy_keeps_strides_and_is_a_copy(cpu_as_device):
    x = torch.randn(4, 6, requires_grad=True)
    with offload_saved_tensors() as hooks:
        transposed = (x * 2).t()                       # non-contiguous
        y = transposed.sin()                           # saves `transposed`
    saved = y.grad_fn._saved_self
    assert saved.stride() == transposed.stride() and torch.equal(saved, transposed)
    assert saved.data_ptr() != transposed.data_ptr()
    assert hooks.offloaded_bytes == transposed.nbytes


def test_with_checkpoint_only_the_block_inputs_are_offloaded(cpu_as_device):
    block = make_block()
    x = torch.randn(2, 16, 32, requires_grad=True)
    expected = gradients(block, x)
    hooks = offload_saved_tensors()
    assert_bitwise_equal(gradients(block, x, hooks, wrap=checkpoint), expected)
    # Two checkpointed blocks: their two inputs went to the host, nothing from inside them.
    assert hooks.offloaded_bytes == 2 * x.nbytes and hooks.kept_count == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_offload_to_pinned_memory(monkeypatch):
    pinned_flags = []
    host_copy = offload._host_copy

    def spy(tensor, pinned):
        host = host_copy(tensor, pinned)
        pinned_flags.append(host.is_pinned())
        return host

    monkeypatch.setattr(offload, "_host_copy", spy)
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).cuda()
    x = torch.randn(512, 256, device="cuda", requires_grad=True)

    def grads_and_memory(context):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with context:
            out = mlp(mlp(x))
        held = torch.cuda.memory_allocated() - before
        out.pow(2).sum().backward()
        return take_grads(x, mlp), held

    expected, held_plain = grads_and_memory(
        torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    )
    hooks = offload_saved_tensors(pin_memory=True)
    actual, held_offloaded = grads_and_memory(hooks)
    assert_bitwise_equal(actual, expected)
    assert pinned_flags and all(pinned_flags)
    assert hooks.offloaded_bytes > 0
    assert held_offloaded < held_plain - hooks.offloaded_bytes // 2

    hooks = offload_saved_tensors(pin_memory=True)
    with hooks:
        out = checkpoint(mlp, checkpoint(mlp, x * 1.0))
    out.pow(2).sum().backward()
    assert hooks.offloaded_bytes == 2 * x.nbytes                 # the two checkpoint inputs
    assert_bitwise_equal([x.grad, *(p.grad for p in mlp.parameters())], expected)


def test_kept_tensors_do_not_outlive_a_graph_dropped_without_backward():
    import gc

    from torch.multiprocessing.reductions import StorageWeakRef

    from ckptlib.offload import offload_saved_tensors

    x = torch.randn(1000, requires_grad=True)
    with offload_saved_tensors():
        y = x.exp()  # exp saves its own output: kept on CPU
    ref = StorageWeakRef(y.untyped_storage())
    del y
    gc.collect()
    assert ref.expired(), "the saved output kept itself alive through its grad_fn"


# ---------------------------------------------------------------------------
# In-place changes after forward: an error at unpack, as in plain autograd
# ---------------------------------------------------------------------------


def saved_then_modified(context):
    """``a`` is saved by sin, then changed in place before backward: d(sum(sin(a)))/dx."""
    x = torch.randn(6, requires_grad=True)
    with context:
        a = x * 2
        y = a.sin()
    with torch.no_grad():
        a.mul_(3.0)
    return x, y, a


def test_save_on_cpu_is_silent_where_offload_raises():
    x, y, _ = saved_then_modified(contextlib.nullcontext())
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):   # plain autograd
        y.sum().backward()
    x, y, _ = saved_then_modified(torch.autograd.graph.save_on_cpu())
    y.sum().backward()                                    # torch: no error, and a wrong gradient
    assert not torch.equal(x.grad, 2 * (2 * x.detach()).cos())
    x, y, _ = saved_then_modified(offload_saved_tensors())
    with pytest.raises(
        RuntimeError,
        match="offload_saved_tensors: one of the variables needed for gradient "
        "computation has been modified by an inplace operation: a saved tensor "
        "\\[torch.float32, shape \\[6\\]\\], which is the output of MulBackward0, "
        "needed by SinBackward0 is at version 1; expected version 0 instead",
    ):
        y.sum().backward()


def test_a_copied_saved_tensor_modified_in_place_raises_too(cpu_as_device):
    # The copy holds the forward's values; the check needs the original alive (here: `a`).
    x, y, a = saved_then_modified(offload_saved_tensors())
    with pytest.raises(
        RuntimeError, match="modified by an inplace operation.*Modify a clone instead"
    ):
        y.sum().backward()


def test_a_parameter_updated_before_backward_raises():
    layer = nn.Linear(4, 4)
    with offload_saved_tensors():
        y = layer(
            torch.randn(2, 4, requires_grad=True)
        ).sum()  # addmm saves weight.t() for the input's grad
    with torch.no_grad():
        layer.weight.add_(1.0)                             # an optimizer step before backward
    with pytest.raises(RuntimeError, match="needed by AddmmBackward0 is at version"):
        y.backward()


def test_pin_memory_must_be_a_bool():
    with pytest.raises(TypeError, match="pin_memory must be True or False, got 'yes' \\(str\\)"):
        offload_saved_tensors(pin_memory="yes")
