"""The memory dashboard in JupyterLab, in a real Chromium: a step that does not fit, then one that does.

A notebook of its own builds a dashboard for the default TinyTransformer (depth 4, batch 8)
with a 15 MiB memory limit: on CPU one plain step needs about 20 MiB, one with a checkpoint
per block about 8.4 MiB. Before any run the plot is a picture, not a broken image. Run with
checkpointing off: the step is stopped, the message says it did not fit and wraps in its box.
Toggle on (the button reads differently) and Run: the step fits, and the readout compares it
with the off run that did not. A screenshot is kept in test-artifacts/ either way.
"""
from __future__ import annotations

import re

import pytest

from .widget_notebooks import assert_widgets_rendered, open_and_run, text_of, write_notebook

# The waits below are bounded one by one; the timeout is a backstop for the whole test.
pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(300)]

LIMIT_MIB = 15
CELLS = ["from ckptlib.widgets import MemoryDashboard\n"
         f"dashboard = MemoryDashboard(depth=4, batch=8, steps=1, memory_limit_bytes={LIMIT_MIB} * 2**20)\n"
         "dashboard"]
CLICK_RUN_MS = 90_000      # one Run click: a metered step, a warm-up and three timed ones
# "step 1 · per block, depth 4, batch 8: peak 8.40 MiB, 80 ms (median of 3, 75-90) | vs off: ..."
READOUT = re.compile(r"^step (?P<step>\d+) · (?P<setting>[^:]+): peak (?P<peak_mib>[\d.]+) MiB")


def click_run(page) -> None:
    """Click Run and wait until the run has ended (the button is enabled again, the plot redrawn)."""
    before = page.locator(".ckptlib-plot").get_attribute("src")
    page.locator(".ckptlib-run").click()
    page.wait_for_function(
        """(before) => {
            const button = document.querySelector('.ckptlib-run');
            return button && !button.disabled && document.querySelector('.ckptlib-plot').src !== before;
        }""",
        arg=before, timeout=CLICK_RUN_MS,
    )


def set_toggle(page, on: bool) -> None:
    toggle = page.locator(".ckptlib-checkpointing")
    if ("mod-active" in (toggle.get_attribute("class") or "")) != on:
        toggle.click()
    # The class flips in the browser at once; the words come back from the kernel.
    page.wait_for_function(
        """(on) => {
            const toggle = document.querySelector('.ckptlib-checkpointing');
            return toggle.classList.contains('mod-active') === on
                && toggle.innerText.trim() === `checkpointing: ${on ? 'ON' : 'OFF'}`;
        }""",
        arg=on, timeout=10_000,
    )


def test_a_step_over_the_limit_then_checkpointing_fits(lab, page, artifacts):
    path = write_notebook(lab, "dashboard_browser_test", CELLS)
    page.set_viewport_size({"width": 1400, "height": 1200})
    try:
        open_and_run(page, lab, path, ".ckptlib-plot")
        assert_widgets_rendered(page)
        assert page.locator(".ckptlib-readout").count() == 1, "expected one live dashboard on the page"
        # Before the first run: a real picture, not a broken-image icon.
        assert page.locator(".ckptlib-plot").evaluate("img => img.complete && img.naturalWidth") > 0
        assert text_of(page, ".ckptlib-readout") == "Press Run to measure a training step."

        set_toggle(page, on=False)
        click_run(page)
        message = page.locator(".ckptlib-message")
        assert text_of(page, ".ckptlib-message").startswith("Does not fit (checkpointing off, depth 4, batch 8)")
        assert f"above the {LIMIT_MIB} MiB limit" in text_of(page, ".ckptlib-message")
        # The message wraps inside its box instead of running off the page.
        assert message.evaluate("box => box.scrollWidth <= box.clientWidth + 1")
        box = message.locator(".widget-html-content > div")
        assert box.evaluate("box => getComputedStyle(box).whiteSpace") == "normal"
        assert box.evaluate("box => getComputedStyle(box).borderLeftStyle") == "solid"
        assert "did not fit" in text_of(page, ".ckptlib-readout")
        page.screenshot(path=str(artifacts / "dashboard_did_not_fit.png"))

        set_toggle(page, on=True)
        click_run(page)
        readout = text_of(page, ".ckptlib-readout")
        match = READOUT.match(readout)
        assert match and match["setting"] == "per block, depth 4, batch 8", readout
        assert float(match["peak_mib"]) <= 0.7 * LIMIT_MIB, readout
        assert "| vs off: off did not fit (stopped at" in readout and "(median of 3, " in readout
        assert text_of(page, ".ckptlib-message") == ""
    finally:
        page.screenshot(path=str(artifacts / "dashboard.png"))
