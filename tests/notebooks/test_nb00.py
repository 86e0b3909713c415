"""Notebook 00, welcome and setup: the claims its prose and its pictures make, checked with ckptlib.

Each test names the notebook section whose words it checks; when one fails, the notebook's text
(or a title computed from the same numbers) needs another look, not only the code.
"""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
import torch
import torch.nn as nn

import ckptlib
import ckptlib.widgets
from ckptlib import MLPChain
from ckptlib import record_trace
from ckptlib.graph import autograd_graph, to_dot

from tests._notebooks import step_peak

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


# -- 00: the first measurement and its bar chart -------------------------------------------


def test_00_per_block_checkpoints_save_nothing_on_the_chain_and_sqrt_more_than_half():
    """00's chart title: per-block checkpoints save nothing here; sqrt(n) segments cut the peak."""
    model = MLPChain(depth=32, width=128)
    batch = model.example_batch(batch=512)
    none, block, sqrt = (step_peak(model, batch, mode) for mode in ("none", "block", "sqrt"))
    assert block == none  # a Linear -> ReLU block saves only what its checkpoint keeps anyway
    assert sqrt < 0.5 * none


def test_00_chart_title_is_computed_from_the_measured_peaks():
    """The title says what the bars show because it is built from them, not typed in."""
    source = next(
        cell.source
        for cell in nbformat.read(NOTEBOOKS / "00_welcome_and_setup.ipynb", 4).cells
        if "set_title" in cell.source
    )
    title = source[source.index("set_title"):]
    assert "Checkpointing cuts" not in title
    assert "{share['sqrt']" in title and "block_verdict" in title


def test_region_names_are_the_function_or_module_then_a_counter():
    """00 and 04 explain region names such as ``Sequential@38``."""
    with record_trace() as trace:
        ckptlib.checkpoint(
            nn.Sequential(nn.Linear(2, 2), nn.ReLU()), torch.randn(3, 2, requires_grad=True)
        )
    regions = {event.region for event in trace.events}
    assert len(regions) == 1 and re.fullmatch(r"Sequential@\d+", str(regions.pop()))


def test_00_graph_draws_the_checkpoints_own_input_as_freeing_nothing():
    """00's caption: both saves dropped; mat1 (the region's input) frees nothing; 32 B is ReLU's
    output."""
    small = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    out = ckptlib.checkpoint(small, torch.randn(2, 4)).sum()
    graph = autograd_graph(out, params=small)
    saved = {s.name: s for node in graph.ops for s in node.saved}
    assert (saved["mat1"].status, saved["mat1"].frees_memory) == ("dropped", False)
    assert (saved["result"].status, saved["result"].frees_memory) == ("dropped", True)
    assert (graph.saved_bytes, graph.dropped_bytes) == (0, 2 * 4 * 4)
    labels = "\n".join(to_dot(graph).body)
    assert "frees nothing" in labels and "0.weight" in labels and "0.bias" in labels


def test_00_course_map_lists_every_notebook_and_the_widget_each_uses():
    cell = next(c.source for c in nbformat.read(NOTEBOOKS / "00_welcome_and_setup.ipynb", 4).cells
                if c.source.startswith("## How to use this course"))
    rows = {
        line.split("|")[1].strip(): line
        for line in cell.splitlines()
        if re.match(r"\| \d\d \|", line)
    }
    assert sorted(rows) == sorted(path.name[:2] for path in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    for path in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"):
        assert f"({path.name})" in rows[path.name[:2]]
    assert "optional" in rows["08"]
    uses = {
        "00": "MemoryDashboard",
        "02": "BackwardStepper",
        "03": "BackwardStepper",
        "05": "ScheduleExplorer",
        "06": "MemoryDashboard",
        "07": "PolicyExplorer",
    }
    for number, widget in uses.items():
        assert f"`{widget}`" in rows[number] and hasattr(ckptlib.widgets, widget)


def test_00_prose_says_what_the_sqrt_line_measures():
    """00: sqrt(n) segments cut the peak to less than half of plain's (measured, not typed in)."""
    cells = {
        cell.get("id"): cell.source
        for cell in nbformat.read(NOTEBOOKS / "00_welcome_and_setup.ipynb", 4).cells
    }
    assert "to less than half of plain's, as the\n`sqrt` line above" in cells["00-004"]
    assert "well under half" not in cells["00-004"]
    model = MLPChain(depth=32, width=128)
    batch = model.example_batch(batch=512)
    assert step_peak(model, batch, "sqrt") < 0.5 * step_peak(model, batch, "none")
