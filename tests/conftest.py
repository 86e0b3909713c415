"""Shared by the classroom tests (tests/tools/test_classroom.py, tests/browser/test_slides.py)."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import classroom  # noqa: E402  (tools/ is not a package)


@pytest.fixture(scope="session")
def build_classroom(tmp_path_factory) -> Callable[[str, Callable[[Path], object]], Path]:
    """``build_classroom("slides", classroom.build_slides)``: build into a temporary folder.

    Without npm's assets the build cannot happen: a failure in CI, where it must run,
    and a skip with the reason elsewhere.
    """
    def build(what: str, builder: Callable[[Path], object]) -> Path:
        out = tmp_path_factory.mktemp(what)
        try:
            builder(out)
        except classroom.AssetsUnavailable as error:
            if os.environ.get("CI"):
                pytest.fail(f"the {what} must build in CI: {error}")
            pytest.skip(str(error))
        return out

    return build
