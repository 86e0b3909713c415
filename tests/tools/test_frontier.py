"""benchmarks/frontier.py: the committed run's table is the one its JSON gives, every ckptlib plan
in it measured under its budget, and the methods it times run on a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._models import hf_transformers
from tests._benchmarks import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "frontier.json"


@pytest.fixture(scope="module")
def frontier():
    return load_benchmark("frontier")


def test_the_readmes_table_is_the_committed_runs_and_every_plan_is_under_its_budget(frontier):
    result = json.loads(RESULTS.read_text())
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    assert f"{frontier.BEGIN}\n{frontier.markdown(result)}\n{frontier.END}" in readme
    assert len(result["models"]) == 2
    for model in result["models"].values():
        rows = frontier.verdicts(model)
        assert len(rows) == len(frontier.BUDGET_SHARES) >= 5
        assert all(row["under"] for row in rows)
        assert {"HF switch", "torch every 1", "torch every 2", "torch every 3",
                "torch SAC matmuls"} <= set(model["methods"])


def test_every_method_runs_a_step_on_a_tiny_model_and_the_figure_is_drawn(frontier, tmp_path):
    hf_transformers()   # skips without the hf extra
    make = frontier.models(small=True)["GPT-2 3x64"]
    inputs = frontier.batch(small=True)
    chosen = frontier.methods(make, inputs, small=True)
    peaks = {name: frontier.peak_of(model, on, inputs) for name, (model, on) in chosen.items()}
    assert peaks["HF switch"] == peaks["torch every 1"] < peaks["torch every 2"] < peaks["plain"]
    frontier.figure(json.loads(RESULTS.read_text()), tmp_path)
    assert (tmp_path / "frontier.png").stat().st_size > 0
