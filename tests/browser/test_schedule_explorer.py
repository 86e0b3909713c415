"""ScheduleExplorer in JupyterLab, in a real Chromium, at 1100 and 1280 px wide.

A notebook of its own shows the explorer at n=16 with Revolve; the test picks "sqrt(n)" in
the schedule menu, waits for the readout to name the new plan, and checks that the plot
changed and that measured forward calls still equal the theory's. Then it moves the n
slider with the keyboard, goes back to Revolve and presses End on the parameter slider
(it must reach the new n's maximum), and asks for a budget below what any plan keeps: the
old result goes, a message in the widget's own terms comes. Nothing is cut off at either
width; the pictures are drawn at twice their pixels on screen. Screenshots are kept.
"""

from __future__ import annotations

import re

import pytest

from .layout_checks import assert_nothing_clipped
from .widget_notebooks import assert_widgets_rendered, open_and_run, text_of, write_notebook

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(400)]

CELLS = [
    "from ckptlib.widgets import ScheduleExplorer\n"
    "explorer = ScheduleExplorer(n=16, schedule='revolve')\n"
    "explorer"
]
CALLS = re.compile(r"layer forward calls\s+(\d+)\s+(\d+) \(equal, layer by layer")
WAIT_MS = 60_000
PARTS = (
    ".ckptlib-explorer-readout, .ckptlib-explorer-message, .ckptlib-explorer-plot, "
    ".ckptlib-explorer-tradeoff"
)


def plot_source(page) -> str:
    return page.locator(".ckptlib-explorer-plot").get_attribute("src") or ""


def readout_starts(page, text: str) -> None:
    page.wait_for_function(
        "(t) => document.querySelector('.ckptlib-explorer-readout').innerText.startsWith(t)",
        arg=text,
        timeout=WAIT_MS,
    )


def press(page, control: str, key: str) -> None:
    """A key on one of the explorer's sliders ("n" or "parameter")."""
    handle = page.locator(f".ckptlib-explorer-{control} .noUi-handle")
    handle.focus()
    handle.press(key)


def pick(page, schedule: str, plan: str) -> None:
    """Choose ``schedule`` in the menu and wait until the readout names ``plan``."""
    page.locator(".ckptlib-explorer-schedule select").select_option(schedule)
    readout_starts(page, plan)
    wait_idle(page)


def wait_idle(page) -> None:
    page.wait_for_function(
        "() => /\\| Idle/.test(document.querySelector('#jp-main-statusbar')?.innerText ?? '')",
        timeout=WAIT_MS,
    )
    page.wait_for_timeout(500)


@pytest.mark.parametrize("width", [1100, 1280])
def test_picking_a_schedule_remeasures_it(lab, page, artifacts, width):
    path = write_notebook(lab, f"schedule_explorer_browser_test_{width}", CELLS)
    page.set_viewport_size({"width": width, "height": 800})
    try:
        open_and_run(page, lab, path, ".ckptlib-explorer-readout")
        assert_widgets_rendered(page)
        assert text_of(page, ".ckptlib-explorer-readout").startswith("revolve(16, slots=3)")
        before = plot_source(page)
        assert before.startswith("blob:") or before.startswith("data:")
        page.evaluate(
            "() => document.querySelector('.ckptlib-explorer-schedule')"
            ".scrollIntoView({block: 'start'})"
        )
        page.wait_for_timeout(500)
        assert_nothing_clipped(page, PARTS)
        # Drawn at twice the pixels they take, so sharp; never wider than the page.
        for name in ("plot", "tradeoff"):
            natural, shown = page.locator(f".ckptlib-explorer-{name}").evaluate(
                "img => [img.naturalWidth, img.getBoundingClientRect().width]"
            )
            assert natural >= 1.9 * shown > 0, (name, natural, shown)
        page.screenshot(path=str(artifacts / f"schedule_explorer_{width}.png"))

        page.locator(".ckptlib-explorer-schedule select").select_option("sqrt(n)")
        readout_starts(page, "sqrt_n(16)")
        readout = text_of(page, ".ckptlib-explorer-readout")
        measured, theory = CALLS.search(readout).groups()
        assert measured == theory == "28", readout
        assert "the whole step" in readout and "activations only" in readout
        page.wait_for_function(
            "(old) => document.querySelector('.ckptlib-explorer-plot').src !== old",
            arg=before,
            timeout=WAIT_MS,
        )
        # sqrt(n) takes no parameter: its slider is disabled.
        assert page.locator(".ckptlib-explorer-parameter .widget-readout").count() == 1
        assert "(no parameter)" in text_of(page, ".ckptlib-explorer-parameter")

        # One key at a time: while a setting is measured the controls are frozen, and a key
        # pressed then is (rightly) not taken.
        for n in range(17, 21):
            press(page, "n", "ArrowRight")
            readout_starts(page, f"sqrt_n({n})")
            wait_idle(page)
        assert "(equal" in text_of(page, ".ckptlib-explorer-readout")
        wait_idle(page)

        # End on the parameter slider goes to the maximum for this n (s = n - 1 slots).
        pick(page, "revolve", "revolve(20, slots=3)")
        press(page, "parameter", "End")
        readout_starts(page, "revolve(20, slots=19)")
        wait_idle(page)

        # A budget below the least plan: no old numbers or pictures under the new setting.
        pick(page, "budget", "plan_for_budget(50%")
        press(page, "parameter", "Home")
        page.wait_for_function(
            "() => document.querySelector('.ckptlib-explorer-message')"
            ".innerText.includes('No plan for 20 layers')",
            timeout=WAIT_MS,
        )
        message = text_of(page, ".ckptlib-explorer-message")
        assert "budget %" in message and "KiB" in message and "memory_budget" not in message, (
            message
        )
        assert text_of(page, ".ckptlib-explorer-readout") == ""
        assert (
            page.locator(".ckptlib-explorer-plot").evaluate(
                "img => img.getBoundingClientRect().height"
            )
            == 0
        )
        assert_nothing_clipped(page, PARTS)
        page.evaluate(
            "() => document.querySelector('.ckptlib-explorer-schedule')"
            ".scrollIntoView({block: 'start'})"
        )
        page.screenshot(path=str(artifacts / f"schedule_explorer_{width}_no_plan.png"))
        least = int(re.search(r"slider to (\d+)%", message)[1])
        for percent in range(10, least + 1, 5):
            press(page, "parameter", "ArrowRight")
            page.wait_for_function(
                "(p) => document.querySelector('.ckptlib-explorer-parameter')"
                ".innerText.includes(p)",
                arg=str(percent),
                timeout=WAIT_MS,
            )
            wait_idle(page)
        readout_starts(page, f"plan_for_budget({least}%")
    finally:
        page.screenshot(path=str(artifacts / f"schedule_explorer_{width}_last.png"))


@pytest.mark.parametrize("width", [1100, 1280])
def test_a_new_n_is_measured_under_a_banner_that_moves_nothing(lab, page, artifacts, width):
    """A new n measures the whole trade-off curve (seconds): from the key press on, a banner
    over the dimmed pictures counts the curve's plans; the pictures and the readout stay where
    they were, and the banner goes when the measurement ends."""
    path = write_notebook(lab, f"explorer_busy_{width}", [
        "from ckptlib.widgets import ScheduleExplorer\n"
        "explorer = ScheduleExplorer(n=60, schedule='revolve', max_n=64)\nexplorer"
    ])
    page.set_viewport_size({"width": width, "height": 800})
    where = """() => ({
        plots: document.querySelector('.ckptlib-explorer-plot').getBoundingClientRect().top,
        readout: document.querySelector('.ckptlib-explorer-readout').getBoundingClientRect().top,
        banner: document.querySelector('.ckptlib-busy-banner')?.innerText ?? null,
        opacity: parseFloat(getComputedStyle(
            document.querySelector('.ckptlib-explorer-plot').parentElement).opacity)})"""
    try:
        open_and_run(page, lab, path, ".ckptlib-explorer-plot")
        assert_widgets_rendered(page)
        page.locator(".ckptlib-explorer-n").scroll_into_view_if_needed()
        idle = page.evaluate(where)
        assert idle["banner"] in (None, "") and idle["opacity"] == 1, idle
        press(page, "n", "ArrowRight")
        # The banner counts the plans, over pictures dimmed (after a 0.2 s fade).
        busy = page.wait_for_function(
            f"""() => {{ const seen = ({where})();
                return /measuring the trade-off curve, plan \\d+ of \\d+/.test(seen.banner ?? '')
                    && seen.opacity <= 0.35 && seen; }}""",
            timeout=WAIT_MS,
        ).json_value()
        assert (busy["plots"], busy["readout"]) == (idle["plots"], idle["readout"]), busy
        page.screenshot(path=str(artifacts / f"explorer_busy_{width}.png"))
        page.wait_for_function(
            "() => !(document.querySelector('.ckptlib-busy-banner')?.innerText)",
            timeout=120_000,
        )
        done = page.evaluate(where)
        assert done["opacity"] == 1 and done["plots"] == idle["plots"], done
    finally:
        page.screenshot(path=str(artifacts / f"explorer_busy_{width}_end.png"))
