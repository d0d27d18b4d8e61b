"""A real API for the worker-side code: the app of `backend.app.create_app` on a fresh SQLite database, served by
uvicorn in a thread of the test process, with writes behind a token (as a served deployment has)."""
from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest
import uvicorn

from plab.settings import Settings
from workers.client import PlabClient

TOKEN = "workers-test-token"
TINY = {"model": "tiny", "data": {"corpus": "tinyshakespeare", "vocab_size": 512, "seq_len": 64},
        "training": {"steps": 50, "batch_size": 4}, "seed": 0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveApi:
    """`start()` may come after a client already points at `url`: that is how a test shows a retry."""

    def __init__(self, home: Path):
        self.home = home
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> LiveApi:
        from backend.app import create_app

        settings = Settings(home=self.home, database_url=f"sqlite:///{self.home / 'plab.sqlite'}",
                            broker_url="filesystem://", api_token=TOKEN, data_dir=self.home, api_url=self.url)
        app = create_app(settings, migrate=True)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, name="live-api", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the API did not start"
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
            self.thread.join(timeout=10)

    def client(self, **kw) -> PlabClient:
        return PlabClient(self.url, TOKEN, **kw)


@pytest.fixture
def api_env(tmp_path, monkeypatch):
    """The environment a worker runs in, pointed at this test's API (not started yet) and home folder."""
    home = tmp_path / "home"
    home.mkdir()
    live = LiveApi(home)
    monkeypatch.setenv("PLAB_API_URL", live.url)
    monkeypatch.setenv("PLAB_API_TOKEN", TOKEN)
    monkeypatch.setenv("PLAB_HOME", str(home))
    monkeypatch.delenv("PLAB_BROKER_URL", raising=False)
    monkeypatch.delenv("PLAB_DATABASE_URL", raising=False)
    yield live
    live.stop()


@pytest.fixture
def live_api(api_env) -> LiveApi:
    return api_env.start()


@pytest.fixture
def client(live_api):
    with live_api.client() as c:
        yield c


def new_run(client: PlabClient, **training) -> dict:
    """A queued run that no worker will pick up (`enqueue: false`)."""
    exp = client.create_experiment({**TINY, "name": "worker test", "training": {**TINY["training"], **training},
                                    "recipes": ["bf16"], "enqueue": False})
    return exp["runs"][0]
