"""Claims of notebook 02, saved-tensor hooks, that code can check, run on the notebook's own cells.

- 02, Exercise 2 ("save half the bytes"): the self-check measures the bytes the autograd graph
  keeps alive after forward, with the course's ``MemoryMeter``, with and without the learner's
  hooks. The first solution's hook (copied below: a bfloat16 copy of every float32 save,
  parameters and repeated saves included) *adds* memory, and the self-check now rejects it; the
  current solution keeps exactly half, and passes.

Cells are taken from the notebooks by nbgrader grade id (stable across rebuilds, the same in a
"""
from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef

from tests._notebooks import cell_source, run_cell

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
NB02 = NOTEBOOKS / "02_saved_tensors_hooks.ipynb"
NB02_SOLUTIONS = NOTEBOOKS / "solutions" / "02_saved_tensors_hooks_solutions.ipynb"


# ---------------------------------------------------------------- 02, Exercise 2

def first_solution_pack(tensor):
    """The hook the first solution shipped: every float32 save converted, each save on its own."""
    if tensor.dtype == torch.float32:
        return tensor.dtype, tensor.to(torch.bfloat16)
    return tensor.dtype, tensor.detach()


def first_solution_unpack(stored):
    dtype, tensor = stored
    return tensor.to(dtype)


_parameters_only_copies: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def parameters_only_pack(tensor):
    """A learner's hook: skips parameters, converts each storage once, but copies the input
    batch."""
    owner = tensor if tensor._base is None else tensor._base
    if tensor.dtype != torch.float32 or (owner.is_leaf and owner.requires_grad):
        return tensor.detach()
    key = (
        StorageWeakRef(tensor.untyped_storage()),
        tensor.storage_offset(),
        tensor.shape,
        tensor.stride(),
    )
    copy = _parameters_only_copies.get(key)
    if copy is None:
        copy = _parameters_only_copies[key] = tensor.to(torch.bfloat16)
    return torch.float32, copy


def parameters_only_unpack(stored):
    return stored[1].to(stored[0]) if isinstance(stored, tuple) else stored


def notebook_02_namespace() -> dict:
    namespace: dict = {"__name__": "notebook_02"}
    run_cell(cell_source(NB02, cell_id="02-001"), namespace)  # imports, seed, device
    return namespace


def run_exercise_2_check(namespace: dict) -> str:
    return run_cell(cell_source(NB02, grade_id="exercise-2-check"), namespace)


def test_exercise_2_check_rejects_the_first_solution_which_adds_memory():
    namespace = notebook_02_namespace()
    namespace.update(pack_bf16=first_solution_pack, unpack_bf16=first_solution_unpack)
    with pytest.raises(AssertionError, match="the copies add memory"):
        run_exercise_2_check(namespace)
    assert namespace["graph_hooked"] > namespace["graph_plain"] > 0


def test_exercise_2_check_accepts_the_solution_which_keeps_half():
    namespace = notebook_02_namespace()
    run_cell(cell_source(NB02_SOLUTIONS, grade_id="exercise-2"), namespace)
    printed = run_exercise_2_check(namespace)
    assert printed.startswith("correct:"), printed
    assert 2 * namespace["graph_hooked"] == namespace["graph_plain"]


def test_exercise_2_check_accepts_a_smaller_real_saving():
    namespace = notebook_02_namespace()
    namespace.update(pack_bf16=parameters_only_pack, unpack_bf16=parameters_only_unpack)
    assert run_exercise_2_check(namespace).startswith("correct:")
    assert namespace["graph_plain"] / 2 < namespace["graph_hooked"] < namespace["graph_plain"]


def test_exercise_2_check_says_not_attempted_for_the_stub():
    namespace = notebook_02_namespace()
    run_cell(cell_source(NB02, grade_id="exercise-2"), namespace)
    assert run_exercise_2_check(namespace).startswith("not attempted yet")


def test_exercise_2_check_is_the_same_in_the_solutions():
    assert cell_source(NB02, grade_id="exercise-2-check") == cell_source(
        NB02_SOLUTIONS, grade_id="exercise-2-check"
    )


# ----------------------------------------------------- 02, Exercise 2: what the pack hook receives


def test_02_weight_view_that_linear_saves_is_no_leaf_but_its_base_is_the_parameter():
    """02 Ex2's text: a parameter and the batch are leaves; ``weight.t()`` has grad_fn TBackward0,
    is_leaf False, and its ``_base`` is the parameter. The notebook's cell prints the same."""
    layer = nn.Linear(4, 3)
    received = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: received.append(t) or t.detach(), lambda t: t
    ):
        layer(torch.randn(2, 4, requires_grad=True))
    batch, weight_view = received                         # addmm saves mat1 (the batch) and mat2
    assert batch.is_leaf and batch.grad_fn is None
    assert type(weight_view.grad_fn).__name__ == "TBackward0" and not weight_view.is_leaf
    assert weight_view._base is layer.weight

    namespace = notebook_02_namespace()
    printed = run_cell(cell_source(NB02, cell_id="02-n10"), namespace).splitlines()
    views = [line for line in printed if "TBackward0" in line]
    assert views and all(
        "is_leaf=False" in line and "_base=a parameter" in line for line in views
    ), printed
    assert any("grad_fn=None" in line and "is_leaf=True" in line for line in printed), printed
    markdown = cell_source(NB02, cell_id="02-041")
    assert (
        "(`TBackward0`) and `is_leaf` is `False`" in markdown
        and "none has a `grad_fn`" not in markdown
    )
