"""benchmarks/guard_cost.py: it measures every variant, and its Markdown lands between the
markers."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "guard_cost.py"


@pytest.fixture(scope="module")
def guard_cost():
    spec = importlib.util.spec_from_file_location("guard_cost", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_tiny_run_measures_every_variant_and_the_guards_switch_back_on(guard_cost):
    import ckptlib
    import torch

    result = guard_cost.measure(rounds=2, steps=1)
    for numbers in result["blocks"].values():
        assert set(numbers["median_us_per_step"]) == {"plain", "torch.utils.checkpoint", "ckptlib",
                                                      "ckptlib, guards off"}
        assert all(value > 0 for value in numbers["median_us_per_step"].values())
    # "guards off" is switched off inside the script only: afterwards a changed weight is refused
    # again.
    lin = torch.nn.Linear(3, 3)
    loss = ckptlib.checkpoint(lin, torch.randn(2, 3, requires_grad=True)).sum()
    with torch.no_grad():
        lin.weight.add_(1)
    with pytest.raises(ckptlib.CheckpointError, match="modified in place"):
        loss.backward()


def test_markdown_replaces_only_the_text_between_the_markers(guard_cost, tmp_path):
    committed = json.loads((SCRIPT.parent / "results" / "guard_cost.json").read_text())
    readme = tmp_path / "README.md"
    readme.write_text(
        f"before\n{guard_cost.MARKDOWN_BEGIN}\nold table\n{guard_cost.MARKDOWN_END}\nafter\n"
    )
    subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--from-json",
            str(SCRIPT.parent / "results" / "guard_cost.json"),
            "--markdown",
            str(readme),
        ],
        check=True,
        capture_output=True,
    )
    text = readme.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old table" not in text
    for block_name, numbers in committed["blocks"].items():
        assert f"| {block_name} |" in text
        assert f"{numbers['ratios']['ckptlib / torch.utils.checkpoint']:.3f}" in text


def test_markdown_without_markers_says_what_to_add(guard_cost, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("no markers here\n")
    with pytest.raises(SystemExit, match="guard-cost markers"):
        guard_cost.write_markdown(readme, {"blocks": {}})
