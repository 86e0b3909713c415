"""Claims of notebook 03, building checkpoint, that code can check, run on the notebook's own cells.

- 03, section 6: the whole checkpoint the notebook builds, in one cell, gives gradients bitwise
  equal to plain autograd and to ``torch.utils.checkpoint(use_reentrant=False)``, dropout
  included, for several input shapes.
- 03, what ckptlib checks (2.4, step 6, section 4): an input modified in place is named in a
  ``CheckpointError`` (torch gives autograd's own error); the key of a saved tensor holds its
  producer, so ``exp`` swapped for ``sin`` is refused where a shape check hands out a wrong
  tensor; an optimizer step between forward and backward is refused; and in section 7 the

Cells are taken from the notebooks by nbgrader grade id (stable across rebuilds, the same in a
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import ckptlib
from ckptlib import CheckpointError, record_trace
from ckptlib.models import MLPChain

from tests._grads import assert_bitwise_equal, gradients
from tests._notebooks import cell_source, run_cell

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
NB03 = NOTEBOOKS / "03_building_checkpoint.ipynb"


# ---------------------------------------------------------------- 03, the checkpoint in one cell

@pytest.fixture(scope="module")
def one_cell_checkpoint():
    namespace: dict = {"__name__": "notebook_03_one_cell"}
    run_cell(cell_source(NB03, cell_id="03-one-cell"), namespace)  # the cell stands alone
    return namespace["one_cell_checkpoint"]


def functions_to_checkpoint():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 24), nn.Tanh(), nn.Linear(24, 8))
    block = nn.Sequential(
        nn.LayerNorm(8), nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.3), nn.Linear(32, 8)
    ).train()
    weight = torch.randn(8, 8, requires_grad=True)

    def in_place_and_view(t):
        h = t @ weight
        h.relu_()
        return h.transpose(-2, -1).reshape(-1)[:16].sin()

    return {
        "mlp": (mlp, list(mlp.parameters())),
        "residual block with dropout": (lambda t: t + block(t), list(block.parameters())),
        "in-place and view": (in_place_and_view, [weight]),
        "dropout alone": (lambda t: F.dropout(t.exp(), p=0.5, training=True).sin(), []),
    }


@pytest.mark.parametrize("shape", [(3, 8), (1, 8), (2, 4, 8)])
@pytest.mark.parametrize("name", list(functions_to_checkpoint()))
def test_one_cell_checkpoint_is_bitwise_equal_to_plain_autograd_and_torch(
    one_cell_checkpoint, name, shape
):
    fn, parameters = functions_to_checkpoint()[name]
    inputs = torch.randn(*shape, requires_grad=True)
    tensors = [inputs, *parameters]
    ours = gradients(lambda: one_cell_checkpoint(fn, inputs), tensors, seed=0)
    assert_bitwise_equal(gradients(lambda: fn(inputs), tensors, seed=0), ours)
    assert_bitwise_equal(
        gradients(lambda: torch_checkpoint(fn, inputs, use_reentrant=False), tensors, seed=0), ours
    )


def test_one_cell_checkpoint_recomputes_per_backward_pass_and_leaves_the_random_stream(
    one_cell_checkpoint,
):
    x = torch.randn(6, requires_grad=True)
    (expected,) = torch.autograd.grad(x.sin().exp().cos().sum(), x)
    out = one_cell_checkpoint(lambda t: t.sin().exp().cos(), x).sum()
    assert torch.equal(torch.autograd.grad(out, x, retain_graph=True)[0], expected)
    assert torch.equal(torch.autograd.grad(out, x)[0], expected)

    def next_random(wrap):
        torch.manual_seed(1)
        wrap(lambda t: F.dropout(t, p=0.5, training=True), x).sum().backward()
        return torch.rand(4)

    assert torch.equal(next_random(lambda fn, *args: fn(*args)), next_random(one_cell_checkpoint))


def test_one_cell_checkpoint_names_a_rerun_that_saves_another_shape(one_cell_checkpoint):
    setting = {"keep": 5}
    x = torch.randn(5, requires_grad=True)
    out = one_cell_checkpoint(lambda t: t[: setting["keep"]].sin(), x)
    setting["keep"] = 3
    with pytest.raises(CheckpointError, match=r"saved tensor #0: forward saved shape \(5,\)"):
        torch.autograd.grad(out.sum(), x)


# ---------------------------------------------------------------- 03, what ckptlib checks

def modified_input_error(wrap) -> RuntimeError:
    x = torch.linspace(-1, 1, 5, requires_grad=True)
    h = x * 1.0
    out = wrap(torch.sin, h)
    with torch.no_grad():
        h.add_(1.0)
    with pytest.raises(RuntimeError) as caught:
        torch.autograd.grad(out.sum(), x)
    return caught.value


def test_03_an_input_modified_in_place_is_named_by_ckptlib_and_refused_by_torch():
    error = modified_input_error(ckptlib.checkpoint)
    assert isinstance(error, CheckpointError)
    assert "input tensor #0" in str(error) and "modified in place" in str(error)
    error = modified_input_error(lambda fn, t: torch_checkpoint(fn, t, use_reentrant=False))
    assert not isinstance(error, CheckpointError) and "modified by an inplace operation" in str(
        error
    )


def test_03_the_key_holds_the_producer_so_exp_swapped_for_sin_is_refused(one_cell_checkpoint):
    def exp_then_sin(wrap):
        setting = {"op": torch.exp}
        x = torch.randn(5, requires_grad=True)
        out = wrap(lambda t: setting["op"](t), x)
        setting["op"] = torch.sin
        (grad,) = torch.autograd.grad(out.sum(), x)
        return torch.equal(grad, x.detach().exp())

    assert exp_then_sin(one_cell_checkpoint) is False  # shapes agree: a silently wrong gradient
    with pytest.raises(
        CheckpointError,
        match=r"made by ExpBackward0; recomputation produced one that is an "
        r"input of the region \(same shape, another operation\)",
    ):
        exp_then_sin(ckptlib.checkpoint)


def test_03_an_optimizer_step_between_forward_and_backward_is_refused():
    layer = nn.Linear(4, 4)
    out = ckptlib.checkpoint(layer, torch.randn(2, 4, requires_grad=True)).relu().sum()
    with torch.no_grad():
        layer.weight.sub_(0.1)   # what optimizer.step() does
    with pytest.raises(CheckpointError, match=r"parameter `Linear.weight` .* modified in place"):
        out.backward()


def test_03_per_block_trace_counts_the_block_output_as_alive_not_freed():
    """Section 7: each one-layer block's ReLU output is its output, the next block's input."""
    torch.manual_seed(0)
    model = MLPChain(depth=3, width=16, checkpointing="block")
    with record_trace() as trace:
        model.training_step(model.example_batch(batch=32))
    done = [event.detail for event in trace.events if event.kind == "forward_done"]
    relu_output_bytes = 32 * 16 * 4
    # block 0 saves its input and its ReLU output; blocks 1 and 2 also the weight (their input needs
    # grad)
    assert done == [
        f"{saves} saved tensors dropped, 0 bytes of activations freed ({relu_output_bytes} more "
        "are the region's output, alive while it is); kept the inputs, RNG and autocast state"
        for saves in (2, 3, 3)
    ]


# ---------------------------------------------------- 03, section 4: what the version check covers


@pytest.mark.parametrize(
    "modify", ["input", "parameter it reads", "buffer it reads", "captured tensor"]
)
def test_03_the_version_check_covers_what_the_region_reads(modify):
    """Section 4: before a rerun ckptlib checks the versions of what the region read: its inputs
    and the parameters, buffers and captured tensors its forward used."""
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(4).eval()                       # eval: reads its running statistics
    layer = nn.Linear(4, 4)
    scale = torch.rand(4) + 0.5
    inputs = torch.randn(3, 4, requires_grad=True) * 1.0
    region = nn.Sequential(layer, norm)
    out = ckptlib.checkpoint(lambda t: (region(t) * scale).tanh(), inputs)
    changed = {
        "input": inputs,
        "parameter it reads": layer.weight,
        "buffer it reads": norm.running_mean,
        "captured tensor": scale,
    }[modify]
    with torch.no_grad():
        changed.add_(0.5)
    with pytest.raises(CheckpointError, match="modified in place"):
        out.sum().backward()
    assert "what the region reads" in cell_source(NB03, cell_id="03-063")
