"""The prepared GPU run stops cleanly on a machine without CUDA, after checking all it can."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the dry run on a machine without CUDA"
)
def test_gpu_check_dry_run_stops_at_the_cuda_check(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    result = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    summary = (tmp_path / "summary.txt").read_text()
    assert result.returncode == 2, result.stdout + result.stderr
    for line in ("PASS  imports", "PASS  jupyter kernel starts", "PASS  collect tests",
                 "STOP  no CUDA device here"):
        assert line in summary, summary
    assert "cuda available False" in summary
    assert "FAIL" not in summary
    assert not list(tmp_path.glob("*.ipynb")), "nothing past the CUDA check may run"


def test_gpu_wheels_pins_every_package_from_constraints():
    script = (ROOT / "benchmarks" / "gpu_wheels.sh").read_text()
    names = script.split("packages=(", 1)[1].split(")", 1)[0].split()
    pins = {line.split("==")[0].lower().replace("_", "-")
            for line in (ROOT / "constraints.txt").read_text().splitlines() if "==" in line}
    assert names and all(name.lower().replace("_", "-") in pins for name in names)
