"""The course as a classroom uses it: notebook structure, gradeable exercises, the static site.

Every notebook: learning goals at the top, a summary at the end, slide metadata on every cell,
a solutions notebook beside it, and at least two exercises each followed by its self-check,
with nbgrader cell metadata an instructor can collect and grade. The site `make site` builds
opens offline: every link and asset in it resolves to a file (and anchor) inside it.
"""
from __future__ import annotations

import base64
import copy
import doctest
import io
import re
from pathlib import Path

import jsonschema
import nbformat
import pytest
from PIL import Image

from ckptlib.widgets import ScheduleExplorer

ROOT = Path(__file__).resolve().parents[2]
import classroom  # noqa: E402  (tools/, put on sys.path by tests/conftest.py)

NOTEBOOKS = classroom.notebooks()
SOLUTIONS = classroom.solutions()
SLIDE_TYPES = {"slide", "subslide", "fragment", "skip", "notes", "-"}
# nbgrader's cell metadata schema, version 3 (nbgrader/nbgraderformat/v3.json).
NBGRADER_V3 = {
    "type": "object",
    "properties": {
        "schema_version": {"type": "integer", "minimum": 3, "maximum": 3},
        "grade": {"type": "boolean"},
        "locked": {"type": "boolean"},
        "solution": {"type": "boolean"},
        "task": {"type": "boolean"},
        "grade_id": {"type": "string", "pattern": r"^[a-zA-Z0-9_\-]*$"},
        "points": {"type": "number", "minimum": 0},
        "checksum": {"type": "string", "minLength": 32, "maxLength": 32},
        "cell_type": {"type": "string", "enum": ["raw", "code", "markdown"]},
    },
    "required": ["schema_version", "grade", "locked", "solution"],
    "additionalProperties": False,
}


def read(path: Path) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=4)


def tags(cell: nbformat.NotebookNode) -> list[str]:
    return cell.metadata.get("tags", [])


def by_stem(paths: list[Path]) -> list:
    return [pytest.param(path, id=path.stem) for path in paths]


def test_every_notebook_has_its_solutions_and_no_solutions_are_orphans():
    assert NOTEBOOKS, "no notebooks/NN_topic.ipynb found"
    expected = {f"{notebook.stem}_solutions" for notebook in NOTEBOOKS}
    found = {solution.stem for solution in SOLUTIONS}
    assert expected - found == set(), (
        "notebooks without notebooks/solutions/NN_topic_solutions.ipynb"
    )
    assert found - expected == set(), "solutions without their notebook"


@pytest.mark.parametrize("path", by_stem(NOTEBOOKS))
def test_notebook_opens_with_goals_and_ends_with_a_summary(path):
    cells = read(path).cells
    first, last = cells[0], cells[-1]
    assert first.cell_type == "markdown" and first.source.startswith("# "), (
        "start with a `# NN · Title` cell"
    )
    assert "learning goals" in first.source.lower(), "the first cell lists the learning goals"
    assert last.cell_type == "markdown" and last.source.startswith("## Summary"), (
        "end with a `## Summary` cell"
    )


@pytest.mark.parametrize("path", by_stem(NOTEBOOKS + SOLUTIONS))
def test_every_cell_has_slide_metadata(path):
    cells = read(path).cells
    missing = [
        cell.id
        for cell in cells
        if cell.metadata.get("slideshow", {}).get("slide_type") not in SLIDE_TYPES
    ]
    assert missing == [], (
        f"cells without slideshow.slide_type (one of {sorted(SLIDE_TYPES)}): {missing}"
    )
    assert cells[0].metadata.slideshow.slide_type == "slide", "the title cell opens the first slide"


@pytest.mark.parametrize("path", by_stem(NOTEBOOKS))
def test_every_exercise_is_followed_by_its_self_check(path):
    marks = [
        (cell.id, "exercise" in tags(cell), "self-check" in tags(cell)) for cell in read(path).cells
    ]
    sequence = "".join("E" if exercise else "S" if check else "" for _, exercise, check in marks)
    assert sequence.count("E") >= 2, (
        f"at least two exercises (cells tagged `exercise`), found {sequence.count('E')}"
    )
    # Each exercise, then its self-check before the next exercise; a check belongs to the exercise
    # before it.
    assert re.fullmatch(r"(ES+)+", sequence), (
        f"tagged cells in order: {sequence} (E exercise, S self-check)"
    )


@pytest.mark.parametrize("path", by_stem(NOTEBOOKS + SOLUTIONS))
def test_nbgrader_metadata_is_valid_and_matches_the_tags(path):
    """What nbgrader's MetadataValidatorV3 checks, plus: exercises are editable answers,
    self-checks locked."""
    grade_ids = []
    for cell in read(path).cells:
        meta = cell.metadata.get("nbgrader")
        is_exercise, is_check = "exercise" in tags(cell), "self-check" in tags(cell)
        assert (meta is not None) == (is_exercise or is_check), (
            f"{cell.id}: nbgrader metadata iff exercise/self-check"
        )
        if meta is None:
            continue
        jsonschema.validate(meta, NBGRADER_V3)
        assert meta.get("grade_id"), f"{cell.id}: an nbgrader cell needs a grade_id"
        grade_ids.append(meta["grade_id"])
        if meta["grade"]:
            assert "points" in meta, f"{cell.id}: a graded cell needs points"
        if meta.get("task", False):
            assert cell.cell_type == "markdown", f"{cell.id}: task cells must be markdown"
        elif cell.cell_type == "markdown":
            assert meta["grade"] and meta["solution"], (
                f"{cell.id}: a markdown answer must be graded and a solution"
            )
        if is_exercise:
            assert meta["solution"] and not meta["locked"], (
                f"{cell.id}: learners write exercises (solution, unlocked)"
            )
        else:
            assert meta["locked"] and not meta["solution"], (
                f"{cell.id}: self-checks are locked, not answers"
            )
    assert len(grade_ids) == len(set(grade_ids)), f"duplicate grade_id: {sorted(grade_ids)}"


def test_doctests_in_the_classroom_builder():
    assert doctest.testmod(classroom).failed == 0


def test_check_site_reports_what_would_not_load_offline(tmp_path):
    (tmp_path / "b.html").write_text('<h2 id="Here">here</h2>')
    (tmp_path / "a.html").write_text(
        '<a href="b.html#Here">ok</a> <a href="https://pytorch.org/docs">read online: ok</a>'
        '<a href="missing.html">1</a> <a href="b.html#Nowhere">2</a>'
        '<script src="https://cdn.example/x.js"></script> <img src="//cdn.example/i.png">'
        '<script>import("https://cdn.example/m.mjs")</script>')
    problems = classroom.check_site(tmp_path)
    assert len(problems) == 5, problems
    assert all(problem.startswith("a.html: ") for problem in problems)


@pytest.fixture(scope="module")
def site(build_classroom) -> Path:
    return build_classroom("site", classroom.build_site)


def test_site_has_a_page_for_every_document(site):
    expected = [Path("index.html")] + [
        path.relative_to(ROOT).with_suffix(".html") for path in NOTEBOOKS + SOLUTIONS
    ]
    if (ROOT / "docs" / "instructor.md").exists():
        expected.append(Path("docs/instructor.html"))
    assert [str(page) for page in expected if not (site / page).is_file()] == []


def test_site_table_of_contents_reaches_every_notebook(site):
    index = (site / "index.html").read_text(encoding="utf-8")
    for notebook in NOTEBOOKS:
        assert f'href="notebooks/{notebook.stem}.html"' in index
    for solution in SOLUTIONS:
        assert f'href="notebooks/solutions/{solution.stem}.html"' in index


def test_site_links_resolve_and_nothing_loads_from_the_network(site):
    assert classroom.check_site(site) == []
    cdn = re.compile(r"unpkg\.com|cdnjs|jsdelivr|googleapis|mathjax\.org")
    pages = sorted(site.rglob("*.html"))
    assert [page.name for page in pages if cdn.search(page.read_text(encoding="utf-8"))] == []


# ---------------------------------------------------------------------------
# Widgets on pages without a kernel (static_widgets)
# ---------------------------------------------------------------------------

def widget_notebook(state: dict, model_id: str = "view") -> nbformat.NotebookNode:
    output = nbformat.v4.new_output("display_data", data={
        classroom.WIDGET_VIEW: {"model_id": model_id, "version_major": 2, "version_minor": 0},
        "text/plain": "MemoryDashboard(per block, depth 4)"})
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("dashboard", outputs=[output])])
    nb.metadata["widgets"] = {
        classroom.WIDGET_STATE: {"state": state, "version_major": 2, "version_minor": 0}
    }
    return nb


def model(module: str = "@jupyter-widgets/controls", **state) -> dict:
    return {
        "model_module": module,
        "model_module_version": "2.0.0",
        "model_name": "VBoxModel",
        "state": state,
    }


DOCUMENT = classroom.PurePosixPath("notebooks/06_x.ipynb")


def test_a_widget_with_its_state_is_a_snapshot_with_a_note():
    state = {"view": model(children=["IPY_MODEL_child"]), "child": model(), "stale": model()}
    nb = classroom.static_widgets(widget_notebook(state), DOCUMENT)
    note, view = nb.cells[0].outputs
    assert (
        "Static snapshot" in note.data["text/html"]
        and "make lab NOTEBOOK=06_x.ipynb</code> opens your own copy, lab/06_x.ipynb"
        in note.data["text/html"]
    )
    assert classroom.WIDGET_VIEW in view.data
    # The saved state keeps what the shown widgets need: "stale" belonged to no output.
    assert sorted(nb.metadata.widgets[classroom.WIDGET_STATE]["state"]) == ["child", "view"]


def test_a_widget_with_its_picture_shows_the_picture_its_cell_showed_not_the_last_state():
    """The saved state is the widget's state at the end (after later cells moved it on); the
    picture in the output is what the cell showed, so the page shows that and drops the view."""
    nb = widget_notebook({"view": model(), "other": model()})
    nb.cells[0].outputs[0].data["image/png"] = "iVBORw0KGgo="
    nb.cells[0].outputs[0].metadata = {"image/png": {"width": 656}}
    nb = classroom.static_widgets(nb, DOCUMENT)
    note, picture = nb.cells[0].outputs
    assert "Picture of an interactive widget as its cell showed it" in note.data["text/html"]
    assert picture.data == {
        "image/png": "iVBORw0KGgo=",
        "text/plain": "MemoryDashboard(per block, depth 4)",
    }
    assert picture.metadata == {"image/png": {"width": 656}}
    assert "widgets" not in nb.metadata   # no view left: nothing is drawn from the saved state
    body, _ = classroom.HTMLExporter().from_notebook_node(nb)
    assert "data:image/png;base64,iVBORw0KGgo=" in body and classroom.WIDGET_VIEW not in body


def test_a_widget_without_a_picture_says_its_snapshot_is_the_saved_state():
    nb = classroom.static_widgets(widget_notebook({"view": model()}), DOCUMENT)
    assert (
        "in the state it was saved with (later cells may have changed it"
        in nb.cells[0].outputs[0].data["text/html"]
    )


def test_a_widget_picture_is_shown_at_the_size_of_the_live_widget():
    """ckptlib's widgets draw their pictures at twice the pixels they take on screen: a page
    shows one at half its pixel width (sharp, and as large as the live widget), not at its full
    pixels (twice too large)."""
    explorer = ScheduleExplorer(n=8, schedule="revolve", max_n=8)
    try:
        bundle = explorer._repr_mimebundle_()
    finally:
        explorer.close()
    width = Image.open(io.BytesIO(base64.b64decode(bundle["image/png"]))).width
    nb = widget_notebook({"view": model()})
    nb.cells[0].outputs[0].data["image/png"] = bundle["image/png"]
    page = classroom.static_widgets(copy.deepcopy(nb), DOCUMENT)
    _, picture = page.cells[0].outputs
    assert picture.metadata == {"image/png": {"width": width // 2}}
    body, _ = classroom.HTMLExporter().from_notebook_node(page)
    assert f'width="{width // 2}"' in body
    # A deck shows it as large as the canvas allows: slides.js shrinks what does not fit.
    deck = classroom.static_widgets(nb, DOCUMENT, pictures_at_widget_size=False)
    assert deck.cells[0].outputs[1].metadata == {}


def test_in_a_deck_a_widget_gets_a_cell_of_its_own_without_code():
    nb = classroom.slides_apart(
        classroom.static_widgets(widget_notebook({"view": model()}), DOCUMENT)
    )
    code, apart = nb.cells
    assert code.source == "dashboard" and code.outputs == []
    assert apart.metadata["tags"] == [classroom.OUTPUTS_ONLY] and len(apart.outputs) == 2
    body, _ = classroom.SlidesExporter(config=classroom.asset_config("_static")).from_notebook_node(
        nb
    )
    assert body.count("jp-InputArea jp-Cell-inputArea") == 1, "the widget's cell shows no code"


@pytest.mark.parametrize("state", [
    pytest.param({}, id="no state"),
    pytest.param({"view": model(children=["IPY_MODEL_child"])}, id="a child's state missing"),
    pytest.param({"view": model("ipycanvas")}, id="a widget library the page cannot load"),
])
def test_a_widget_without_its_state_becomes_a_note_that_names_it(state):
    nb = classroom.static_widgets(widget_notebook(state), DOCUMENT)
    [note] = nb.cells[0].outputs
    assert classroom.WIDGET_VIEW not in note.data
    assert "Interactive widget MemoryDashboard(per block, depth 4)" in note.data["text/html"]
    # The learner's copy, opened by name (the committed notebook shows the answers).
    assert "<code>make lab NOTEBOOK=06_x.ipynb</code> opens your own copy, lab/06_x.ipynb" in (
        note.data["text/html"])
    assert "notebooks/" not in note.data["text/html"]
    assert "widgets" not in nb.metadata   # nothing left to draw: no widgets script on the page


def test_nbconvert_shows_the_note_not_an_empty_box_for_a_widget_without_state():
    """nbconvert alone falls back to the widget's text repr (or, with a partial state, an empty
    box the widgets manager cannot fill); after static_widgets the page shows the note."""
    nb = classroom.static_widgets(
        widget_notebook({"view": model(children=["IPY_MODEL_gone"])}), DOCUMENT
    )
    body, _ = classroom.HTMLExporter().from_notebook_node(nb)
    assert "course-widget-note" in body and "its state was not saved" in body
    assert classroom.WIDGET_VIEW not in body


def test_slides_use_a_16_9_canvas_and_their_own_start_up():
    config = classroom.asset_config("_static")
    assert (config.SlidesExporter.reveal_width, config.SlidesExporter.reveal_height) == (
        "1280",
        "720",
    )
    assert (
        "reveal_scroll" not in config.SlidesExporter
    )  # slides.js fits slides instead of scrolling them
    assert (
        "courseSlides.start" in classroom.SLIDES_TEMPLATE
        and 'navigationMode: "linear"' in classroom.SLIDES_TEMPLATE
    )
    assert sorted(path.name for path in classroom.COURSE_STATIC.iterdir()) == [
        "slides.css",
        "slides.js",
    ]


def test_the_slides_index_puts_each_notebooks_solutions_after_it():
    pages = {
        classroom.PurePosixPath(f"notebooks/{name}.ipynb"): classroom.PurePosixPath(
            f"{name}.slides.html"
        )
        for name in ("01_b", "00_a")
    }
    pages[classroom.PurePosixPath("notebooks/solutions/00_a_solutions.ipynb")] = (
        classroom.PurePosixPath("solutions/00_a_solutions.slides.html")
    )
    titles = {
        classroom.PurePosixPath("notebooks/00_a.ipynb"): "00 · A & more",
        classroom.PurePosixPath("notebooks/01_b.ipynb"): "01 · B",
    }
    links = re.findall(r'<a href="([^"]+)">([^<]+)</a>', classroom.slides_index(pages, titles))
    assert links == [
        ("00_a.slides.html", "00 · A &amp; more"),
        ("solutions/00_a_solutions.slides.html", "solutions"),
        ("01_b.slides.html", "01 · B"),
    ]


@pytest.mark.parametrize(
    "path",
    [p for p in NOTEBOOKS if classroom.WIDGET_VIEW in p.read_text(encoding="utf-8")],
    ids=lambda path: path.stem,
)
def test_site_labels_each_widget_as_a_snapshot(site, path):
    page = (site / path.relative_to(ROOT).with_suffix(".html")).read_text(encoding="utf-8")
    notes = page.count('class="course-widget-note"')
    views = page.count(f'<script type="{classroom.WIDGET_VIEW}">')
    pictures = sum(classroom.WIDGET_VIEW in output.get("data", {}) and "image/png" in output.data
                   for cell in read(path).cells for output in cell.get("outputs", []))
    assert notes == views + pictures >= 1
    shown = f'<script type="{classroom.WIDGET_VIEW}">' if views else "data:image/png"
    assert page.index("course-widget-note") < page.index(shown, page.index("course-widget-note"))
