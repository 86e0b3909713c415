"""The seed article's Chinese title has glyphs on the site and the slides: a CJK family named
first in both pages' fonts, covering every CJK character the notebooks use, and a font CI
installs for it."""

from __future__ import annotations

import re

import classroom  # tools/, put on sys.path by tests/conftest.py

RANGES = [
    tuple(int(end, 16) for end in part.split("-"))
    for part in re.search(r"unicode-range: ([^;]*);", classroom.CJK_CSS)[1].replace("U+", "")
    .split(", ")
]


def test_every_cjk_character_of_the_notebooks_is_in_the_named_family():
    text = "".join(path.read_text(encoding="utf-8") for path in classroom.notebooks())
    cjk = {char for char in text if ord(char) > 0x2FFF and not 0xFE00 <= ord(char) <= 0xFE0F}
    assert "深" in cjk  # the title is there
    assert all(any(low <= ord(char) <= high for low, high in RANGES) for char in cjk), sorted(
        char for char in cjk if not any(low <= ord(char) <= high for low, high in RANGES)
    )


def test_the_site_and_the_slides_name_the_family_and_ci_installs_its_font():
    assert classroom.SITE_CSS.startswith(classroom.CJK_CSS)
    assert "<style>{{ resources.cjk_css }}</style>" in classroom.SLIDES_TEMPLATE
    assert 'font-family: "Course CJK", "Source Sans Pro"' in classroom.CJK_CSS
    assert 'local("Noto Sans CJK SC")' in classroom.CJK_CSS
    apt = (classroom.ROOT / ".ci" / "run").read_text()
    assert re.search(r"apt-get install [^\n]*\bfonts-noto-cjk\b", apt)
