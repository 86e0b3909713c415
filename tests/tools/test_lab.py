"""``make lab``'s working copy (tools/lab.py): notebooks without their outputs, so that a learner
predicts blind; paths that mean what they mean in notebooks/; the learner's edits never lost, and
never a change git sees.

The copy is made in a temporary repository whose every top-level entry but ``notebooks/`` is a
link to this one, so that a path a notebook takes relative to its folder (``../benchmarks/``)
resolves from the copy exactly as it would from a ``lab/`` in this repository.
"""
from __future__ import annotations

import doctest
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import lab as lab_tool  # noqa: E402  (tools/lab.py)

from tests._notebooks import in_folder, run_cell  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"


@pytest.fixture()
def repository(tmp_path: Path) -> Path:
    for entry in ROOT.iterdir():
        if entry.name not in ("notebooks", "lab", ".git"):
            (tmp_path / entry.name).symlink_to(entry)
    return tmp_path


@pytest.fixture()
def lab(repository: Path) -> Path:
    lab_tool.make_lab(NOTEBOOKS, repository / "lab")
    return repository / "lab"


def notebooks_in(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.ipynb"))


def test_the_doctests_in_the_lab_tool():
    assert doctest.testmod(lab_tool).failed == 0


def test_the_copy_holds_every_course_file_and_no_output(lab):
    expected = {path.relative_to(NOTEBOOKS) for path in lab_tool.course_files(NOTEBOOKS)}
    copied = {path.relative_to(lab) for path in lab.rglob("*") if path.is_file()}
    assert copied - {Path(lab_tool.MANIFEST)} == expected
    assert (lab / "clinic_ddp.py").read_bytes() == (NOTEBOOKS / "clinic_ddp.py").read_bytes()
    for path in notebooks_in(lab):
        notebook = nbformat.read(path, as_version=4)
        original = nbformat.read(NOTEBOOKS / path.relative_to(lab), as_version=4)
        assert "widgets" not in notebook.metadata
        assert [cell.source for cell in notebook.cells] == [cell.source for cell in original.cells]
        assert [cell.metadata for cell in notebook.cells] == [
            cell.metadata for cell in original.cells
        ]
        for cell in notebook.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, (path.name, cell.id)


def test_the_committed_notebooks_keep_their_outputs(lab):
    """The copy is cleared; the originals are untouched (nbval, the site and the slides read
    them)."""
    for path in notebooks_in(NOTEBOOKS):
        assert any(
            cell.get("outputs") for cell in nbformat.read(path, as_version=4).cells
        ), f"{path.name} has no outputs: it should be committed as a fresh run left it"


def test_every_relative_link_in_the_copy_leads_where_it_does_from_notebooks(lab):
    for path in notebooks_in(lab):
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type != "markdown":
                continue
            for target in re.findall(r"\]\(([^)#\s]+)", cell.source):
                if re.match(r"[a-z]+:", target):
                    continue   # a web address
                assert (path.parent / target).exists(), f"{path.relative_to(lab)}: {target}"


@pytest.mark.parametrize("folder", ["", "solutions"])
def test_the_clinic_finds_its_ddp_helper_from_the_copy(lab, folder, monkeypatch):
    """Notebook 10 and its solutions import clinic_ddp.py from their folder or the one above."""
    monkeypatch.delitem(sys.modules, "clinic_ddp", raising=False)   # imported from notebooks/
    monkeypatch.setattr(sys, "path", list(sys.path))                # before, by test_nb10
    name = "10_clinic.ipynb" if not folder else "10_clinic_solutions.ipynb"
    cells = nbformat.read(lab / folder / name, as_version=4).cells
    setup = next(cell.source for cell in cells if "clinic_ddp.py" in cell.source
                 and "sys.path.insert" in cell.source)
    namespace: dict = {}
    with in_folder(lab / folder):
        run_cell(setup, namespace)
        run_cell("import clinic_ddp", namespace)
    assert Path(namespace["clinic_ddp"].__file__).resolve() == (lab / "clinic_ddp.py").resolve()


def test_notebook_06_loads_the_benchmark_module_from_the_copy(lab):
    """06 reads ``../benchmarks/region_cost.py`` relative to its folder."""
    source = next(
        cell.source for cell in nbformat.read(lab / "06_transformer_in_practice.ipynb", 4).cells
        if "spec_from_file_location" in cell.source
    )
    loading = source[: source.index("spec.loader.exec_module(region_cost)")]
    namespace: dict = {}
    with in_folder(lab):
        run_cell(loading, namespace)
        assert Path(namespace["spec"].origin).resolve() == (ROOT / "benchmarks" / "region_cost.py")


def edit(path: Path, text: str) -> None:
    notebook = nbformat.read(path, as_version=4)
    notebook.cells[0].source += text
    notebook.cells[1].outputs = [nbformat.v4.new_output("stream", text="the learner ran this")]
    nbformat.write(notebook, path)


def test_making_it_again_keeps_the_learners_edits(lab):
    edited = lab / "00_welcome_and_setup.ipynb"
    edit(edited, "\nmy note")
    before = edited.read_bytes()
    outcome = lab_tool.make_lab(NOTEBOOKS, lab)
    assert edited.read_bytes() == before
    assert outcome["made"] == outcome["updated"] == outcome["kept"] == []


def test_a_changed_course_file_replaces_an_untouched_copy_and_never_an_edited_one(
    repository, tmp_path
):
    course = tmp_path / "course"
    course.mkdir()
    for name in ("00_welcome_and_setup.ipynb", "01_autograd_graphs.ipynb"):
        (course / name).write_bytes((NOTEBOOKS / name).read_bytes())
    lab = repository / "lab"
    lab_tool.make_lab(course, lab)
    edit(lab / "00_welcome_and_setup.ipynb", "\nmy note")
    learners = (lab / "00_welcome_and_setup.ipynb").read_bytes()
    for name in ("00_welcome_and_setup.ipynb", "01_autograd_graphs.ipynb"):
        edit(course / name, "\na newer course")   # git pull brought a new version of both

    outcome = lab_tool.make_lab(course, lab)

    assert outcome["kept"] == ["00_welcome_and_setup.ipynb"]
    assert outcome["updated"] == ["01_autograd_graphs.ipynb"]
    assert (lab / "00_welcome_and_setup.ipynb").read_bytes() == learners
    updated = nbformat.read(lab / "01_autograd_graphs.ipynb", as_version=4)
    assert updated.cells[0].source.endswith("a newer course") and updated.cells[1].outputs == []
    os.remove(lab / "00_welcome_and_setup.ipynb")   # what the printed note tells the learner
    assert lab_tool.make_lab(course, lab)["made"] == ["00_welcome_and_setup.ipynb"]


def test_the_copy_is_ignored_by_git_and_make_lab_opens_it():
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", "lab/00_welcome_and_setup.ipynb"], cwd=ROOT
    )
    assert ignored.returncode == 0, "lab/ must be in .gitignore"
    commands = subprocess.run(
        ["make", "-n", "lab", "NOTEBOOK=notebooks/05_memory_vs_compute.ipynb"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout
    assert "tools/lab.py" in commands
    assert commands.index("tools/lab.py") < commands.index("jupyter lab")
    assert re.search(r"jupyter lab .* lab/05_memory_vs_compute\.ipynb$", commands, re.M), commands
