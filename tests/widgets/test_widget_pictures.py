"""Every widget output of every committed notebook carries a picture of the widget's state.

A widget's view needs a live kernel and a trusted notebook. Where there is neither (an
untrusted notebook in JupyterLab, nbconvert's HTML, GitHub, the course site) the reader sees
the output's other parts: so beside the widget view there must be an ``image/png`` (and a
short ``text/plain``), or the cell shows an empty ``Out[n]:``.
"""
from __future__ import annotations

import base64
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
NOTEBOOKS = sorted((ROOT / "notebooks").rglob("*.ipynb"))


def widget_outputs(path: Path) -> list[tuple[int, dict]]:
    notebook = nbformat.read(path, as_version=4)
    return [
        (number, output)
        for number, cell in enumerate(notebook.cells)
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
        if WIDGET_VIEW in output.get("data", {})
    ]


def test_the_course_has_widget_outputs_to_check():
    assert sum(len(widget_outputs(path)) for path in NOTEBOOKS) >= 4


@pytest.mark.parametrize(
    "path", NOTEBOOKS, ids=[str(p.relative_to(ROOT / "notebooks")) for p in NOTEBOOKS]
)
def test_every_widget_output_has_a_picture_and_a_short_text(path):
    for number, output in widget_outputs(path):
        data = output["data"]
        assert "image/png" in data, (
            f"{path.name}, cell {number}: a widget output without an image/png "
            "(re-run the notebook: the widgets add one)"
        )
        assert base64.b64decode(data["image/png"])[:8] == b"\x89PNG\r\n\x1a\n", (
            f"{path.name}, cell {number}"
        )
        text = "".join(data.get("text/plain", ""))
        assert text and "\n" not in text.strip() and len(text) < 400, (
            f"{path.name}, cell {number}: {text!r}"
        )
