"""ScheduleExplorer in JupyterLab, in a real Chromium: picking a schedule redraws and remeasures.

A notebook of its own shows the explorer at n=16 with Revolve; the test picks "sqrt(n)" in
the schedule menu, waits for the readout to name the new plan, and checks that the plot
changed and that measured forward calls still equal the theory's. Then it moves the n
slider with the keyboard. A screenshot is kept either way.
"""
from __future__ import annotations

import re

import pytest

from .widget_notebooks import assert_widgets_rendered, open_and_run, text_of, write_notebook

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(300)]

CELLS = ["from ckptlib.widgets import ScheduleExplorer\nexplorer = ScheduleExplorer(n=16, schedule='revolve')\n"
         "explorer"]
CALLS = re.compile(r"layer forward calls\s+(\d+)\s+(\d+) \(equal, layer by layer")


def plot_source(page) -> str:
    return page.locator(".ckptlib-explorer-plot").get_attribute("src") or ""


def test_picking_a_schedule_remeasures_it(lab, page, artifacts):
    path = write_notebook(lab, "schedule_explorer_browser_test", CELLS)
    try:
        open_and_run(page, lab, path, ".ckptlib-explorer-readout")
        assert_widgets_rendered(page)
        assert text_of(page, ".ckptlib-explorer-readout").startswith("revolve(16, slots=3)")
        before = plot_source(page)
        assert before.startswith("blob:") or before.startswith("data:")

        page.locator(".ckptlib-explorer-schedule select").select_option("sqrt(n)")
        page.wait_for_function(
            "() => document.querySelector('.ckptlib-explorer-readout').innerText.startsWith('sqrt_n(16)')",
            timeout=30_000)
        readout = text_of(page, ".ckptlib-explorer-readout")
        measured, theory = CALLS.search(readout).groups()
        assert measured == theory == "28", readout
        page.wait_for_function("(old) => document.querySelector('.ckptlib-explorer-plot').src !== old",
                               arg=before, timeout=30_000)
        # sqrt(n) takes no parameter: its slider is disabled.
        assert page.locator(".ckptlib-explorer-parameter .widget-readout").count() == 1
        assert "(no parameter)" in text_of(page, ".ckptlib-explorer-parameter")

        handle = page.locator(".ckptlib-explorer-n .noUi-handle")
        handle.focus()
        for _ in range(4):
            handle.press("ArrowRight")
        page.wait_for_function(
            "() => document.querySelector('.ckptlib-explorer-readout').innerText.startsWith('sqrt_n(20)')",
            timeout=30_000)
        assert "(equal" in text_of(page, ".ckptlib-explorer-readout")
        page.wait_for_function(
            "() => /\\| Idle/.test(document.querySelector('#jp-main-statusbar')?.innerText ?? '')", timeout=60_000)
        page.wait_for_timeout(500)   # the last plot's picture
    finally:
        page.screenshot(path=str(artifacts / "schedule_explorer.png"))
