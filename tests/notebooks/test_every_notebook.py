"""Conventions every notebook of the course keeps: a prediction comes before the cell that measures
it.

A predict cell (tagged ``predict``, starting ``# Predict:``) asks for a guess; the next cell checks
it
with ``check_prediction``. These tests read the committed notebooks, they run nothing.
"""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


# -- every notebook here: predict, then run ------------------------------------------------------


@pytest.mark.parametrize(
    "name, least",
    [
        ("00_welcome_and_setup", 1),
        ("01_autograd_graphs", 2),
        ("04_rng_and_state", 2),
        ("06_transformer_in_practice", 5),
    ],
)
def test_predict_cells_follow_the_course_convention(name, least):
    cells = nbformat.read(NOTEBOOKS / f"{name}.ipynb", 4).cells
    body_end = next(
        i for i, cell in enumerate(cells) if "exercise" in cell.metadata.get("tags", [])
    )
    predicts = [
        i for i, cell in enumerate(cells[:body_end]) if "predict" in cell.metadata.get("tags", [])
    ]
    assert len(predicts) >= least
    names = []
    for i in predicts:
        guess = re.search(
            r"^(guess_\w+) = .+# your guess: change it, run this cell, then the next one$",
            cells[i].source,
            re.M,
        )
        assert guess and cells[i].source.startswith("# Predict:"), cells[i].source
        names.append(guess.group(1))
        assert f"check_prediction({guess.group(1)}," in cells[i + 1].source
    assert len(set(names)) == len(names)


# ------------------------------------------------------- predictions in the reading-heavy sections

READING_HEAVY = {"05_memory_vs_compute": (4, 5), "06_transformer_in_practice": (1, 4),
                 "07_beyond": (3, 4, 5), "08_deep_dive_selective": (2, 6)}


@pytest.mark.parametrize("name", READING_HEAVY)
def test_reading_heavy_sections_ask_for_a_prediction_first(name):
    """Each listed ``## N.`` section has a predict cell whose guess the next cell checks,
    and whose guess is a value: the verdict must not rely on what "no guess" defaults to."""
    sections: dict[int, list[int]] = {}
    cells = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4).cells
    section = None
    for index, cell in enumerate(cells):
        heading = cell.cell_type == "markdown" and cell.source.startswith("## ")
        if heading:
            number = cell.source[3:].split(".")[0]
            section = int(number) if number.isdigit() else None
        if section is not None and "predict" in cell.metadata.get("tags", []):
            sections.setdefault(section, []).append(index)
    for number in READING_HEAVY[name]:
        assert sections.get(number), f"{name}: section {number} has no predict cell"
        for index in sections[number]:
            source = cells[index].source
            guess = re.search(
                r"^(guess_\w+) = (.+?)\s+"
                r"# your guess: change it, run this cell, then the next one$",
                source,
                re.M,
            )
            assert source.startswith("# Predict:") and guess, source
            assert guess.group(2) not in ("None", "..."), (
                f"{name}: commit a guess, not {guess.group(2)}"
            )
            assert f"check_prediction({guess.group(1)}," in cells[index + 1].source
