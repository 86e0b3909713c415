"""The reveal.js decks `make slides` builds open offline in Chromium with the slides their notebooks ask for.

Expected slides, from the notebook's metadata alone (what nbconvert's reveal preprocessor does):
a slide starts at the first cell whose slide_type is not "skip" or "notes" (whatever its type),
and at every later cell whose slide_type is "slide" or "subslide". reveal.js counts each
subslide (a vertical slide) as one slide; "fragment", "-", "skip" and "notes" cells never
start one, and a cell without slide metadata counts as "-".
"""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

import classroom  # tools/, put on sys.path by tests/conftest.py

pytestmark = pytest.mark.browser
NOTEBOOKS = classroom.notebooks() + classroom.solutions()


def expected_slides(notebook: Path) -> int:
    kinds = [cell.metadata.get("slideshow", {}).get("slide_type", "-")
             for cell in nbformat.read(notebook, as_version=4).cells]
    first = next(index for index, kind in enumerate(kinds) if kind not in ("skip", "notes"))
    return 1 + sum(kind in ("slide", "subslide") for kind in kinds[first + 1:])


@pytest.fixture(scope="module")
def decks(browser, build_classroom) -> Path:
    """The decks, built once into a temporary folder (after `browser` says there is one)."""
    return build_classroom("slides", classroom.build_slides)


def test_decks_link_only_to_local_files(decks):
    assert classroom.check_site(decks) == []


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[notebook.stem for notebook in NOTEBOOKS])
def test_deck_shows_every_slide_offline(notebook, decks, page, artifacts):
    deck = classroom.slides_page(notebook)
    network, page_errors = [], []
    page.on("request", lambda request: request.url.startswith(("file:", "data:", "blob:"))
            or network.append(request.url))
    page.on("pageerror", lambda error: page_errors.append(str(error)))

    # networkidle: MathJax and the widgets renderer load their pieces after the page's load event.
    page.goto((decks / deck).as_uri(), wait_until="networkidle")
    page.wait_for_selector(".reveal.ready", state="attached", timeout=15_000)
    # reveal.js was loaded through require.js (AMD), so it is a module, not a global.
    reveal_js = f"{classroom.static_prefix(deck)}/reveal.js/dist/reveal.js"
    shown = page.evaluate("url => require(url).getTotalSlides()", reveal_js)
    if shown != expected_slides(notebook) or page.console_errors or page_errors:
        page.screenshot(path=str(artifacts / f"slides-{notebook.stem}.png"))

    assert shown == expected_slides(notebook), f"{deck}: reveal.js shows {shown} slides"
    assert page.console_errors == [] and page_errors == [], f"{deck}: {page.console_errors + page_errors}"
    assert network == [], f"{deck} reached for the network: {network}"
