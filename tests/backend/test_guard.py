"""The front door (backend/guard.py): the credential is checked before the body is read, bodies are bounded,
and every answer carries the security headers. Against a real uvicorn process for the memory figures."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from backend.app import create_app
from plab.settings import Settings, SettingsError, get_settings

TOKEN = "s3cret-token-for-tests"
REPO = Path(__file__).resolve().parents[2]


def client(tmp_path, **over) -> TestClient:
    settings = Settings(home=tmp_path, database_url=f"sqlite:///{tmp_path / 'plab.sqlite'}",
                        broker_url="filesystem://", api_token=TOKEN, data_dir=tmp_path, api_url="http://test",
                        **over)
    return TestClient(create_app(settings, migrate=True))


EXPERIMENT = {"name": "e", "model": "tiny", "data": {"corpus": "tinyshakespeare"}, "training": {"steps": 40},
              "recipes": ["fp8_tensorwise"], "enqueue": False}


def test_writes_without_a_good_credential_are_401_whatever_the_body(tmp_path):
    api = client(tmp_path)
    bad_headers = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic " + TOKEN},
                   {"Authorization": "Bearer"}, {"Authorization": b"Bearer \xc3\xa9t\xc3\xa9"},
                   {"Authorization": b"Bearer " + TOKEN.encode() + b"\xff"}]
    for headers in bad_headers:
        for body in (b"{not json", b'{"name": 1}', b"\x00" * 100):
            r = api.post("/api/v1/experiments", content=body, headers={"Content-Type": "application/json", **headers})
            assert r.status_code == 401, (headers, body[:10], r.status_code, r.text)
            assert r.headers["www-authenticate"] == "Bearer"
    ok = api.post("/api/v1/experiments", json=EXPERIMENT, headers={"Authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 201, ok.text
    assert api.get("/api/v1/experiments").status_code == 200  # reads stay open by default


def test_auth_all_closes_reads_but_not_health(tmp_path):
    api = client(tmp_path, auth_mode="all")
    assert api.get("/api/v1/experiments").status_code == 401
    assert api.get("/api/v1/experiments", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    assert api.get("/api/v1/health").status_code == 200


def test_bodies_over_the_limit_are_413_declared_or_chunked(tmp_path):
    api = client(tmp_path, max_body_bytes=4096)
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    big = b'{"name": "' + b"x" * 5000 + b'"}'
    r = api.post("/api/v1/experiments", content=big, headers=auth)
    assert r.status_code == 413 and "4096" in r.json()["detail"]

    def chunks():
        for i in range(0, len(big), 1000):
            yield big[i:i + 1000]
    r = api.post("/api/v1/experiments", content=chunks(), headers=auth)
    assert r.status_code == 413
    r = api.post("/api/v1/experiments", json=EXPERIMENT, headers=auth)
    assert r.status_code == 201


def test_every_answer_carries_the_security_headers(tmp_path):
    api = client(tmp_path)
    for path in ("/", "/api/v1/experiments", "/api/v1/experiments/999"):
        r = api.get(path)
        assert "script-src 'self'" in r.headers["content-security-policy"], path
        assert "'unsafe-inline'" not in r.headers["content-security-policy"].split("script-src")[1].split(";")[0]
        assert r.headers["x-frame-options"] == "DENY" and r.headers["x-content-type-options"] == "nosniff"
    r = api.post("/api/v1/experiments", json=EXPERIMENT)
    assert r.status_code == 401 and r.headers["x-frame-options"] == "DENY"


def test_settings_refuse_bad_auth_mode_and_body_limit(monkeypatch):
    monkeypatch.setenv("PLAB_AUTH", "sometimes")
    with pytest.raises(SettingsError, match="PLAB_AUTH must be 'writes'"):
        get_settings()
    monkeypatch.setenv("PLAB_AUTH", "all")
    monkeypatch.setenv("PLAB_MAX_BODY_BYTES", "12kb")
    with pytest.raises(SettingsError, match="PLAB_MAX_BODY_BYTES must be a whole number"):
        get_settings()


@pytest.mark.parametrize("variable, value, message", [
    ("PLAB_MAX_ATTEMPTS", "2.5", "PLAB_MAX_ATTEMPTS must be a whole number >= 1, got '2.5'"),
    ("PLAB_MAX_ATTEMPTS", "0", "PLAB_MAX_ATTEMPTS must be a whole number >= 1, got '0'"),
    ("PLAB_DATABASE_URL", "mysql://root@127.0.0.1/test", "PLAB_DATABASE_URL uses 'mysql', which the lab does not "
     "run on; give sqlite:///PATH (embedded) or postgresql+psycopg://USER:PASSWORD@HOST:5432/DB (served)"),
    ("PLAB_DATABASE_URL", "postgresql+psycopg2://u@h/d", "PLAB_DATABASE_URL uses 'postgresql+psycopg2'"),
    ("PLAB_DATABASE_URL", "localhost:5432", "PLAB_DATABASE_URL is not a database URL: 'localhost:5432'"),
    ("PLAB_BROKER_URL", "amqq://x", "PLAB_BROKER_URL must be a Celery broker URL such as redis://HOST:6379/0"),
    ("PLAB_BROKER_URL", "127.0.0.1:6379", "got '127.0.0.1:6379'"),
    ("PLAB_BROKER_URL", "redsi://:s3cret@host:6379/0", "got 'redsi://:***@host:6379/0'"),  # no password echoed
    ("PLAB_DATABASE_URL", "mysql://root:s3cret@127.0.0.1/test", "PLAB_DATABASE_URL uses 'mysql'"),
])
def test_settings_refuse_what_the_lab_cannot_run_on(monkeypatch, variable, value, message, capsys):
    from plab.cli import main

    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsError) as info:
        get_settings()
    assert message in str(info.value) and "s3cret" not in str(info.value)
    assert main(["db", "upgrade"]) == 2  # the command line says it in one line
    assert capsys.readouterr().err == f"plab: error: {info.value}\n"


def test_a_postgresql_url_without_a_driver_means_psycopg_3(monkeypatch, postgres_url):
    import sqlalchemy

    bare = postgres_url.replace("postgresql+psycopg://", "postgresql://")
    for given in (bare, bare.replace("postgresql://", "postgres://")):
        monkeypatch.setenv("PLAB_DATABASE_URL", given)
        assert get_settings().database_url == postgres_url
        engine = sqlalchemy.create_engine(get_settings().database_url)  # the driver installed
        with engine.connect() as c:
            assert c.execute(sqlalchemy.text("select 1")).scalar() == 1
        engine.dispose()
    monkeypatch.setenv("PLAB_DATABASE_URL", postgres_url)
    assert get_settings().database_url == postgres_url  # as given


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post_raw(port: int, size: int, token: str | None) -> tuple[bytes, float]:
    """POST `size` bytes of garbage JSON; returns the status line and the seconds until the answer came."""
    head = (f"POST /api/v1/experiments HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {size}\r\n" + (f"Authorization: Bearer {token}\r\n" if token else "") + "\r\n")
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head.encode())
        chunk, sent = b"{" + b"a" * 65535, 0
        sock.setblocking(False)
        answer = b""
        while sent < size and b"\r\n" not in answer:
            try:
                sent += sock.send(chunk[:min(len(chunk), size - sent)])
            except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                pass
            try:
                answer += sock.recv(4096)
            except BlockingIOError:
                time.sleep(0.001)
        sock.setblocking(True)
        while b"\r\n" not in answer:
            answer += sock.recv(4096)
    return answer.split(b"\r\n", 1)[0], time.monotonic() - start


def test_a_huge_anonymous_body_is_refused_before_it_is_read_and_memory_stays_flat(tmp_path):
    port = _free_port()
    env = dict(os.environ, PLAB_HOME=str(tmp_path), PLAB_API_TOKEN=TOKEN, PYTHONPATH=str(REPO),
               PLAB_DATABASE_URL=f"sqlite:///{tmp_path / 'plab.sqlite'}")
    env.pop("PLAB_AUTH", None)
    server = subprocess.Popen([sys.executable, "-m", "uvicorn", "backend.app:create_app", "--factory",
                               "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
                              cwd=REPO, env=env)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/api/v1/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and server.poll() is None, "the API did not start"
            time.sleep(0.2)
        before = _rss_kib(server.pid)
        for _ in range(4):
            status, seconds = _post_raw(port, 50 * 1024 * 1024, None)
            assert b" 401 " in status + b" ", status
            assert seconds < 1.0, seconds
        status, _ = _post_raw(port, 50 * 1024 * 1024, TOKEN)  # with the token: over the 16 MiB limit
        assert b" 413 " in status + b" ", status
        grown = _rss_kib(server.pid) - before
        assert grown < 20 * 1024, f"RSS grew by {grown} KiB"
    finally:
        server.terminate()
        server.wait(timeout=10)
