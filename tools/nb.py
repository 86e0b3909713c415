"""Author and run the course notebooks.

    python tools/nb.py build SRC.py OUT.ipynb   # percent-format script -> notebook (no outputs)
    python tools/nb.py export NB.ipynb SRC.py   # notebook -> percent-format script, for editing
    python tools/nb.py run NB.ipynb [...]       # execute in a fresh kernel, save outputs in place
    python tools/nb.py meta NB.ipynb [...]      # recompute slide / nbgrader metadata in place

Percent format: a line ``# %%`` starts a code cell, ``# %% [markdown]`` a markdown cell (its
lines start with ``# ``). Options after the marker set cell metadata:
``slide=slide|subslide|fragment|skip|notes`` (RISE / reveal.js slide type) and
``tags=a,b`` (e.g. ``tags=exercise`` or ``tags=self-check``). A cell without ``slide=``
continues the current slide (``slide_type: "-"``).

Grading (nbgrader cell metadata, derived from the tags): an exercise cell is a manually graded
answer worth one point; its self-check is a locked, read-only cell, because a self-check prints
"not attempted yet" instead of failing and so cannot be an autograder test. Grade ids are
``exercise-K`` / ``exercise-K-check`` (K counts exercises in the notebook), the same in a
notebook and its solutions.
"""
from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ckptlib)", "language": "python"}
MARKER = re.compile(r"^# %%(?:\s+\[(?P<kind>markdown)\])?(?P<options>.*)$")


def _metadata(options: str) -> dict:
    meta: dict = {"slideshow": {"slide_type": "-"}}
    for key, value in re.findall(r"(\w+)=([\w,-]+)", options):
        if key == "slide":
            meta["slideshow"] = {"slide_type": value}
        elif key == "tags":
            meta["tags"] = value.split(",")
    return meta


def normalise(nb: nbformat.NotebookNode) -> None:
    """Slide type on every cell; nbgrader metadata from the exercise / self-check tags."""
    exercise = 0
    for cell in nb.cells:
        cell.metadata.setdefault("slideshow", {"slide_type": "-"})
        tags = cell.metadata.get("tags", [])
        cell.metadata.pop("nbgrader", None)
        if "exercise" in tags:
            exercise += 1
            cell.metadata["nbgrader"] = {"grade": True, "solution": True, "locked": False,
                                         "points": 1, "task": False, "schema_version": 3,
                                         "grade_id": f"exercise-{exercise}"}
        elif "self-check" in tags:
            cell.metadata["nbgrader"] = {"grade": False, "solution": False, "locked": True,
                                         "task": False, "schema_version": 3,
                                         "grade_id": f"exercise-{exercise}-check"}
    nb.metadata["kernelspec"] = KERNELSPEC


def build(src: Path, out: Path) -> None:
    cells, kind, options, lines = [], None, "", []

    def flush() -> None:
        if kind is None:
            return
        text = "\n".join(lines).strip("\n")
        cell_id = f"{out.stem[:2]}-{len(cells):03d}"
        if kind == "markdown":
            text = "\n".join(line[2:] if line.startswith("# ") else line.lstrip("#")
                             for line in text.splitlines())
            cell = nbformat.v4.new_markdown_cell(text, id=cell_id)
        else:
            cell = nbformat.v4.new_code_cell(text, id=cell_id)
        cell.metadata.update(_metadata(options))
        cells.append(cell)

    for line in src.read_text().splitlines():
        match = MARKER.match(line)
        if match:
            flush()
            kind, options, lines = match["kind"] or "code", match["options"], []
        else:
            lines.append(line)
    flush()
    nb = nbformat.v4.new_notebook(cells=cells)
    normalise(nb)
    nb.metadata["language_info"] = {"name": "python"}
    nbformat.write(nb, out)


def export(notebook: Path, src: Path) -> None:
    nb = nbformat.read(notebook, as_version=4)
    chunks = []
    for cell in nb.cells:
        opts = []
        slide = cell.metadata.get("slideshow", {}).get("slide_type")
        if slide:
            opts.append(f"slide={slide}")
        if cell.metadata.get("tags"):
            opts.append("tags=" + ",".join(cell.metadata["tags"]))
        head = ("# %%" + (" [markdown]" if cell.cell_type == "markdown" else "")
                + ("".join(" " + o for o in opts)))
        body = (cell.source if cell.cell_type == "code"
                else "\n".join("# " + line if line else "#" for line in cell.source.splitlines()))
        chunks.append(head + "\n" + body)
    src.write_text("\n\n".join(chunks) + "\n")


def run(notebook: Path, timeout_s: int = 120) -> float:
    nb = nbformat.read(notebook, as_version=4)
    start = time.perf_counter()
    NotebookClient(nb, timeout=timeout_s, kernel_name="python3",
                   resources={"metadata": {"path": str(notebook.parent)}}).execute()
    elapsed = time.perf_counter() - start
    nbformat.write(nb, notebook)
    return elapsed


if __name__ == "__main__":
    command, *paths = sys.argv[1:]
    if command == "build":
        build(Path(paths[0]), Path(paths[1]))
    elif command == "export":
        export(Path(paths[0]), Path(paths[1]))
    elif command == "meta":
        for path in paths:
            nb = nbformat.read(path, as_version=4)
            normalise(nb)
            nbformat.write(nb, path)
    elif command == "run":
        for path in paths:
            print(f"{path}: {run(Path(path)):.1f} s")
    else:
        sys.exit(__doc__)
