"""benchmarks/region_cost.py: its floor is a real checkpoint, it measures every variant, the parts
it switches off come back on, it reports the reading path, and its Markdown lands between the
markers."""

from __future__ import annotations


import pytest
import torch

import ckptlib
from tests._grads import assert_bitwise_equal
from tests._benchmarks import load_benchmark



@pytest.fixture(scope="module")
def region_cost():
    return load_benchmark("region_cost")


def test_the_floor_gives_plain_gradients_and_keeps_nothing(region_cost):
    block = ckptlib.MLPChain(depth=1, width=16).blocks[0]
    x = torch.randn(4, 16, requires_grad=True)
    expected = torch.autograd.grad(block(x).square().sum(), [x, *block.parameters()])
    y = region_cost.floor_checkpoint(block, x)
    got = torch.autograd.grad(y.square().sum(), [x, *block.parameters()])
    assert_bitwise_equal(got, expected)
    assert (
        ckptlib.measure(lambda: region_cost.floor_checkpoint(block, x)).peak_bytes
        <= ckptlib.measure(lambda: block(x)).peak_bytes
    )


def test_a_tiny_run_measures_every_variant_and_the_checks_come_back(region_cost, monkeypatch):
    monkeypatch.setattr(region_cost, "workloads", lambda: {"tiny": (torch.sin, torch.randn(4), 2)})
    result = region_cost.measure(rounds=2)
    numbers = result["workloads"]["tiny"]
    assert set(numbers["median_us_per_step"]) == set(region_cost.VARIANTS)
    assert set(numbers["breakdown_us"]) == set(region_cost.PARTS)
    # the parts add up to ckptlib's cost
    assert sum(numbers["breakdown_us"].values()) == pytest.approx(
        numbers["cost_us"]["ckptlib"], abs=0.5
    )
    lin = torch.nn.Linear(3, 3)
    loss = ckptlib.checkpoint(lin, torch.randn(2, 3, requires_grad=True)).sum()
    with torch.no_grad():
        lin.weight.add_(1)
    with pytest.raises(ckptlib.CheckpointError, match="modified in place"):
        loss.backward()
    text = region_cost.markdown(result)
    assert "| tiny |" in text and "floor (hooks, one rerun)" in text
    path = result["reading_path"]
    assert "core/checkpoint.py" in path["files"] and path["distinct functions"] > 0


def test_markdown_goes_between_the_markers_or_says_what_to_add(region_cost, tmp_path, monkeypatch):
    monkeypatch.setattr(region_cost, "workloads", lambda: {"tiny": (torch.sin, torch.randn(4), 1)})
    result = region_cost.measure(rounds=1)
    readme = tmp_path / "README.md"
    readme.write_text(
        f"before\n{region_cost.MARKDOWN_BEGIN}\nstale table text\n"
        f"{region_cost.MARKDOWN_END}\nafter\n"
    )
    region_cost.write_markdown(readme, result)
    text = readme.read_text()
    assert text.startswith("before\n") and text.endswith("after\n")
    assert "stale table text" not in text
    readme.write_text("no markers here\n")
    with pytest.raises(SystemExit, match="region-cost markers"):
        region_cost.write_markdown(readme, result)
