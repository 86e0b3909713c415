"""Checks of what a learner sees on the page: nothing cut off, text that wraps instead."""
from __future__ import annotations

# Every element under the selected ones whose content is wider than its box (scrollWidth above
# clientWidth: cut off, or hidden behind a scroll bar), with what it holds. A slider's own parts
# (noUi-*) reach past its track by design and are left out.
CLIPPED = """(selector) => [...document.querySelectorAll(selector)].flatMap(root => [root, ...root.querySelectorAll('*')])
    .filter(el => el.clientWidth > 0 && el.scrollWidth > el.clientWidth + 1 && !(el instanceof SVGElement)
        && !String(el.className).includes('noUi'))
    .map(el => `${el.className || el.tagName}: ${el.scrollWidth} > ${el.clientWidth}: ${(el.innerText || '').slice(0, 60)}`)"""


def assert_nothing_clipped(page, selector: str) -> None:
    """No element in or under ``selector`` is wider inside than its box."""
    clipped = page.evaluate(CLIPPED, selector)
    assert not clipped, "cut off:\n" + "\n".join(clipped)
