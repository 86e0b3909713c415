"""The reveal.js decks `make slides` builds open offline in Chromium, and every slide fits the
screen.

Expected slides, from the notebook's metadata alone (what nbconvert's reveal preprocessor does):
a slide starts at the first cell whose slide_type is not "skip" or "notes" (whatever its type),
and at every later cell whose slide_type is "slide" or "subslide". reveal.js counts each
subslide (a vertical slide) as one slide; "fragment", "-", "skip" and "notes" cells never
start one, and a cell without slide metadata counts as "-". On top of those, slides.js splits a
slide too tall for the canvas into continuation slides (class ``course-continued``), and says
how many it made in ``<html data-slides-fitted="N">`` before reveal.js starts.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import nbformat
import pytest

import classroom  # tools/, put on sys.path by tests/conftest.py

pytestmark = pytest.mark.browser
NOTEBOOKS = classroom.notebooks() + classroom.solutions()
WIDGET_NOTEBOOKS = [
    notebook
    for notebook in NOTEBOOKS
    if classroom.WIDGET_VIEW in notebook.read_text(encoding="utf-8")
]

# Every slide, with all its fragments shown: how tall it is, and which <pre> blocks overflow.
MEASURE_SLIDES = """reveal_js => {
  const Reveal = require(reveal_js);
  const height = Reveal.getConfig().height;
  const slides = [];
  for (const slide of Reveal.getSlides()) {
    const at = Reveal.getIndices(slide);
    Reveal.slide(at.h, at.v);
    while (Reveal.nextFragment()) {}
    const pres = [...slide.querySelectorAll('pre')].filter(pre => pre.clientWidth > 0);
    slides.push({
      at: `${at.h}/${at.v}`, height, tall: slide.scrollHeight,
      scrolls: slide.classList.contains('course-scroll'),
      clipped: pres.filter(pre => pre.scrollWidth > pre.clientWidth + 1)
        .map(pre => pre.textContent.slice(0, 40)),
      smallest_code_px: Math.min(99,
        ...pres.map(pre => parseFloat(getComputedStyle(pre).fontSize))),
    });
  }
  return slides;
}"""


def expected_slides(notebook: Path) -> int:
    kinds = [
        cell.metadata.get("slideshow", {}).get("slide_type", "-")
        for cell in nbformat.read(notebook, as_version=4).cells
    ]
    first = next(index for index, kind in enumerate(kinds) if kind not in ("skip", "notes"))
    return 1 + sum(kind in ("slide", "subslide") for kind in kinds[first + 1 :])


@pytest.fixture(scope="module")
def decks(browser, build_classroom) -> Path:
    """The decks, built once into a temporary folder (after `browser` says there is one)."""
    return build_classroom("slides", classroom.build_slides)


def open_deck(page, decks: Path, notebook: Path, network: list, page_errors: list) -> str:
    """Open a notebook's deck offline; return the URL of its reveal.js module."""
    deck = classroom.slides_page(notebook)
    page.on(
        "request",
        lambda request: (
            request.url.startswith(("file:", "data:", "blob:")) or network.append(request.url)
        ),
    )
    page.on("pageerror", lambda error: page_errors.append(str(error)))
    # networkidle: MathJax and the widgets renderer load their pieces after the page's load event.
    page.goto((decks / deck).as_uri(), wait_until="networkidle")
    page.wait_for_selector(".reveal.ready", state="attached", timeout=20_000)
    # reveal.js was loaded through require.js (AMD), so it is a module, not a global.
    return f"{classroom.static_prefix(deck)}/reveal.js/dist/reveal.js"


def test_decks_link_only_to_local_files(decks):
    assert classroom.check_site(decks) == []


def test_the_index_lists_the_decks_by_title_in_course_order(decks):
    index = (decks / "index.html").read_text(encoding="utf-8")
    links = re.findall(r'<a href="([^"]+)">([^<]+)</a>', index)
    course = [notebook for notebook in NOTEBOOKS if notebook.parent.name != "solutions"]
    expected = []
    for notebook in course:
        title = classroom._title(nbformat.read(notebook, as_version=4).cells[0].source)
        expected.append((classroom.slides_page(notebook).as_posix(), title.replace("&", "&amp;")))
        solution = notebook.parent / "solutions" / f"{notebook.stem}_solutions.ipynb"
        expected.append((classroom.slides_page(solution).as_posix(), "solutions"))
    assert links == expected
    assert ".slides.html</a>" not in index, "the index shows titles, not file names"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[notebook.stem for notebook in NOTEBOOKS])
def test_deck_shows_every_slide_offline(notebook, decks, page, artifacts):
    network, page_errors = [], []
    reveal_js = open_deck(page, decks, notebook, network, page_errors)
    shown = page.evaluate("url => require(url).getTotalSlides()", reveal_js)
    continued = int(page.evaluate("() => document.documentElement.dataset.slidesFitted"))
    if shown != expected_slides(notebook) + continued or page.console_errors or page_errors:
        page.screenshot(path=str(artifacts / f"slides-{notebook.stem}.png"))

    assert shown == expected_slides(notebook) + continued, f"reveal.js shows {shown} slides"
    assert page.locator("section.course-continued").count() == continued
    assert page.console_errors == [] and page_errors == [], f"{page.console_errors + page_errors}"
    assert network == [], f"the deck reached for the network: {network}"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[notebook.stem for notebook in NOTEBOOKS])
def test_every_slide_fits_the_canvas(notebook, decks, page, artifacts):
    """No code line is cut off on the right, no slide runs below the canvas, code stays readable.

    (A single cell taller than the canvas may scroll inside its slide: allowed for at most one
    slide per deck, the fallback slides.js keeps for content it can neither split nor shrink.)
    """
    reveal_js = open_deck(page, decks, notebook, [], [])
    slides = page.evaluate(MEASURE_SLIDES, reveal_js)
    clipped = [(slide["at"], slide["clipped"]) for slide in slides if slide["clipped"]]
    too_tall = [
        (slide["at"], slide["tall"])
        for slide in slides
        if slide["tall"] > slide["height"] + 1 and not slide["scrolls"]
    ]
    if clipped or too_tall:
        worst = (clipped or too_tall)[0][0].split("/")
        page.evaluate(f"url => require(url).slide({worst[0]}, {worst[1]})", reveal_js)
        page.screenshot(path=str(artifacts / f"slides-fit-{notebook.stem}.png"))

    assert clipped == [], "code or output cut off on the right"
    assert too_tall == [], "slides taller than the canvas"
    scrolling = [slide["at"] for slide in slides if slide["scrolls"]]
    assert len(scrolling) <= 1, f"slides that scroll: {scrolling}"
    assert min(slide["smallest_code_px"] for slide in slides) >= 13


@pytest.mark.parametrize(
    "notebook", WIDGET_NOTEBOOKS, ids=[notebook.stem for notebook in WIDGET_NOTEBOOKS]
)
def test_a_widget_is_a_labelled_snapshot(notebook, decks, page, artifacts):
    """Each widget output shows what its cell showed (its picture, or else its saved state; never an
    empty box) on a slide of its own, under a note that says which, readable: no text below 10 px
    on the canvas (before: the explorer's table at ~8 px, the stepper's caption at ~6 px), no
    button label cut short ("checkpointi...")."""
    reveal_js = open_deck(page, decks, notebook, [], [])
    assert page.locator(".course-widget-note").count() >= 1, "no note on the widget"
    note = page.locator(".course-widget-note").first
    page.evaluate(
        "([url, note]) => { const Reveal = require(url);"
        " const at = Reveal.getIndices(note.closest('section'));"
        " Reveal.slide(at.h, at.v); while (Reveal.nextFragment()) {} }",
        [reveal_js, note.element_handle()],
    )
    page.wait_for_timeout(500)
    page.screenshot(path=str(artifacts / f"slides-widget-{notebook.stem}.png"))
    assert note.is_visible()
    text = note.inner_text()
    assert (
        "Static snapshot" in text or "Picture of an interactive widget" in text
    ) and notebook.name in text
    slide = page.locator("section.present").last
    if "Static snapshot" in text:
        views = slide.locator(".widget-subarea")
        assert (
            views.count() >= 1
            and views.first.locator(".widget-button, .widget-slider, .jupyter-widgets").count() > 0
        )
        zoom = slide.evaluate("s => parseFloat(s.querySelector('.course-shrink')?.style.zoom || 1)")
        smallest = min(
            views.first.evaluate("""view => [...view.querySelectorAll('*')]
            .filter(e => [...e.childNodes].some(n => n.nodeType === 3 && n.textContent.trim())
                && e.offsetWidth)
            .map(e => parseFloat(getComputedStyle(e).fontSize))""")
        )
        assert smallest * zoom >= 10, f"widget text at {smallest * zoom:.1f} px"
        cut = views.first.evaluate("""view => [...view.querySelectorAll('.jupyter-button')]
            .filter(b => b.scrollWidth > b.clientWidth + 1).map(b => b.innerText)""")
        assert cut == [], f"button labels cut short: {cut}"
    else:
        assert slide.locator(".jp-OutputArea-output img").count() >= 1
    assert page.console_errors == []


# Each character drawn alone on a canvas in the font the page gives `element`, as a data URL. A
# character no font has is drawn as the .notdef box, the same picture for every such character.
DRAWN = """async ([element, characters]) => {
  const font = `32px ${getComputedStyle(element).fontFamily}`;
  await document.fonts.load(font, characters.join(''));
  return characters.map(character => {
    const canvas = document.createElement('canvas');
    canvas.width = canvas.height = 48;
    const context = canvas.getContext('2d');
    context.font = font;
    context.fillText(character, 4, 38);
    return canvas.toDataURL();
  });
}"""
NO_GLYPH = "\U0010fffd"  # private use: no font draws it, so it shows what a box looks like


def cjk_font_installed() -> bool:
    """Whether fontconfig (which Chromium asks) knows a font with Chinese glyphs."""
    fc_list = shutil.which("fc-list")
    return bool(fc_list) and bool(subprocess.run(
        [fc_list, ":lang=zh", "family"], capture_output=True, text=True).stdout.strip())


def test_the_chinese_title_draws_glyphs_not_boxes(decks, page):
    """Where a CJK font is installed (CI installs fonts-noto-cjk), the seed article's title on the
    first slide is drawn as glyphs: every character of it differs from a box, and from the others
    (boxes would all look alike)."""
    if not cjk_font_installed():
        if os.environ.get("CI"):
            pytest.fail("no CJK font installed: CI installs fonts-noto-cjk (.ci/run)")
        pytest.skip("no CJK font installed here (apt-get install fonts-noto-cjk)")
    notebook = classroom.ROOT / "notebooks" / "05_memory_vs_compute.ipynb"
    open_deck(page, decks, notebook, [], [])
    title = page.locator("section p", has_text="深入PyTorch").first
    characters = sorted(set(re.findall(r"[\u3000-\u9fff\uff00-\uffef]", title.inner_text())))
    assert len(characters) >= 10, characters
    drawn = dict(zip(characters + [NO_GLYPH],
                     page.evaluate(DRAWN, [title.element_handle(), characters + [NO_GLYPH]])))
    boxes = [character for character in characters if drawn[character] == drawn[NO_GLYPH]]
    assert boxes == [], f"drawn as boxes: {''.join(boxes)}"
    assert len({drawn[character] for character in characters}) == len(characters)
