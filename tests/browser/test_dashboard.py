"""The memory dashboard where learners use it: notebook 06 in JupyterLab, in a real Chromium.

Open a fresh copy of notebook 06 (outputs stripped, so the only dashboard on the page is the
live one). Run its setup cell, then select the dashboard cell and "Run Selected Cell and All
Below" from the Run menu, as a learner jumping to section 5 would (Run All Cells works too, but
its measurements take minutes when the two cores are shared with the browser). Then click the
checkpointing toggle and the Run button, read the peaks from the readout, and check that
checkpointing every block lowers the peak by at least 30 %. A screenshot is kept in
test-artifacts/ either way.
"""
from __future__ import annotations

import json
import re

import nbformat
import pytest

# The waits below are bounded one by one; the timeout is a backstop for the whole test.
pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(420)]

NOTEBOOK = "notebooks/06_transformer_in_practice.ipynb"
# "step 7 · per block, depth 4, batch 8: peak 9.15 MiB, 80 ms | vs off: ..."
READOUT = re.compile(r"^step (?P<step>\d+) · (?P<setting>[^:]+): peak (?P<peak_mib>[\d.]+) MiB")
LOAD_MS = 60_000            # notebook open and kernel idle
CELLS_RUN_MS = 120_000      # setup imports and the dashboard's first four steps, on two busy cores
CLICK_RUN_MS = 60_000       # one Run click: two metered training steps and two plots


def fresh_copy(lab) -> None:
    """Strip outputs and saved widget state from the lab's copy, as a learner's fresh checkout runs."""
    path = lab.root / NOTEBOOK
    notebook = nbformat.read(path, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    notebook.metadata.pop("widgets", None)
    nbformat.write(notebook, path)
    # Render every cell, not only those in view: the dashboard sits far down the notebook.
    tracker = lab.root / "settings" / "@jupyterlab" / "notebook-extension"
    tracker.mkdir(parents=True, exist_ok=True)
    (tracker / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))


def readout(page) -> dict | None:
    match = READOUT.match(page.locator(".ckptlib-readout").inner_text().strip())
    return match.groupdict() if match else None


def click_run_and_read(page, after_step: int) -> dict:
    """Click Run; wait until the run has ended (button enabled again, readout past `after_step`)."""
    page.locator(".ckptlib-run").click()
    page.wait_for_function(
        """(after) => {
            const button = document.querySelector('.ckptlib-run');
            const match = /^step (\\d+) /.exec(document.querySelector('.ckptlib-readout').innerText.trim());
            return button && !button.disabled && match && Number(match[1]) > after;
        }""",
        arg=after_step, timeout=CLICK_RUN_MS,
    )
    message = page.locator(".ckptlib-message").inner_text().strip()
    assert message == "", f"the dashboard reported a problem: {message}"
    return readout(page)


def set_toggle(page, on: bool) -> None:
    toggle = page.locator(".ckptlib-checkpointing")
    if ("mod-active" in (toggle.get_attribute("class") or "")) != on:
        toggle.click()
    page.wait_for_function(
        "(on) => document.querySelector('.ckptlib-checkpointing').classList.contains('mod-active') === on",
        arg=on, timeout=10_000,
    )


def run_from_menu(page, item: str) -> None:
    page.get_by_role("menuitem", name="Run", exact=True).click()
    # Labels only: a menu item's accessible name also holds its shortcut ("Shift+Enter").
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(f"^{re.escape(item)}$")).click()


def select_cell(page, containing: str):
    cell = page.locator(".jp-CodeCell").filter(has_text=containing)
    cell.locator(".jp-InputArea-prompt").click()  # selects it in command mode
    return cell


def test_checkpointing_toggle_lowers_the_peak_in_notebook_06(lab, page, artifacts):
    fresh_copy(lab)
    page.set_default_timeout(30_000)
    page.goto(lab.notebook_url(NOTEBOOK))
    page.wait_for_function(
        """() => document.querySelectorAll('.jp-NotebookPanel .jp-Cell').length > 10
            && /\\| Idle/.test(document.querySelector('#jp-main-statusbar')?.innerText ?? '')""",
        timeout=LOAD_MS,
    )
    try:
        select_cell(page, "from ckptlib import MemoryDashboard")
        run_from_menu(page, "Run Selected Cell")
        select_cell(page, "dashboard = MemoryDashboard(")
        run_from_menu(page, "Run Selected Cell and All Below")
        # The notebook runs the dashboard twice off and twice on: wait for that readout.
        page.wait_for_function(
            "() => /^step 4 · per block/.test(document.querySelector('.ckptlib-readout')?.innerText.trim() ?? '')",
            timeout=CELLS_RUN_MS,
        )
        page.locator(".ckptlib-plot").scroll_into_view_if_needed()
        assert page.locator(".ckptlib-readout").count() == 1, "expected one live dashboard on the page"

        set_toggle(page, on=False)
        off = click_run_and_read(page, after_step=4)
        assert off["setting"] == "checkpointing off, depth 4, batch 8", off
        set_toggle(page, on=True)
        on = click_run_and_read(page, after_step=int(off["step"]))
        assert on["setting"] == "per block, depth 4, batch 8", on
        assert "less memory" in page.locator(".ckptlib-readout").inner_text()

        peak_off, peak_on = float(off["peak_mib"]), float(on["peak_mib"])
        assert peak_on <= 0.7 * peak_off, f"checkpointing on: {peak_on} MiB, off: {peak_off} MiB"
        assert page.locator("text=Error displaying widget").count() == 0
    finally:
        page.screenshot(path=str(artifacts / "dashboard_notebook_06.png"))
