"""Notebook 09's self-checks, read from the notebook itself: plausible wrong answers fail, the
solutions pass.

- Exercise 1 ("the cheapest plan that fits"): a pick that does not fit, one that fits but is not the
  cheapest, one that ignores the tie on FLOPs, and one that never answers None are each refused.
- Exercise 2 ("checkpoint only the MLPs"): selecting the whole layers, or the MLPs' parts, is
refused;
  the solution's path pattern and the MLP class pass, gradients bitwise equal to plain.
"""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from tests._notebooks import cell_source as _cell_source, run_cell

ROOT = Path(__file__).resolve().parents[2]
NB09 = ROOT / "notebooks" / "09_your_own_model.ipynb"
NB09_SOLUTIONS = ROOT / "notebooks" / "solutions" / "09_your_own_model_solutions.ipynb"
MiB = 2**20


def cell_source(path: Path, grade_id: str) -> str:
    return _cell_source(path, grade_id=grade_id)


# (peak bytes, FLOPs): a plane shaped like the notebook's, with a tie on FLOPs at plain's cost.
PLANE = {
    "no checkpointing": (28 * MiB, 200),
    "selective": (14 * MiB, 200),
    "every 2nd layer": (16 * MiB, 230),
    "planner": (11 * MiB, 250),
    "per layer": (9.5 * MiB, 264),
    "Revolve": (8.5 * MiB, 330),
}


def exercise_1(answer) -> str:
    namespace = {"plane": dict(PLANE), "MiB": MiB, "GFLOP": 1e9, "cheapest_that_fits": answer}
    return run_cell(cell_source(NB09, "exercise-1-check"), namespace)


def lowest_peak(plane, budget):
    fitting = [n for n, (peak, _) in plane.items() if peak <= budget]
    return min(fitting, key=lambda n: plane[n][0]) if fitting else None


def cheapest_ignoring_budget(plane, budget):
    return min(plane, key=lambda n: (plane[n][1], plane[n][0]))


def cheapest_without_tie_break(plane, budget):
    fitting = [n for n, (peak, _) in plane.items() if peak <= budget]
    return min(fitting, key=lambda n: plane[n][1]) if fitting else None


def never_none(plane, budget):
    fitting = [n for n, (peak, _) in plane.items() if peak <= budget] or list(plane)
    return min(fitting, key=lambda n: (plane[n][1], plane[n][0]))


@pytest.mark.parametrize("wrong, message", [
    (lowest_peak, "another mechanism that fits costs"),
    (cheapest_ignoring_budget, "it does not fit"),
    (cheapest_without_tie_break, "ties on FLOPs"),
    (never_none, "nothing fits, return None"),
])
def test_exercise_1_check_refuses_wrong_picks(wrong, message):
    with pytest.raises(AssertionError, match=message):
        exercise_1(wrong)


def test_exercise_1_solution_passes_and_the_stub_is_not_attempted():
    namespace: dict = {}
    run_cell(cell_source(NB09_SOLUTIONS, "exercise-1"), namespace)
    printed = exercise_1(namespace["cheapest_that_fits"])
    assert printed.startswith(
        "Exercise 1 solved: 30 MiB -> selective; 12 MiB -> planner; 10 MiB -> per layer; "
        "8 MiB -> None"
    ), printed
    stub: dict = {}
    run_cell(cell_source(NB09, "exercise-1"), stub)
    assert exercise_1(stub["cheapest_that_fits"]).startswith("not attempted yet")


@pytest.fixture(scope="module")
def gpt2_namespace():
    """The solutions notebook's setup cells (the GPT-2, step, measure_point), run once."""
    pytest.importorskip("transformers")
    namespace: dict = {}
    for cell in nbformat.read(NB09_SOLUTIONS, as_version=4).cells:
        if cell.cell_type != "code":
            continue
        run_cell(cell.source, namespace)
        if (
            "plane" in namespace
        ):  # the plane's first point is measured: the exercises' setup is complete
            break
    namespace["plane"]["per layer"] = namespace["plane"][
        "no checkpointing"
    ]  # only printed by the check
    return namespace


def exercise_2(namespace: dict, select) -> str:
    return run_cell(cell_source(NB09, "exercise-2-check"), {**namespace, "mlp_select": select})


@pytest.mark.parametrize("wrong", ["transformer.h.*", "*.mlp.*"])
def test_exercise_2_check_refuses_other_modules(gpt2_namespace, wrong):
    with pytest.raises(AssertionError, match="expected exactly"):
        exercise_2(gpt2_namespace, wrong)
    assert "forward" not in vars(gpt2_namespace["model"].transformer.h[0].mlp), (
        "the check left a wrapper behind"
    )


def test_exercise_2_solution_and_the_mlp_class_pass(gpt2_namespace):
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    solution: dict = {}
    run_cell(cell_source(NB09_SOLUTIONS, "exercise-2"), solution)
    for select in (solution["mlp_select"], GPT2MLP):
        assert exercise_2(gpt2_namespace, select).startswith(
            "Exercise 2 solved: the MLPs checkpointed"
        ), select
    assert exercise_2(gpt2_namespace, Ellipsis).startswith("not attempted yet")
