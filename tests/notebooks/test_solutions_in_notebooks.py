"""Every official solution passes inside its main notebook.

A learner pastes a solution into the notebook they are working in, not into ``solutions/``, and
runs on from there: the cells after the exercise may rebind a name the self-check reads (notebook
06 once rebound ``reference`` in a loop below its exercise, and its solution failed only there).
So each main notebook runs here top to bottom, in its own folder, with every exercise cell
replaced by the solutions notebook's cell of the same nbgrader grade id; each self-check must run
without an error and must not say "not attempted".
"""
from __future__ import annotations

from pathlib import Path

import matplotlib
import nbformat
import pytest

from tests._notebooks import in_folder, run_cell

pytestmark = pytest.mark.slow   # each notebook runs whole, as nbval runs it

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
MAIN = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def grade_id(cell) -> str | None:
    return cell.metadata.get("nbgrader", {}).get("grade_id")


def with_solutions(notebook: Path) -> list[nbformat.NotebookNode]:
    """The main notebook's code cells, each exercise cell replaced by its official solution."""
    solutions = NOTEBOOKS / "solutions" / f"{notebook.stem}_solutions.ipynb"
    answers = {grade_id(cell): cell for cell in nbformat.read(solutions, as_version=4).cells
               if "exercise" in cell.metadata.get("tags", [])}
    cells = []
    for cell in nbformat.read(notebook, as_version=4).cells:
        if cell.cell_type != "code":
            continue
        if "exercise" in cell.metadata.get("tags", []):
            assert grade_id(cell) in answers, f"{solutions.name} has no {grade_id(cell)}"
            cell = answers.pop(grade_id(cell))
        cells.append(cell)
    assert not answers, f"{solutions.name} has exercises {notebook.name} lacks: {sorted(answers)}"
    return cells


@pytest.mark.parametrize("notebook", MAIN, ids=[path.stem[:2] for path in MAIN])
def test_every_solution_passes_in_its_main_notebook(notebook):
    matplotlib.use("Agg")   # figures are drawn, never shown
    namespace: dict = {"__name__": f"notebook_{notebook.stem[:2]}"}
    checks = 0
    with in_folder(notebook.parent):
        for cell in with_solutions(notebook):
            name = f"<{notebook.stem} {cell.id}>"
            if "self-check" not in cell.metadata.get("tags", []):
                run_cell(cell.source, namespace, name)
                continue
            try:
                printed = run_cell(cell.source, namespace, name)
            except Exception as error:   # an assertion, or an error the self-check ran into
                pytest.fail(f"{notebook.name}, {grade_id(cell)}: the official solution fails in "
                            f"the notebook: {type(error).__name__}: {error}")
            assert "not attempted" not in printed.lower(), (notebook.name, grade_id(cell), printed)
            checks += 1
    assert checks >= 2, f"{notebook.name}: {checks} self-checks ran"
