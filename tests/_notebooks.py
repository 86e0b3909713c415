"""Reading a notebook's own cells in tests: one cell by its id or nbgrader grade id, and running it;
and the peak of a demo model's training step, as the notebooks measure it.

The self-check tests run the notebooks' own cells (never copies), so a change to a self-check in
a notebook is what the tests check.
"""
from __future__ import annotations

import contextlib
import io
import linecache
import os
from pathlib import Path

import nbformat
import torch.nn as nn

from ckptlib import measure


def cell_source(path: Path, *, cell_id: str | None = None, grade_id: str | None = None) -> str:
    """The source of the one cell of ``path`` with this cell id or nbgrader grade id."""
    cells = [
        cell
        for cell in nbformat.read(path, as_version=4).cells
        if (cell_id is not None and cell.get("id") == cell_id)
        or (grade_id is not None and cell.metadata.get("nbgrader", {}).get("grade_id") == grade_id)
    ]
    assert len(cells) == 1, (
        f"{path.name}: expected one cell with id={cell_id!r} grade_id={grade_id!r}, "
        f"found {len(cells)}"
    )
    return cells[0].source


def run_cell(source: str, namespace: dict, name: str = "<notebook cell>") -> str:
    """Execute a cell's source in ``namespace``; return what it printed. The source is registered
    under ``name`` so that ``inspect.getsource`` finds functions the cell defines."""
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(source, name, "exec"), namespace)
    return printed.getvalue()


@contextlib.contextmanager
def in_folder(folder: Path):
    """Run the block with ``folder`` as the working directory, as a notebook in it runs."""
    here = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(here)


def step_peak(model: nn.Module, batch, mode) -> int:
    model.checkpointing = mode
    return measure(lambda: model.training_step(batch), device="cpu", backend="tensors").peak_bytes
