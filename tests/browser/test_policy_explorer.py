"""PolicyExplorer in JupyterLab, in a real Chromium, at 1100 and 1280 px: ticking an op keeps its
output.

A notebook of its own shows the explorer for a small Transformer block. Nothing is ticked,
so "your selection" keeps 0 B, like full checkpointing. The test ticks the softmax row and
waits for the selection to keep exactly the softmax's output; then it clicks "tick
save_matmuls" and waits for the selection to keep what save_matmuls keeps. No step time is
shown until "time all five" is pressed; then all five have one, with its spread.

At each width, in a window of 800 px, with the explorer's cell scrolled to the top of the
notebook: the whole explorer (buttons, table, summary, plot) is on that one screen, before and
after timing, nothing is cut off (the "cost policy" column and the "your selection" summary
least of all), the text is at least 11 px, the plot is a sharp 2x picture. Screenshots of the
window go to test-artifacts/.
"""

from __future__ import annotations

import re

import pytest

from .layout_checks import WIDTHS, assert_readable
from .widget_notebooks import assert_widgets_rendered, open_and_run, write_notebook

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(600)]

CELLS = [
    "from ckptlib.models import TinyTransformer\nfrom ckptlib.widgets import PolicyExplorer\n"
    "explorer = PolicyExplorer(TinyTransformer(depth=1, d_model=32, heads=2, seq=16, vocab=20), "
    "batch=2)\n"
    "softmax = next(i for i, row in enumerate(explorer.rows) if row['op'] == '_softmax')\n"
    "print(softmax, explorer.rows[softmax]['output_bytes'], "
    "explorer.references['save_matmuls']['kept_bytes'])",
    "explorer",
]
ROOT = ".ckptlib-policy-explorer"

CELL_OF_SELECTION = r"""(label) => {
    const rows = [...document.querySelectorAll('.ckptlib-policy-summary tr')];
    const header = [...rows[0].cells].map(cell => cell.innerText.replace(/\s+/g, ' ').trim());
    const row = rows.find(row => row.cells[0].innerText.trim() === label);
    return row ? row.cells[header.indexOf('your selection')].innerText.trim() : null;
}"""


def kept_by_selection(page) -> str:
    """The 'kept for backward' cell of the 'your selection' column."""
    return page.evaluate(CELL_OF_SELECTION, "kept for backward")


def wait_for_kept(page, text: str) -> None:
    page.wait_for_function(
        f"(want) => ({CELL_OF_SELECTION})('kept for backward') === want", arg=text, timeout=60_000
    )


# Where the explorer and its plot are against the notebook's scrolling box (what the learner
# sees between the toolbar and the status bar) once the explorer is scrolled to its top.
IN_VIEW = """(root) => {
    root.scrollIntoView({block: 'start'});
    let box = root.parentElement;
    while (box && !(['auto', 'scroll'].includes(getComputedStyle(box).overflowY)
                    && box.scrollHeight > box.clientHeight))
        box = box.parentElement;
    const seen = box.getBoundingClientRect();
    const shown = {top: Math.max(seen.top, 0), bottom: Math.min(seen.bottom, window.innerHeight)};
    const where = (element) => {
        const rect = element.getBoundingClientRect();
        return {top: rect.top, bottom: rect.bottom, height: rect.height};
    };
    return {shown, explorer: where(root),
            plot: where(root.querySelector('.ckptlib-policy-plot'))};
}"""


def assert_on_one_screen(explorer) -> None:
    """The explorer scrolled to the top of the notebook: it and its plot end above the fold."""
    seen = explorer.evaluate(IN_VIEW)
    shown, plot, whole = seen["shown"], seen["plot"], seen["explorer"]
    assert plot["height"] > 100, f"no plot drawn: {seen}"
    assert shown["top"] <= plot["top"] and plot["bottom"] <= shown["bottom"], (
        f"the plot ({plot['top']:.0f}-{plot['bottom']:.0f} px) is not inside the notebook's "
        f"screen ({shown['top']:.0f}-{shown['bottom']:.0f} px)")
    assert whole["bottom"] <= shown["bottom"], (
        f"the explorer ends at {whole['bottom']:.0f} px, below the screen's "
        f"{shown['bottom']:.0f} px")


def wait_idle(page) -> None:
    page.wait_for_function(
        "() => /\\| Idle/.test(document.querySelector('#jp-main-statusbar')?.innerText ?? '')",
        timeout=120_000,
    )
    page.wait_for_timeout(500)  # the last plot's picture


@pytest.mark.parametrize("width", WIDTHS, ids=list(WIDTHS))
def test_ticking_an_op_keeps_its_output(lab, page, artifacts, width):
    path = write_notebook(lab, f"policy_explorer_browser_test_{width}", CELLS)
    page.set_viewport_size(WIDTHS[width])     # a laptop's window: 800 px tall
    explorer = page.locator(ROOT)
    try:
        open_and_run(page, lab, path, ".ckptlib-policy-summary table")
        assert_widgets_rendered(page)
        softmax, softmax_bytes, matmul_bytes = map(
            int, page.locator(".jp-OutputArea-output pre").first.inner_text().split()
        )
        assert softmax_bytes == 2 * 2 * 16 * 16 * 4
        assert kept_by_selection(page) == "0 B"
        assert page.evaluate(CELL_OF_SELECTION, "step time") is None, "a time nobody asked for"
        assert_on_one_screen(explorer)
        assert_readable(explorer, ".ckptlib-policy-plot")
        page.screenshot(path=str(artifacts / f"policy_explorer-{width}-built.png"))

        page.locator(".ckptlib-policy-tick input").nth(softmax).check()
        wait_for_kept(page, f"{softmax_bytes / 1024:.2f} KiB")

        page.locator(".ckptlib-policy-tick-matmuls").click()
        wait_for_kept(page, f"{matmul_bytes / 1024:.2f} KiB")
        assert not page.locator(".ckptlib-policy-tick input").nth(softmax).is_checked()
        wait_idle(page)

        page.locator(".ckptlib-policy-time").click()
        page.wait_for_function(
            f"() => ({CELL_OF_SELECTION})('step time') !== null", timeout=180_000
        )
        wait_idle(page)
        assert re.fullmatch(
            r"[\d.]+ ms\n[\d.]+-[\d.]+", page.evaluate(CELL_OF_SELECTION, "step time")
        )
        assert_on_one_screen(explorer)
        assert_readable(explorer, ".ckptlib-policy-plot")
        page.screenshot(path=str(artifacts / f"policy_explorer-{width}-timed.png"))
    finally:
        page.screenshot(path=str(artifacts / f"policy_explorer-{width}.png"))
