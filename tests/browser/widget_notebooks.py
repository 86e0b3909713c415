"""What the widget browser tests share: write a small notebook into the lab, open it, run it.

Each test writes its own notebook (a few cells that build one widget) instead of opening a
course notebook: the course notebooks change with the lessons, the widgets' tests should
not. Cells are run with the Run menu's "Run All Cells", as a learner would.
"""

from __future__ import annotations

import json
import re

import nbformat

LOAD_MS = 60_000  # notebook open and kernel idle
CELLS_RUN_MS = 120_000  # imports and building the widget, on two cores shared with the browser


def write_notebook(lab, name: str, cells: list[str]) -> str:
    """Write ``cells`` (code) as ``<name>.ipynb`` in the lab's root; return its path for
    ``notebook_url``."""
    notebook = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(source) for source in cells]
    )
    notebook.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nbformat.write(notebook, lab.root / f"{name}.ipynb")
    # Render every cell, not only those in view.
    tracker = lab.root / "settings" / "@jupyterlab" / "notebook-extension"
    tracker.mkdir(parents=True, exist_ok=True)
    (tracker / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    return f"{name}.ipynb"


def run_from_menu(page, item: str) -> None:
    page.get_by_role("menuitem", name="Run", exact=True).click()
    # Labels only: a menu item's accessible name also holds its shortcut ("Shift+Enter").
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(f"^{re.escape(item)}$")).click()


def open_and_run(page, lab, path: str, ready_selector: str) -> None:
    """Open the notebook, run all its cells, and wait until ``ready_selector`` is on the page."""
    page.set_default_timeout(30_000)
    page.goto(lab.notebook_url(path))
    page.wait_for_function(
        """() => document.querySelectorAll('.jp-NotebookPanel .jp-Cell').length > 0
            && /\\| Idle/.test(document.querySelector('#jp-main-statusbar')?.innerText ?? '')""",
        timeout=LOAD_MS,
    )
    run_from_menu(page, "Run All Cells")
    page.wait_for_selector(ready_selector, timeout=CELLS_RUN_MS)
    page.wait_for_function(
        "() => /\\| Idle/.test(document.querySelector('#jp-main-statusbar')?.innerText ?? '')",
        timeout=CELLS_RUN_MS,
    )


def assert_widgets_rendered(page) -> None:
    assert page.locator("text=Error displaying widget").count() == 0
    assert (
        page.locator(
            ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"
        ).count()
        == 0
    )


def text_of(page, selector: str) -> str:
    return page.locator(selector).inner_text().strip()
