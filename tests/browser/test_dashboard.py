"""The memory dashboard in JupyterLab, in a real Chromium, at 1100 and 1280 px: readable and
unclipped.

A notebook of its own builds a dashboard for the default TinyTransformer (depth 4, batch 8)
with a 15 MiB memory limit: on CPU one plain step needs about 20 MiB, one with a checkpoint
per block about 8.4 MiB. Before any run the plot is a picture, not a broken image. Run with
checkpointing off: the step is stopped, the message says it did not fit and wraps in its box.
Toggle on (the button reads differently and names the schedule) and Run: the step fits, and
the readout compares it with the off run that did not. A second, small dashboard ran off and
on in its cell, so its readout holds the time comparison (off timed in turns, spreads).

At each width: nothing inside the dashboards is cut off (no element's content wider than its
box), the readout wraps onto more lines instead, the text is at least 11 px, the plot is a 2x
picture shown at its size (sharp, not stretched), and the plot does not move when the message
appears. Screenshots of each state go to test-artifacts/.
"""

from __future__ import annotations

import re

import pytest

from .layout_checks import WIDTHS, assert_readable
from .widget_notebooks import assert_widgets_rendered, open_and_run, text_of, write_notebook

# The waits below are bounded one by one; the timeout is a backstop for the whole test.
pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(600)]

LIMIT_MIB = 15
CELLS = [
    "from ckptlib.widgets import MemoryDashboard\n"
    "dashboard = MemoryDashboard(depth=4, batch=8, steps=1, "
    f"memory_limit_bytes={LIMIT_MIB} * 2**20)\n"
    "dashboard",
    "small = MemoryDashboard(depth=2, batch=2, steps=1)\n"
    "small.run(); small.checkpointing.value = True; small.run()\n"
    "small",
]
CLICK_RUN_MS = (
    180_000  # one Run click: a metered step, a warm-up and three timed ones, on a loaded machine
)
# "step 1 · per block, depth 4, batch 8: peak 8.40 MiB, 80 ms (75-90 ms, 3 runs) | vs off: ..."
READOUT = re.compile(r"^step (?P<step>\d+) · (?P<setting>[^:]+): peak (?P<peak_mib>[\d.]+) MiB")
TIME_VS_OFF = re.compile(
    r"\d+\.\d\dx the time of off(: within noise)?.*off timed in turns with it: \d+"
)


def click_run(page) -> None:
    """Click the first dashboard's Run and wait until the run has ended (button enabled, plot
    redrawn)."""
    before = page.locator(".ckptlib-plot").first.get_attribute("src")
    page.locator(".ckptlib-run").first.click()
    page.wait_for_function(
        """(before) => {
            const button = document.querySelector('.ckptlib-run');
            return button && !button.disabled
                && document.querySelector('.ckptlib-plot').src !== before;
        }""",
        arg=before,
        timeout=CLICK_RUN_MS,
    )


def set_toggle(page, on: bool) -> None:
    toggle = page.locator(".ckptlib-checkpointing").first
    if ("mod-active" in (toggle.get_attribute("class") or "")) != on:
        toggle.click()
    # The class flips in the browser at once; the words come back from the kernel.
    page.wait_for_function(
        """(on) => {
            const toggle = document.querySelector('.ckptlib-checkpointing');
            return toggle.classList.contains('mod-active') === on
                && toggle.innerText.trim()
                    === (on ? 'checkpointing: ON · per block' : 'checkpointing: OFF');
        }""",
        arg=on,
        timeout=30_000,
    )


def plot_top(page) -> float:
    return page.locator(".ckptlib-plot").first.evaluate("img => img.getBoundingClientRect().top")


def lines_of(page, selector: str) -> float:
    """How many lines of text an element holds: its height over its line height."""
    return page.locator(selector).evaluate(
        "box => box.getBoundingClientRect().height / parseFloat(getComputedStyle(box).lineHeight)"
    )


@pytest.mark.parametrize("width", WIDTHS, ids=list(WIDTHS))
def test_a_step_over_the_limit_then_checkpointing_fits(lab, page, artifacts, width):
    path = write_notebook(lab, f"dashboard_browser_test_{width}", CELLS)
    page.set_viewport_size(WIDTHS[width])
    try:
        open_and_run(page, lab, path, ".ckptlib-dashboard >> nth=1")
        assert_widgets_rendered(page)
        assert page.locator(".ckptlib-readout").count() == 2, (
            "expected two live dashboards on the page"
        )
        first = page.locator(".ckptlib-dashboard").first
        first.scroll_into_view_if_needed()
        # Before the first run: a real picture, not a broken-image icon.
        assert (
            page.locator(".ckptlib-plot").first.evaluate("img => img.complete && img.naturalWidth")
            > 0
        )
        assert text_of(page, ".ckptlib-readout >> nth=0") == "Press Run to measure a training step."
        first.screenshot(path=str(artifacts / f"dashboard-{width}-before-run.png"))

        set_toggle(page, on=False)
        top = plot_top(page)
        click_run(page)
        message = page.locator(".ckptlib-message").first
        assert text_of(page, ".ckptlib-message >> nth=0").startswith(
            "Does not fit (checkpointing off, depth 4, batch 8)"
        )
        assert f"above the {LIMIT_MIB} MiB limit" in text_of(page, ".ckptlib-message >> nth=0")
        assert plot_top(page) == top, "the message moved the plot"
        # The message wraps inside its box instead of running off the page.
        box = message.locator(".widget-html-content > div")
        assert box.evaluate("box => getComputedStyle(box).whiteSpace") == "normal"
        assert box.evaluate("box => getComputedStyle(box).borderLeftStyle") == "solid"
        assert "did not fit" in text_of(page, ".ckptlib-readout >> nth=0")
        assert_readable(first, ".ckptlib-plot")
        first.screenshot(path=str(artifacts / f"dashboard-{width}-did-not-fit.png"))

        set_toggle(page, on=True)
        click_run(page)
        readout = text_of(page, ".ckptlib-readout >> nth=0")
        match = READOUT.match(readout)
        assert match and match["setting"] == "per block, depth 4, batch 8", readout
        assert float(match["peak_mib"]) <= 0.7 * LIMIT_MIB, readout
        assert "| vs off: off did not fit (stopped at" in readout and "3 runs)" in readout
        assert text_of(page, ".ckptlib-message >> nth=0") == ""
        assert plot_top(page) == top, "the message going away moved the plot"
        # The whole readout is on screen: it wraps onto a second line rather than being cut.
        assert lines_of(page, ".ckptlib-readout >> nth=0 >> .widget-html-content > div") >= 1.9
        assert_readable(first, ".ckptlib-plot")
        first.screenshot(path=str(artifacts / f"dashboard-{width}-checkpointing-fits.png"))

        second = page.locator(".ckptlib-dashboard").nth(1)
        second.scroll_into_view_if_needed()
        assert TIME_VS_OFF.search(text_of(page, ".ckptlib-readout >> nth=1")), text_of(
            page, ".ckptlib-readout >> nth=1"
        )
        assert_readable(second, ".ckptlib-plot")
        second.screenshot(path=str(artifacts / f"dashboard-{width}-time-vs-off.png"))
    finally:
        page.screenshot(path=str(artifacts / f"dashboard-{width}.png"))


LONG_CELLS = [
    "from ckptlib.widgets import MemoryDashboard\n"
    "long = MemoryDashboard(depth=12, batch=24, steps=2)\n"
    "long",
]
# The menu's longest entry against the room its select box has for text.
MENU_ROOM = """(select) => {
    const context = document.createElement('canvas').getContext('2d');
    const style = getComputedStyle(select);
    context.font = `${style.fontSize} ${style.fontFamily}`;
    const widest = Math.max(...[...select.options].map(o => context.measureText(o.text).width));
    const room = select.clientWidth - parseFloat(style.paddingLeft)
        - parseFloat(style.paddingRight);
    return {widest, room};
}"""
BUSY_VIEW = """() => {
    const banner = document.querySelector('.ckptlib-busy [role=status]');
    const plot = document.querySelector('.ckptlib-plot');
    return {banner: banner ? banner.innerText : null,
            bannerBox: banner && banner.getBoundingClientRect().toJSON(),
            plotBox: plot.getBoundingClientRect().toJSON(),
            opacity: parseFloat(getComputedStyle(plot).opacity),
            readoutHeight:
                document.querySelector('.ckptlib-readout').getBoundingClientRect().height,
            running: document.querySelector('.ckptlib-run').disabled};
}"""


@pytest.mark.parametrize("width", WIDTHS, ids=list(WIDTHS))
def test_a_long_run_is_unmistakably_busy_and_says_where_it_is(lab, page, artifacts, width):
    """A run of several seconds (depth 12, batch 24, two steps): from the click on, a banner over
    the dimmed plot says which step runs and what it does; nothing below moves; the banner goes
    when the run ends. The menu shows its longest entry whole."""
    path = write_notebook(lab, f"dashboard_busy_{width}", LONG_CELLS)
    page.set_viewport_size(WIDTHS[width])
    try:
        open_and_run(page, lab, path, ".ckptlib-dashboard")
        assert_widgets_rendered(page)
        page.locator(".ckptlib-dashboard").first.scroll_into_view_if_needed()
        menu = page.locator(".ckptlib-dashboard select").first.evaluate(MENU_ROOM)
        assert menu["widest"] <= menu["room"], f"the menu cuts its longest entry: {menu}"
        idle = page.evaluate(BUSY_VIEW)
        assert idle["banner"] is None and idle["opacity"] == 1
        page.locator(".ckptlib-run").first.click()
        page.wait_for_function(
            "() => /step 1 of 2/.test(document.querySelector('.ckptlib-busy')?.innerText ?? '')",
            timeout=30_000,
        )
        page.wait_for_timeout(400)  # the dimming's transition
        busy = page.evaluate(BUSY_VIEW)
        assert busy["running"] and busy["opacity"] <= 0.35, busy
        assert busy["banner"].startswith(
            "Running checkpointing off, depth 12, batch 24: step 1 of 2"
        ), busy
        assert busy["plotBox"] == idle["plotBox"] and busy["readoutHeight"] == idle["readoutHeight"]
        # The banner lies over the plot.
        banner, plot = busy["bannerBox"], busy["plotBox"]
        assert plot["left"] <= banner["left"] and banner["right"] <= plot["right"], busy
        assert plot["top"] <= banner["top"] and banner["bottom"] <= plot["bottom"], busy
        page.locator(".ckptlib-dashboard").first.screenshot(
            path=str(artifacts / f"dashboard-{width}-busy.png")
        )
        page.wait_for_function(
            "() => /step 2 of 2/.test(document.querySelector('.ckptlib-busy')?.innerText ?? '')",
            timeout=CLICK_RUN_MS,
        )
        page.wait_for_function(
            "() => !document.querySelector('.ckptlib-run').disabled", timeout=CLICK_RUN_MS
        )
        page.wait_for_timeout(400)
        done = page.evaluate(BUSY_VIEW)
        assert done["banner"] is None and done["opacity"] == 1, done
        assert done["plotBox"] == idle["plotBox"] and done["readoutHeight"] == idle["readoutHeight"]
        assert text_of(page, ".ckptlib-readout").startswith("step 2 · checkpointing off, depth 12")
        page.locator(".ckptlib-dashboard").first.screenshot(
            path=str(artifacts / f"dashboard-{width}-long-run-done.png")
        )
    finally:
        page.screenshot(path=str(artifacts / f"dashboard-busy-{width}.png"))
