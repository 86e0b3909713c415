"""The learner's working copy of the course: ``lab/``, made from ``notebooks/`` with every output
cleared, so that a prediction is made before the answer is on the screen.

    python tools/lab.py            # make or refresh lab/ (``make lab`` runs this, then JupyterLab)

The committed notebooks keep their outputs: nbval compares a fresh run with them, and the site and
the slides show them. A learner who opened those would read "Measured: 100" under the cell that
asks them to guess. ``lab/`` holds the same files with the outputs, execution counts and saved
widget state taken out; git ignores it, so whatever the learner types or runs there never shows
up as a change to the repository.

``lab/`` has the layout of ``notebooks/`` (solutions in ``lab/solutions/``, helper modules such as
``clinic_ddp.py`` beside the notebooks) and sits at the same depth in the repository, so every
path a notebook uses relative to its folder (``../benchmarks/``, ``clinic_ddp.py`` from here or
from ``solutions/``) means the same from the copy.

A learner's edits are never overwritten. ``lab/.made.json`` records, per file, a hash of what was
written there; a later run replaces a file only while it still has that hash (the learner has not
touched it) and the course's version has changed, for example after ``git pull``. A file the
learner changed is kept, with a line saying how to get the new version: delete it and run again.
"""
from __future__ import annotations

import copy
import hashlib
import json
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ".made.json"
SKIPPED_PARTS = {"__pycache__", ".ipynb_checkpoints"}


def cleared(notebook: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The notebook with no outputs, no execution counts and no saved widget state; cell ids,
    tags, slide and nbgrader metadata kept.

    >>> cell = nbformat.v4.new_code_cell("1 + 1", execution_count=3,
    ...                                  outputs=[nbformat.v4.new_output("stream", text="2")])
    >>> notebook = nbformat.v4.new_notebook(cells=[cell], metadata={"widgets": {"state": {}}})
    >>> blank = cleared(notebook)
    >>> blank.cells[0].outputs, blank.cells[0].execution_count, "widgets" in blank.metadata
    ([], None, False)
    >>> notebook.cells[0].execution_count      # the original is left as it was
    3
    """
    blank = copy.deepcopy(notebook)
    blank.metadata.pop("widgets", None)
    for cell in blank.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    return blank


def working_copy_bytes(source: Path) -> bytes:
    """What ``lab/`` holds for the course file ``source``: a notebook cleared, anything else as
    it is."""
    if source.suffix != ".ipynb":
        return source.read_bytes()
    notebook = nbformat.read(source, as_version=4)
    return (nbformat.writes(cleared(notebook)) + "\n").encode()


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def course_files(notebooks: Path) -> list[Path]:
    return sorted(
        path for path in notebooks.rglob("*")
        if path.is_file() and not SKIPPED_PARTS & set(path.relative_to(notebooks).parts)
    )


def make_lab(notebooks: Path, lab: Path) -> dict[str, list[str]]:
    """Make or refresh the working copy ``lab`` of ``notebooks``; return the relative paths
    ``made`` (new), ``updated`` (untouched by the learner, changed in the course), ``kept`` (the
    learner's edits, while the course's version changed) and ``unchanged``."""
    manifest_path = lab / MANIFEST
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    outcome: dict[str, list[str]] = {"made": [], "updated": [], "kept": [], "unchanged": []}
    for source in course_files(notebooks):
        name = source.relative_to(notebooks).as_posix()
        target = lab / name
        copy_bytes = working_copy_bytes(source)
        wanted = digest(copy_bytes)
        made_before = manifest.get(name)
        if not target.exists():
            kind = "made"
        else:
            present = digest(target.read_bytes())
            if present == wanted or made_before == wanted:
                kind = "unchanged"    # as made, or the learner's edits of the current version
            elif present == made_before:
                kind = "updated"      # untouched by the learner, changed in the course
            else:
                kind = "kept"         # both changed: the learner's edits win
        if kind in ("made", "updated"):
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(copy_bytes)
        if kind != "kept":
            manifest[name] = wanted
        outcome[kind].append(name)
    lab.mkdir(parents=True, exist_ok=True)
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return outcome


def main(argv: list[str]) -> int:
    lab = Path(argv[0]) if argv else ROOT / "lab"
    outcome = make_lab(ROOT / "notebooks", lab)
    shown = lab.relative_to(ROOT) if lab.is_relative_to(ROOT) else lab
    print(f"{shown}/: your working copy of notebooks/, outputs cleared (git ignores it): "
          f"{len(outcome['made'])} made, {len(outcome['updated'])} updated from the course, "
          f"{len(outcome['unchanged']) + len(outcome['kept'])} as you left them.")
    for name in outcome["kept"]:
        print(f"  {shown}/{name}: kept your edits; the course's version changed. For the new one, "
              f"delete {shown}/{name} and run make lab again.")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
