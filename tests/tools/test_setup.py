"""The set-up files agree with each other: pyproject, constraints, environment.yml, Makefile, CI."""
from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
# conda-forge names for packages whose PyPI name differs
CONDA_NAMES = {"torch": "pytorch", "graphviz": "python-graphviz"}


def requirement_name(spec: str) -> str:
    return re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0].strip().lower()


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_environment_yml_is_valid_and_names_every_pyproject_package():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda = {requirement_name(d) for d in env["dependencies"] if isinstance(d, str)}
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    pip = {requirement_name(d) for d in pip_section if not d.startswith("-e")}
    assert any(d.startswith("-e .") for d in pip_section), (
        "environment.yml must install ckptlib itself"
    )
    project = pyproject()["project"]
    wanted = [
        *project["dependencies"],
        *(d for extra in project["optional-dependencies"].values() for d in extra),
    ]
    missing = [
        name for name in map(requirement_name, wanted)
        if name not in pip and CONDA_NAMES.get(name, name) not in conda
    ]
    assert not missing, f"in pyproject.toml but not in environment.yml: {missing}"


def test_pyproject_is_permissive_and_constraints_pin_the_local_torch():
    deps = pyproject()["project"]["dependencies"]
    assert "torch>=2.4" in deps
    pins = dict(
        line.split("==", 1) for line in (ROOT / "constraints.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    assert pins["torch"] == "2.13.0"
    project = pyproject()["project"]
    for spec in [
        *project["dependencies"],
        *(d for e in project["optional-dependencies"].values() for d in e),
    ]:
        name = requirement_name(spec)
        assert any(k.lower().replace("_", "-") == name for k in pins), (
            f"{name} is not pinned in constraints.txt"
        )


def test_ci_installs_system_packages_then_runs_the_readme_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert ci.index("apt-get update") < ci.index("apt-get install -y")
    assert "graphviz" in ci and "chromium" in ci
    assert ci.strip().splitlines()[-1].strip() == "make test"
    assert (
        "make test" in (ROOT / "README.md").read_text()
        and "make lab" in (ROOT / "README.md").read_text()
    )


def test_make_refuses_an_old_python_with_a_clear_message(tmp_path):
    fake = tmp_path / "python3"
    fake.write_text(
        "#!/bin/sh\nexec " + sys.executable + " -c 'import sys; sys.version_info = (3, 8, 0); "
        'exec(sys.argv[2])\' -c "$2"\n'
    )
    fake.chmod(0o755)
    result = subprocess.run(
        ["make", "-s", "check-python", f"PYTHON={fake}"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode != 0
    assert "3.10 or newer" in result.stdout + result.stderr


def test_every_notebook_has_a_kernelspec():
    import json

    notebooks = sorted((ROOT / "notebooks").rglob("*.ipynb"))
    for path in notebooks:
        meta = json.loads(path.read_text())["metadata"]
        assert meta.get("kernelspec", {}).get("name") == "python3", (
            f"{path.name} has no python3 kernelspec"
        )
