"""Fixtures for the dashboard's browser tests: the real server as a subprocess, headless Debian Chromium.

The server is `python -m uvicorn backend.app:create_app --factory` on a fresh SQLite database in a
temporary PLAB_HOME, exactly as a user would start it, with PLAB_API_TOKEN set (writes need the token, as in a
shared deployment); the browser is the system Chromium driven by Playwright (no `playwright install`: CI
installs the `chromium` Debian package, or set PLAB_CHROMIUM). Screenshots of every test go to
test-artifacts/browser/.
"""
from __future__ import annotations

import contextlib
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts" / "browser"
CHROMIUM = os.environ.get("PLAB_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, base_url: str, token: str | None):
        self.base_url = base_url
        self.token = token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=base_url, headers=headers, timeout=120)

    def create_experiment(self, recipes: list, *, name: str = "browser-test", steps: int = 50, **extra) -> dict:
        body = {"name": name, "description": "created by tests/browser", "model": "tiny",
                "data": {"corpus": "tinyshakespeare", "vocab_size": 512, "seq_len": 32},
                "training": {"steps": steps, "batch_size": 4, "lr": 3e-3}, "seed": 0,
                "recipes": recipes, "enqueue": False, **extra}
        r = self.http.post("/api/v1/experiments", json=body)
        assert r.status_code == 201, r.text
        return r.json()

    def log_loss_curve(self, run_id: int, *, steps: int, start: float, offset_pct: float = 0.0,
                       tokens_per_step: int = 128, val_every: int = 0, tokens_per_s: float | None = None) -> None:
        """A loss curve decaying with tokens seen, `offset_pct` percent above the curve with offset 0 (the
        same function of tokens whatever `tokens_per_step` is, so runs on different token grids compare)."""
        points = []
        for step in range(steps):
            tokens = (step + 1) * tokens_per_step
            loss = (start * math.exp(-tokens / 3000) + 1.5) * (1 + offset_pct / 100)
            wall = 1_800_000_000.0 + step * 0.05
            points.append({"key": "train/loss", "step": step, "value": loss, "tokens": tokens, "wall_time": wall})
            if tokens_per_s is not None:
                points.append({"key": "perf/tokens_per_s", "step": step, "value": tokens_per_s,
                               "tokens": tokens, "wall_time": wall})
            if val_every and step % val_every == 0:
                points.append({"key": "val/loss", "step": step, "value": loss * 1.02, "tokens": tokens,
                               "wall_time": wall})
        r = self.http.post(f"/api/v1/runs/{run_id}/metrics", json={"points": points})
        assert r.status_code in (200, 201), r.text

    def set_status(self, run_id: int, status: str, **fields) -> dict:
        r = self.http.post(f"/api/v1/runs/{run_id}/status", json={"status": status, **fields})
        assert r.status_code == 200, r.text
        # The API may answer before its transaction commits (FastAPI ends `yield` dependencies after the
        # response by default), so wait until a read sees the change before the next write depends on it.
        deadline = time.monotonic() + 10
        while self.http.get(f"/api/v1/runs/{run_id}").json()["status"] != status:
            assert time.monotonic() < deadline, f"run {run_id} never showed status {status!r}"
            time.sleep(0.02)
        return r.json()


@contextlib.contextmanager
def running_server(home: Path, token: str | None = None):
    """`uvicorn backend.app:create_app --factory` on a free port with its own SQLite database under `home`."""
    port = _free_port()
    env = {**os.environ, "PLAB_HOME": str(home), "PLAB_DATABASE_URL": f"sqlite:///{home / 'db.sqlite'}",
           "PLAB_RECONCILE_S": "0",  # runs here are driven by the tests, not by workers with heartbeats
           "PLAB_ALLOWED_PATHS": str(home / "models"),  # stand-in checkpoints a test names (the API checks they exist)
           "PYTHONUNBUFFERED": "1"}
    for name in ("PLAB_API_TOKEN", "PLAB_BROKER_URL"):
        env.pop(name, None)
    if token:
        env["PLAB_API_TOKEN"] = token
    log_path = home / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "backend.app:create_app", "--factory", "--host", "127.0.0.1",
             "--port", str(port), "--log-level", "warning"],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        base_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited with {proc.returncode}:\n{log_path.read_text()}")
                try:
                    if httpx.get(f"{base_url}/api/v1/experiments", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server did not answer within 60 s:\n{log_path.read_text()}")
                time.sleep(0.2)
            srv = Server(base_url, token=token)
            srv.home = home  # PLAB_HOME of the server: runs' folders (checkpoints) live under home/runs/<id>
            # The first experiment a server validates imports the training stack (torch: 10+ s on a busy
            # 2-core machine); pay that here so no page test times out waiting for it.
            srv.create_experiment(["bf16"], name="warm-up")
            yield srv
            srv.http.close()
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


API_TOKEN = "s3cret-token"


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """One server for all browser tests, with writes protected by a token as in a shared deployment: the
    pages are signed in with it (see `page`), as after a user pasted it once."""
    with running_server(tmp_path_factory.mktemp("plab-home"), token=API_TOKEN) as srv:
        yield srv


@pytest.fixture(scope="session")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} not found: install Debian's Chromium with `apt-get install -y chromium` "
                    "(or point PLAB_CHROMIUM at a Chromium binary)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


class ConsoleLog:
    """Console errors and uncaught exceptions of one page: a dashboard page must produce none."""

    def __init__(self, page):
        self.errors: list[str] = []
        page.on("console", lambda m: self.errors.append(f"console.{m.type}: {m.text}")
                if m.type == "error" else None)
        page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))


def new_page(context):
    pg = context.new_page()
    pg.set_default_timeout(15_000)
    pg.console_log = ConsoleLog(pg)
    return pg


@pytest.fixture
def page(browser, server, request):
    """A dashboard tab in a browser already signed in (the session cookie the sign-in box obtains)."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000}, accept_downloads=True)
    signed_in = context.request.post(f"{server.base_url}/api/v1/session",
                                     headers={"Authorization": f"Bearer {API_TOKEN}"})
    assert signed_in.ok, signed_in.text()
    pg = new_page(context)
    yield pg
    _screenshot(pg, request)
    context.close()


@pytest.fixture
def tokenless_page(browser, request):
    """A dashboard tab in a browser that has never been given the API token."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = new_page(context)
    yield pg
    _screenshot(pg, request)
    context.close()


@pytest.fixture
def api_token() -> str:
    return API_TOKEN


def _screenshot(pg, request) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    try:
        pg.screenshot(path=str(ARTIFACTS / f"{request.node.name}.png"), full_page=True)
    except Exception:  # noqa: BLE001 - a failed screenshot must not hide the test's own result
        pass


# The faint raw curve drawn behind a smoothed one (plot.js smoothedTraces) is not a series of its own.
SERIES = "(gd.data || []).filter(t => !(t.meta && t.meta.raw))"


class Charts:
    """Reads Plotly charts of a page: Plotly keeps each figure's traces on its div as `.data`; these helpers
    count and read the series traces (raw curves behind smoothed ones left out)."""

    def __init__(self, page):
        self.page = page

    def trace_count(self, chart_id: str) -> int:
        return self.page.evaluate(f"id => {{ const gd = document.getElementById(id); return {SERIES}.length; }}",
                                  chart_id)

    def traces(self, chart_id: str, fields: str = "t => ({name: t.name, x: t.x, y: t.y})") -> list:
        return self.page.evaluate(f"id => {{ const gd = document.getElementById(id); return {SERIES}.map({fields}); }}",
                                  chart_id)

    def wait_for_traces(self, chart_id: str, count: int, timeout: float = 15_000) -> None:
        """Wait until the chart is drawn (its SVG exists) with exactly `count` series traces."""
        self.page.wait_for_function(
            f"([id, n]) => {{ const gd = document.getElementById(id); return gd && gd.data && {SERIES}.length === n"
            " && gd.querySelector('.main-svg') !== null; }",
            arg=[chart_id, count], timeout=timeout)


@pytest.fixture
def charts(page) -> Charts:
    return Charts(page)
