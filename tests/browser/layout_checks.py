"""What the widget browser tests check about layout: nothing clipped, text big enough, pictures
sharp.

Each check runs in the page and returns what it found wrong, so a failing assertion lists the
offending elements instead of saying "False".
"""

from __future__ import annotations

# The two widths a learner's screen has in the tests: a small laptop and a common one.
WIDTHS = {"1100px": {"width": 1100, "height": 800}, "1280px": {"width": 1280, "height": 800}}

# Elements under `root` whose content is wider than their box (scrollWidth above clientWidth):
# what overflow:hidden cuts off, or what runs past the page. Also the root past the viewport.
CLIPPED = """(box) => {
    const found = [];
    if (box.getBoundingClientRect().right > document.documentElement.clientWidth + 1)
        found.push(`the widget ends at ${box.getBoundingClientRect().right}px, past the window`);
    for (const element of [box, ...box.querySelectorAll('*')]) {
        if (element.clientWidth > 0 && element.scrollWidth > element.clientWidth + 1
                && getComputedStyle(element).overflowX !== 'visible' || (element.clientWidth > 0
                && element.getBoundingClientRect().right > box.getBoundingClientRect().right + 1))
            found.push(`${element.tagName}.${[...element.classList].join('.')}: `
                       + `${element.scrollWidth} > ${element.clientWidth} `
                       + `"${element.innerText?.slice(0, 40)}"`);
    }
    return found;
}"""

# Text under `root` set smaller than `least` CSS pixels (on screen, no zoom).
SMALL_TEXT = """(root, least) => [...root.querySelectorAll('*')]
    .filter(element => [...element.childNodes].some(
        node => node.nodeType === 3 && node.textContent.trim()))
    .filter(element => parseFloat(getComputedStyle(element).fontSize) < least)
    .map(element => `${element.tagName} ${getComputedStyle(element).fontSize}: `
        + `"${element.innerText.slice(0, 30)}"`)"""

# An <img> drawn at `scale` times its size: natural width over shown width
# (1.0: a 2x picture stretched).
PICTURE_SCALE = "(img) => img.naturalWidth / img.getBoundingClientRect().width"


def clipped(root) -> list[str]:
    """What is cut off inside the element of the Playwright locator ``root``."""
    return root.evaluate(CLIPPED)


def small_text(root, least_px: float = 11) -> list[str]:
    """Text inside ``root`` smaller than ``least_px``."""
    return root.evaluate(SMALL_TEXT, least_px)


def picture_scale(picture) -> float:
    """Natural over shown width of the <img> of the locator ``picture``."""
    return picture.evaluate(PICTURE_SCALE)


def assert_readable(root, plot: str) -> None:
    """Nothing cut off inside ``root``, no text below 11 px, its ``plot`` a 2x picture shown at
    (about) its size."""
    cut, small = clipped(root), small_text(root)
    assert not cut, "cut off:\n" + "\n".join(cut)
    assert not small, "too small:\n" + "\n".join(small)
    scale = picture_scale(root.locator(plot))
    assert 1.9 <= scale <= 2.1, f"the 2x plot is shown at {2 / scale:.2f} of its size"


# Every element under the selected ones whose content is wider than its box (scrollWidth above
# clientWidth: cut off, or hidden behind a scroll bar), with what it holds. A slider's own parts
# (noUi-*) reach past its track by design and are left out.
CLIPPED_UNDER_SELECTOR = """(selector) => [...document.querySelectorAll(selector)]
    .flatMap(root => [root, ...root.querySelectorAll('*')])
    .filter(el => el.clientWidth > 0 && el.scrollWidth > el.clientWidth + 1
        && !(el instanceof SVGElement)
        && !String(el.className).includes('noUi'))
    .map(el => `${el.className || el.tagName}: ${el.scrollWidth} > ${el.clientWidth}: `
        + `${(el.innerText || '').slice(0, 60)}`)"""


def assert_nothing_clipped(page, selector: str) -> None:
    """No element in or under ``selector`` is wider inside than its box."""
    clipped = page.evaluate(CLIPPED_UNDER_SELECTOR, selector)
    assert not clipped, "cut off:\n" + "\n".join(clipped)
