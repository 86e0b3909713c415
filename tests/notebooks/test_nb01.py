"""Notebook 01, autograd graphs: the claims its prose and its pictures make, checked with torch.

Each test names the notebook section whose words it checks; when one fails, the notebook's text
(or a title computed from the same numbers) needs another look, not only the code.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import nbformat
import pytest
import torch

from ckptlib import MLPChain, palette
from ckptlib.graph import autograd_graph, to_dot, torchviz_dot, trace_modules
from ckptlib.memory import MemoryMeter

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


# -- 01: autograd graphs ---------------------------------------------------------------------


def test_01_the_articles_grad_fn_example_records_nothing():
    assert torch.tensor(1.0).sin().grad_fn is None
    assert type(torch.tensor(1.0, requires_grad=True).sin().grad_fn).__name__ == "SinBackward0"


@pytest.mark.parametrize("retain_graph, alive_bytes", [(False, 0), (True, 1024 * 2 * 4)])
def test_01_backward_frees_saved_tensors_and_retain_graph_keeps_one_shared_tensor(
    retain_graph, alive_bytes
):
    """tanh saves its output and pow its input: one tensor, kept once; mm's saved x is data."""
    torch.manual_seed(0)
    x_big, w = torch.randn(1024, 3), torch.randn(3, 2, requires_grad=True)
    b = torch.zeros(2, requires_grad=True)
    with MemoryMeter("cpu", backend="tensors") as meter:
        loss = (torch.tanh(x_big @ w + b) ** 2).mean()
        loss.backward(retain_graph=retain_graph)
    loss_and_grads = sum(t.untyped_storage().nbytes() for t in (loss, w.grad, b.grad))
    assert meter.live_bytes - loss_and_grads == alive_bytes


def test_01_backward_runs_twice_through_ops_that_save_nothing():
    a, b = torch.randn(3, requires_grad=True), torch.zeros(2, requires_grad=True)
    total = (a + b.sum()).sum()
    total.backward()
    total.backward()
    assert a.grad.tolist() == [2.0, 2.0, 2.0]
    loss = torch.tanh(a).sum()
    loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


def test_01_a_saved_leaf_is_marked_leaf_not_counted():
    torch.manual_seed(0)
    x, w, b = (
        torch.randn(4, 3),
        torch.randn(3, 2, requires_grad=True),
        torch.zeros(2, requires_grad=True),
    )
    graph = autograd_graph((torch.tanh(x @ w + b) ** 2).mean(), params={"w": w, "b": b, "x": x})
    assert "= x (leaf, not counted)" in str(graph)
    assert graph.saved_bytes == 4 * 2 * 4   # tanh's output, shared with pow: counted once
    assert "leaf, not counted" in "\n".join(to_dot(graph).body)


def test_01_collapsed_module_boxes_add_up_to_the_caption():
    """01 section 5: each block's box holds its input, the loss its two tensors: 6 x 256 B = 1536
    B."""
    torch.manual_seed(0)
    model = MLPChain(depth=4, width=16)
    batch = model.example_batch(batch=4)
    with trace_modules(model) as modules:
        loss = model.loss(batch)
    graph = autograd_graph(loss, modules=modules)
    body = to_dot(graph, collapse="module").body
    module_boxes = [int(n) for line in body for n in re.findall(r"saved (\d+) B", line)]
    loose_boxes = [
        int(n)
        for line in body
        if f'fillcolor="{palette.SAVED}"' in line and "legend" not in line
        for n in re.findall(r"\n(\d+) B", line)
    ]
    assert module_boxes == [256] * 4 and loose_boxes == [256, 256]
    assert sum(module_boxes) + sum(loose_boxes) == graph.saved_bytes == 1536


def test_01_torchviz_dot_displays_without_trusting_the_notebook():
    """01's cell shows make_dot's drawing through torchviz_dot: a PNG beside the SVG."""
    pytest.importorskip("torchviz")
    source = next(c.source for c in nbformat.read(NOTEBOOKS / "01_autograd_graphs.ipynb", 4).cells
                  if c.source.startswith("# NBVAL_IGNORE_OUTPUT\n# make_dot's drawing"))
    assert source.rstrip().endswith('torchviz_dot(loss, params={"w": w, "b": b})')
    w = torch.randn(3, 2, requires_grad=True)
    png = torchviz_dot((torch.randn(4, 3) @ w).sum(), params={"w": w})._repr_png_()
    assert png is not None and (png[0] if isinstance(png, tuple) else png).startswith(b"\x89PNG")


def test_01_torchviz_walks_recursively():
    """01 section 3: make_dot, like a recursive walk, fails on a 5000-op chain."""
    make_dot = pytest.importorskip("torchviz").make_dot
    deep = torch.randn(3, requires_grad=True)
    for _ in range(5000):
        deep = deep * 1.0
    with pytest.raises(RecursionError):
        make_dot(deep)


@pytest.mark.parametrize("guess, verdict", [(None, "Right."), ("None", "Right."),
                                            ("SinBackward0", "Not this time")])
def test_01_no_node_is_a_right_answer_to_the_articles_grad_fn(guess, verdict):
    """01 section 1 asks for the node's name, or None when there is none: None is right, quoted or
    not."""
    cells = {
        cell.get("id"): cell.source
        for cell in nbformat.read(NOTEBOOKS / "01_autograd_graphs.ipynb", 4).cells
    }
    namespace: dict = {}
    for cell_id in ("01-001", "01-003"):  # imports, then x, w, b and the small graph
        exec(cells[cell_id], namespace)
    namespace["guess_article_grad_fn"] = guess
    module = ast.parse(cells["01-005"])
    *statements, shown = module.body  # the cell shows its last expression's value
    exec(compile(ast.Module(statements, type_ignores=[]), "<01-005>", "exec"), namespace)
    verdict_shown = eval(compile(ast.Expression(shown.value), "<01-005>", "eval"), namespace)
    assert verdict in repr(verdict_shown), repr(verdict_shown)


def test_01_exercise_2_is_shown_what_it_needs_on_ops_it_does_not_check():
    """01 Exercise 2: before the exercise, a cell prints what saved_roles must read (an output kept
    under a name the op's signature gives it, an input that is neither self nor other, numbered
    results, values that are not tensors), on ops its self-check does not ask about."""
    path = NOTEBOOKS / "01_autograd_graphs.ipynb"
    cells = nbformat.read(path, 4).cells
    exercise = next(index for index, cell in enumerate(cells)
                    if cell.metadata.get("nbgrader", {}).get("grade_id") == "exercise-2")
    worked = cells[exercise - 2]
    assert worked.cell_type == "code" and "show_saved(node)" in worked.source
    printed = "".join(output.get("text", "") for output in worked.outputs)
    for shown in (r"_saved_indices +tensor", r"-> \(Tensor values, Tensor indices\)",
                  r"_saved_index +tensor", r"_saved_result1 +tensor",
                  r"-> \(Tensor, Tensor, Tensor\)", r"_saved_weight +None", r"_saved_dim +1"):
        assert re.search(shown, printed), shown
    check = next(cell.source for cell in cells
                 if cell.metadata.get("nbgrader", {}).get("grade_id") == "exercise-2-check")
    for op in ("topk", "gather", "group_norm"):
        assert op in worked.source and op not in check, op
