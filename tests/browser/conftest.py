"""A real JupyterLab in a real Chromium, for the tests that must see what a learner sees.

The `lab` fixture starts `jupyter lab` on 127.0.0.1 with a free port and a random token,
serving a temporary copy of the repository's notebooks; `page` is a Playwright page in
Debian's Chromium (Playwright cannot download its own browsers here). In CI a missing
browser is a failure; elsewhere the tests skip and say why.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]


def chromium_path() -> str | None:
    for candidate in (
        os.environ.get("CHROMIUM"),
        "/usr/bin/chromium",
        shutil.which("chromium"),
        shutil.which("chromium-browser"),
        shutil.which("google-chrome"),
    ):
        if candidate and Path(candidate).exists():
            return candidate
    return None


def require_browser() -> str:
    path = chromium_path()
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError as exc:  # pragma: no cover - the test extra installs it
        path, reason = None, f"playwright is not installed ({exc})"
    else:
        reason = "no Chromium found (apt-get install chromium, or set CHROMIUM=/path/to/chrome)"
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"browser tests must run in CI: {reason}")
        pytest.skip(reason)
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Lab:
    def __init__(self, url: str, token: str, root: Path) -> None:
        self.url, self.token, self.root = url, token, root

    def notebook_url(self, relative: str) -> str:
        return f"{self.url}/lab/tree/{relative}?token={self.token}&reset"


@pytest.fixture(scope="session")
def lab(tmp_path_factory) -> Iterator[Lab]:
    require_browser()
    root = tmp_path_factory.mktemp("lab")
    shutil.copytree(ROOT / "notebooks", root / "notebooks")
    # No "get notified about news?" pop-up over the page.
    settings = root / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
    port, token = free_port(), secrets.token_hex(16)
    log = open(root / "jupyterlab.log", "w")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            f"--port={port}",
            "--ip=127.0.0.1",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={root}",
            "--allow-root",
            f"--LabApp.user_settings_dir={root / 'settings'}",
            f"--LabApp.workspaces_dir={root / 'workspaces'}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=root,
        # One torch thread per kernel: on a 2-core machine a thread pool fighting Chromium
        # makes each training step an order of magnitude slower.
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
            break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.fail(
                    "JupyterLab did not start:\n" + (root / "jupyterlab.log").read_text()[-3000:]
                )
            time.sleep(0.5)
    try:
        yield Lab(url, token, root)
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


@pytest.fixture(scope="session")
def browser():
    path = require_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=path, args=CHROMIUM_FLAGS, headless=True
        )
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.console_errors = []
    page.on("console", lambda msg: msg.type == "error" and page.console_errors.append(msg.text))
    yield page
    context.close()


@pytest.fixture
def artifacts() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS
