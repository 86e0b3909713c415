"""PolicyExplorer in JupyterLab, in a real Chromium: ticking an op keeps its output.

A notebook of its own shows the explorer for a small Transformer block. Nothing is ticked,
so "your selection" keeps 0 B, like full checkpointing. The test ticks the softmax row and
waits for the selection to keep exactly the softmax's output; then it clicks "tick
save_matmuls" and waits for the selection to keep what save_matmuls keeps. A screenshot is
kept either way.
"""
from __future__ import annotations

import pytest

from .widget_notebooks import assert_widgets_rendered, open_and_run, write_notebook

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(300)]

CELLS = [
    "from ckptlib.models import TinyTransformer\nfrom ckptlib.widgets import PolicyExplorer\n"
    "explorer = PolicyExplorer(TinyTransformer(depth=1, d_model=32, heads=2, seq=16, vocab=20), batch=2)\n"
    "softmax = next(i for i, row in enumerate(explorer.rows) if row['op'] == '_softmax')\n"
    "print(softmax, explorer.rows[softmax]['output_bytes'], explorer.references['save_matmuls']['kept_bytes'])",
    "explorer",
]


KEPT_BY_SELECTION = """() => {
    const rows = [...document.querySelectorAll('.ckptlib-policy-summary tr')];
    const header = [...rows[0].cells].map(cell => cell.innerText.trim());
    const kept = rows.find(row => row.cells[0].innerText.trim() === 'kept for backward');
    return kept.cells[header.indexOf('your selection')].innerText.trim();
}"""


def kept_by_selection(page) -> str:
    """The 'kept for backward' cell of the 'your selection' column."""
    return page.evaluate(KEPT_BY_SELECTION)


def wait_for_kept(page, text: str) -> None:
    page.wait_for_function(f"(want) => ({KEPT_BY_SELECTION})() === want", arg=text, timeout=30_000)


def test_ticking_an_op_keeps_its_output(lab, page, artifacts):
    path = write_notebook(lab, "policy_explorer_browser_test", CELLS)
    page.set_viewport_size({"width": 1400, "height": 1500})   # table, summary and plot in one picture
    try:
        open_and_run(page, lab, path, ".ckptlib-policy-summary table")
        assert_widgets_rendered(page)
        softmax, softmax_bytes, matmul_bytes = map(int, page.locator(".jp-OutputArea-output pre").first
                                                   .inner_text().split())
        assert softmax_bytes == 2 * 2 * 16 * 16 * 4
        assert kept_by_selection(page) == "0 B"

        page.locator(".ckptlib-policy-tick input").nth(softmax).check()
        wait_for_kept(page, f"{softmax_bytes / 1024:.2f} KiB")

        page.locator(".ckptlib-policy-tick-matmuls").click()
        wait_for_kept(page, f"{matmul_bytes / 1024:.2f} KiB")
        assert not page.locator(".ckptlib-policy-tick input").nth(softmax).is_checked()
        page.wait_for_function(
            "() => /\\| Idle/.test(document.querySelector('#jp-main-statusbar')?.innerText ?? '')", timeout=60_000)
        page.wait_for_timeout(500)   # the last plot's picture
        page.locator(".ckptlib-policy-summary").scroll_into_view_if_needed()
    finally:
        page.screenshot(path=str(artifacts / "policy_explorer.png"))
