"""BackwardStepper in JupyterLab, in a real Chromium: Next, the slider, Play move the replay.

A notebook of its own builds the stepper for a 3-block MLP with a checkpoint per block and
puts the slider just before the first rerun's first pack. Clicking Next shows that pack: the
caption says so and the graph draws a recomputed tensor it did not draw before. Play then
moves the slider by itself (the link lives in the browser). A screenshot is kept either way.
"""
from __future__ import annotations

import re

import pytest

from .widget_notebooks import assert_widgets_rendered, open_and_run, text_of, write_notebook

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(300)]

CELLS = [
    "from ckptlib.models import MLPChain\nfrom ckptlib.widgets import BackwardStepper",
    "stepper = BackwardStepper(MLPChain(depth=3, width=16, checkpointing='block'), batch=2)\n"
    "first_rerun_pack = next(i for i, f in enumerate(stepper.frames) if 'rerun: packs' in f['text'])\n"
    "stepper.position.value = first_rerun_pack - 1\n"
    "stepper",
]
CAPTION = re.compile(r"^(\d+)/(\d+) · (.*)$", re.S)


def caption(page) -> tuple[int, int, str]:
    match = CAPTION.match(text_of(page, ".ckptlib-stepper-caption"))
    assert match, text_of(page, ".ckptlib-stepper-caption")
    return int(match[1]), int(match[2]), match[3]


def test_next_and_play_step_through_the_rerun(lab, page, artifacts):
    path = write_notebook(lab, "stepper_browser_test", CELLS)
    page.set_viewport_size({"width": 1400, "height": 1300})   # the whole widget in one picture
    try:
        open_and_run(page, lab, path, ".ckptlib-stepper-caption")
        assert_widgets_rendered(page)
        position, count, text = caption(page)
        assert "block 2 reruns" in text or "loads its kept input" in text, text
        graph = page.locator(".ckptlib-stepper-graph svg")
        assert graph.count() == 1 and "recomputed" not in graph.inner_html()

        page.locator(".ckptlib-stepper-next").click()
        page.wait_for_function(
            "(p) => document.querySelector('.ckptlib-stepper-caption').innerText.trim().startsWith(`${p + 1}/`)",
            arg=position, timeout=20_000)
        _, _, text = caption(page)
        assert text.startswith("block 2 rerun: packs tensor #0"), text
        # The graph's picture arrives in a message of its own, after the caption's.
        page.wait_for_function(
            "() => document.querySelector('.ckptlib-stepper-graph svg').innerHTML.includes('recomputed')",
            timeout=20_000)
        # So does the states' list (a message of its own too: wait for it, do not race it).
        page.wait_for_function(
            "() => document.querySelector('.ckptlib-stepper-states').innerHTML.includes('recomputed: <b>1</b>')",
            timeout=20_000)
        # The timeline's cursor moved with it (its position is a percentage of the picture).
        assert page.locator(".ckptlib-stepper-timeline img").evaluate("img => img.naturalWidth") > 0

        page.locator(".ckptlib-stepper-prev").click()
        page.wait_for_function(
            "(p) => document.querySelector('.ckptlib-stepper-caption').innerText.trim().startsWith(`${p}/`)",
            arg=position, timeout=20_000)

        play = page.locator(".widget-play button").first
        play.click()                                           # Play (the same button pauses)
        page.wait_for_function(
            "(p) => Number(document.querySelector('.ckptlib-stepper-caption').innerText.split('/')[0]) > p + 2",
            arg=position, timeout=30_000)
        play.click()
        paused_at = caption(page)[0]
        page.wait_for_timeout(1500)                            # two intervals: it stays where it paused
        assert caption(page)[0] == paused_at and paused_at > position + 2 and caption(page)[1] == count
        assert "recomputed" in page.locator(".ckptlib-stepper-graph svg").inner_html()
        # The last block, rerunning, is at the bottom of the graph's own scroll box.
        page.locator(".ckptlib-stepper-graph").evaluate("box => { box.scrollTop = box.scrollHeight; }")
    finally:
        page.screenshot(path=str(artifacts / "stepper.png"))
