"""BackwardStepper in JupyterLab, in a real Chromium, at 1100 and 1280 px wide.

A notebook of its own builds the stepper for a 3-block MLP with a checkpoint per block and
puts the slider just before the first rerun's first pack. Clicking Next shows that pack: the
caption says so and the graph recolours a box recomputed, with every node where it was.
Nothing is cut off at either width, the caption wraps, the graph's text is readable, and the
box the event is about is on screen together with the controls. Play then moves the slider by
itself (the link lives in the browser). Screenshots are kept either way.
"""

from __future__ import annotations

import re

import pytest

from .layout_checks import assert_nothing_clipped
from .widget_notebooks import assert_widgets_rendered, open_and_run, text_of, write_notebook

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(400)]

CELLS = [
    "from ckptlib.models import MLPChain\nfrom ckptlib.widgets import BackwardStepper",
    "stepper = BackwardStepper(MLPChain(depth=3, width=16, checkpointing='block'), batch=2)\n"
    "first_rerun_pack = next(i for i, f in enumerate(stepper.frames) "
    "if 'rerun: packs' in f['text'])\n"
    "stepper.position.value = first_rerun_pack - 1\n"
    "stepper",
]
CAPTION = re.compile(r"^(\d+)/(\d+) · (.*)$", re.S)
WAIT_MS = 30_000
# The SVG in view (a container query shows one of two windows), its nodes' outlines by title.
NODE_OUTLINES = """() => {
    const svg = [...document.querySelectorAll('.ckptlib-stepper-graph svg')]
        .find(s => s.getBoundingClientRect().width > 0);
    return Object.fromEntries([...svg.querySelectorAll('g.node')].map(
        g => [g.querySelector('title').textContent.split(':')[0],
            g.querySelector('polygon').getAttribute('points')]));
}"""
VISIBLE_SVG = (
    "[...document.querySelectorAll('.ckptlib-stepper-graph svg')]"
    ".find(s => s.getBoundingClientRect().width > 0)"
)


def caption(page) -> tuple[int, int, str]:
    match = CAPTION.match(text_of(page, ".ckptlib-stepper-caption"))
    assert match, text_of(page, ".ckptlib-stepper-caption")
    return int(match[1]), int(match[2]), match[3]


# Inside the graph's view only its scroller may be wider inside than its box, and then it
# scrolls: every node can be brought on screen, none is cut off.
GRAPH_OVERFLOW = """() => {
    const view = document.querySelector('.ckptlib-stepper-graph');
    const scroller = view.querySelector('.ckptlib-stepper-scroll');
    const svg = scroller.querySelector('svg');
    const wider = [view, ...view.querySelectorAll('*')].filter(el => !(el instanceof SVGElement)
        && el !== scroller && el.clientWidth > 0 && el.scrollWidth > el.clientWidth + 1)
        .map(el => `${el.className}: ${el.scrollWidth} > ${el.clientWidth}`);
    return {wider, overflowX: getComputedStyle(scroller).overflowX,
            scrollWidth: scroller.scrollWidth, svgWidth: svg.getBoundingClientRect().width,
            viewRight: view.getBoundingClientRect().right,
            windowWidth: document.documentElement.clientWidth};
}"""
# What the states line says the event is about, the text of the element drawn thick, where the
# graph starts and how tall the caption is.
EVENT_VIEW = """() => {
    const svg = [...document.querySelectorAll('.ckptlib-stepper-graph svg')]
        .find(s => s.getBoundingClientRect().width > 0);
    const thick = [...svg.querySelectorAll('g.node, g.edge')].filter(
        g => g.querySelector('[stroke-width="2.5"]'));
    const label = document.querySelector('.ckptlib-stepper-states')
        .innerText.match(/this event: (.*?) ·/);
    return {label: label && label[1],
            thick: thick.map(g => [...g.querySelectorAll('text')].map(t => t.textContent)
                .join(' ')),
            graphTop: document.querySelector('.ckptlib-stepper-graph')
                .getBoundingClientRect().top,
            captionHeight: document.querySelector('.ckptlib-stepper-caption')
                .getBoundingClientRect().height};
}"""


def assert_graph_scrolls_instead_of_cutting(page) -> None:
    found = page.evaluate(GRAPH_OVERFLOW)
    assert not found["wider"], found
    assert found["viewRight"] <= found["windowWidth"] + 1, found
    assert found["overflowX"] == "auto" and found["scrollWidth"] >= found["svgWidth"] - 1, found


def click_and_wait(page, button: str) -> int:
    """Click Prev or Next and wait until the caption and the graph show the new event."""
    before = caption(page)[0]
    after = before + (1 if button == "next" else -1)
    page.locator(f".ckptlib-stepper-{button}").click()
    page.wait_for_function(
        "(p) => document.querySelector('.ckptlib-stepper-caption').innerText.trim()"
        ".startsWith(`${p}/`)",
        arg=after,
        timeout=WAIT_MS,
    )
    page.wait_for_timeout(300)  # the graph, the timeline and the states are messages of their own
    return after


@pytest.mark.parametrize("width", [1100, 1280])
def test_the_caption_numbers_the_box_drawn_thick_and_nothing_jumps(lab, page, artifacts, width):
    """Plain autograd on a 3-block MLP: a ReLU's output is the next Linear's input, so two
    labels share a box, and the weights' memory is a dashed edge. Stepping through backward,
    every event about a saved tensor has exactly one thick element, and it says the number
    the words use; the graph does not move between clicks however the caption wraps."""
    cells = [
        "from ckptlib.models import MLPChain\nfrom ckptlib.widgets import BackwardStepper",
        "plain = BackwardStepper(MLPChain(depth=3, width=16), batch=32)\n"
        "plain.position.value = next(i for i, f in enumerate(plain.frames) "
        "if f['phase'] == 'backward') - 2\nplain",
    ]
    path = write_notebook(lab, f"stepper_numbers_{width}", cells)
    page.set_viewport_size({"width": width, "height": 800})
    try:
        open_and_run(page, lab, path, ".ckptlib-stepper-caption")
        assert_widgets_rendered(page)
        page.evaluate(
            "() => document.querySelector('.ckptlib-stepper-next').scrollIntoView({block: 'start'})"
        )
        page.wait_for_timeout(300)
        first = page.evaluate(EVENT_VIEW)
        seen, kinds = set(), set()
        for _ in range(22):
            click_and_wait(page, "next")
            view = page.evaluate(EVENT_VIEW)
            assert view["graphTop"] == first["graphTop"], "the graph moved between clicks"
            assert view["captionHeight"] == first["captionHeight"], view
            if view["label"] is None:
                continue
            prefix, _, number = view["label"].rpartition(" #")
            assert len(view["thick"]) == 1, view
            assert prefix in view["thick"][0] and re.search(rf"#{number}\b", view["thick"][0]), view
            kinds.add("box" if "float32" in view["thick"][0] else "edge")  # a box says its size
            seen.add(view["label"])
            if len(seen) == 4:
                page.screenshot(path=str(artifacts / f"stepper_numbers_{width}_shared_box.png"))
        assert kinds == {"edge", "box"} and len(seen) >= 6, (kinds, seen)
        # The timeline is shown at its size (a 2x picture), so its 11 pt ticks are 12 px.
        scale = page.locator(".ckptlib-stepper-timeline img").evaluate(
            "img => img.naturalWidth / img.getBoundingClientRect().width"
        )
        assert 1.95 <= scale <= 2.05, scale
        assert_graph_scrolls_instead_of_cutting(page)
    finally:
        page.screenshot(path=str(artifacts / f"stepper_numbers_{width}.png"))


@pytest.mark.parametrize("width", [1100, 1280])
def test_next_and_play_step_through_the_rerun(lab, page, artifacts, width):
    path = write_notebook(lab, f"stepper_browser_test_{width}", CELLS)
    page.set_viewport_size({"width": width, "height": 800})
    try:
        open_and_run(page, lab, path, ".ckptlib-stepper-caption")
        assert_widgets_rendered(page)
        position, count, text = caption(page)
        assert "block 2 reruns" in text or "loads its kept input" in text, text
        page.locator(".ckptlib-stepper-next").scroll_into_view_if_needed()
        page.evaluate(
            "() => document.querySelector('.ckptlib-stepper-next').scrollIntoView({block: 'start'})"
        )
        before = page.evaluate(NODE_OUTLINES)
        assert (
            len(before) > 10
            and ": recomputed" not in page.locator(".ckptlib-stepper-graph").inner_html()
        )

        page.locator(".ckptlib-stepper-next").click()
        page.wait_for_function(
            "(p) => document.querySelector('.ckptlib-stepper-caption').innerText.trim()"
            ".startsWith(`${p + 1}/`)",
            arg=position,
            timeout=WAIT_MS,
        )
        _, _, text = caption(page)
        assert text.startswith("block 2 rerun: packs tensor #0"), text
        # The graph's picture and the counts arrive in messages of their own: wait for them.
        page.wait_for_function(
            "() => document.querySelector('.ckptlib-stepper-graph').innerHTML"
            ".includes(': recomputed</title>')",
            timeout=WAIT_MS,
        )
        page.wait_for_function(
            "() => /recomputed:\\s*1(?!\\d)/"
            ".test(document.querySelector('.ckptlib-stepper-states').textContent)",
            timeout=WAIT_MS,
        )
        # Laid out once: every node is where it was, only its colours changed.
        assert page.evaluate(NODE_OUTLINES) == before
        assert page.locator(".ckptlib-stepper-timeline img").evaluate("img => img.naturalWidth") > 0

        # What changed is on screen with the controls, and readable.
        page.wait_for_timeout(500)
        view = page.evaluate(f"""() => {{
            const svg = {VISIBLE_SVG};
            const current = [...svg.querySelectorAll('g.node polygon')]
                .find(p => p.getAttribute('stroke-width') === '2.5');
            const text = svg.querySelector('g.node text');
            return {{current: current && current.getBoundingClientRect().toJSON(),
                     next: document.querySelector('.ckptlib-stepper-next')
                         .getBoundingClientRect().toJSON(),
                     textHeight: text.getBoundingClientRect().height}};
        }}""")
        assert view["current"] is not None, "no box of the event drawn"
        assert view["current"]["top"] >= 0 and view["current"]["bottom"] <= 800, view
        assert view["next"]["top"] >= 0 and view["next"]["bottom"] <= 800, view
        assert view["textHeight"] >= 10.5, f"the graph's text is {view['textHeight']:.1f} px tall"
        assert_nothing_clipped(
            page, ".ckptlib-stepper-caption, .ckptlib-stepper-states, .ckptlib-stepper-timeline"
        )
        assert_graph_scrolls_instead_of_cutting(page)
        page.screenshot(path=str(artifacts / f"stepper_{width}_rerun.png"))

        page.locator(".ckptlib-stepper-prev").click()
        page.wait_for_function(
            "(p) => document.querySelector('.ckptlib-stepper-caption').innerText.trim()"
            ".startsWith(`${p}/`)",
            arg=position,
            timeout=WAIT_MS,
        )

        play = page.locator(".widget-play button").first
        play.click()  # Play (the same button pauses)
        page.wait_for_function(
            "(p) => Number(document.querySelector('.ckptlib-stepper-caption').innerText"
            ".split('/')[0]) > p + 2",
            arg=position,
            timeout=WAIT_MS,
        )
        play.click()
        paused_at = caption(page)[0]
        page.wait_for_timeout(2000)  # two intervals: it stays where it paused
        assert (
            caption(page)[0] == paused_at and paused_at > position + 2 and caption(page)[1] == count
        )
        assert page.evaluate(NODE_OUTLINES) == before
    finally:
        page.screenshot(path=str(artifacts / f"stepper_{width}.png"))


def test_the_first_event_shows_no_backward_graph_yet(lab, page, artifacts):
    cells = [
        "from ckptlib.models import MLPChain\nfrom ckptlib.widgets import BackwardStepper\n"
        "BackwardStepper(MLPChain(depth=3, width=16, checkpointing='block'), batch=2)"
    ]
    path = write_notebook(lab, "stepper_first_event", cells)
    page.set_viewport_size({"width": 1280, "height": 800})
    try:
        open_and_run(page, lab, path, ".ckptlib-stepper-caption")
        assert caption(page)[0] == 1
        pale = page.evaluate(f"""() => [...{VISIBLE_SVG}.querySelectorAll('g.node')]
            .filter(g => /^n\\d+$/.test(g.querySelector('title').textContent))
            .map(g => g.querySelector('polygon').getAttribute('fill'))""")
        # Ops forward has not made yet are pale; the leaves (weights, biases) are there already.
        assert "#F7F7F7" in pale and "lightgrey" not in pale, pale
        page.evaluate(
            "() => document.querySelector('.ckptlib-stepper-next').scrollIntoView({block: 'start'})"
        )
    finally:
        page.screenshot(path=str(artifacts / "stepper_first_event.png"))
