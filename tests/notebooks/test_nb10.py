"""The clinic's self-checks (notebook 10) fail on each case's broken code and pass on its solution.

The solutions notebook runs once, cell by cell, in one namespace. Then, for each exercise, the
self-check cell is taken from the learner's notebook by its nbgrader grade id
(``exercise-K-check``) and run three times: with the learner's starting cell (it must say "not
attempted yet"), with each ``fixed_NAME`` the solution defines replaced by the case's
``broken_NAME`` (it must fail), and with the solution (it must say "solved").
"""
from __future__ import annotations

import ast
import os
from pathlib import Path

import nbformat
import pytest

from tests._notebooks import run_cell

pytestmark = pytest.mark.slow   # the whole notebook, two DDP runs in fresh processes, torch.compile

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
LEARNER = NOTEBOOKS / "10_clinic.ipynb"
SOLUTIONS = NOTEBOOKS / "solutions" / "10_clinic_solutions.ipynb"


def graded_cells(path: Path) -> dict[str, nbformat.NotebookNode]:
    return {cell.metadata["nbgrader"]["grade_id"]: cell
            for cell in nbformat.read(path, as_version=4).cells if "nbgrader" in cell.metadata}


@pytest.fixture(scope="module")
def solved() -> dict:
    """The namespace after every code cell of the solutions notebook ran, in order."""
    namespace: dict = {"__name__": "clinic"}
    here = os.getcwd()
    os.chdir(
        SOLUTIONS.parent
    )  # where the notebook runs: it finds notebooks/clinic_ddp.py from there
    try:
        for cell in nbformat.read(SOLUTIONS, as_version=4).cells:
            if cell.cell_type == "code":
                run_cell(cell.source, namespace, f"<solutions {cell.id}>")
    finally:
        os.chdir(here)
    return namespace


CHECKS = sorted((grade_id for grade_id in graded_cells(LEARNER) if grade_id.endswith("-check")),
                key=lambda grade_id: int(grade_id.split("-")[1]))


def test_every_case_has_an_exercise_and_a_check():
    assert len(CHECKS) >= 10
    assert set(graded_cells(LEARNER)) == set(graded_cells(SOLUTIONS))


def fixed_names(exercise_source: str) -> list[str]:
    """The functions an exercise asks for: top-level ``def fixed_...``."""
    return [node.name for node in ast.parse(exercise_source).body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("fixed_")]


@pytest.mark.parametrize("check_id", CHECKS)
def test_self_check_fails_on_the_broken_code_and_passes_on_the_solution(solved, check_id):
    exercise_id = check_id.removesuffix("-check")
    check = graded_cells(LEARNER)[check_id].source
    names = fixed_names(graded_cells(SOLUTIONS)[exercise_id].source)
    assert names, f"{exercise_id}: the solution defines no fixed_... function"

    template = dict(solved)
    run_cell(graded_cells(LEARNER)[exercise_id].source, template, f"<learner {exercise_id}>")
    assert "not attempted yet" in run_cell(check, template, f"<learner {check_id}, template>")

    broken = dict(solved)
    for name in names:
        broken[name] = solved[name.replace("fixed_", "broken_", 1)]
    with pytest.raises(Exception):   # an assertion, or the broken code's own error
        output = run_cell(check, broken, f"<learner {check_id}, broken>")
        pytest.fail(
            f"the self-check passed on the broken code: {output!r}"
        )  # not an Exception: not caught

    assert "solved" in run_cell(check, dict(solved), f"<learner {check_id}, solution>")
