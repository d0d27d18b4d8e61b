"""Scoped tokens (read < write < admin, stored hashed, revocable; `plab token`) and the dashboard's session
cookie (HttpOnly, SameSite=Strict, CSRF on cookie writes)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import sqlalchemy as sa
from fastapi.testclient import TestClient

from backend.app import create_app
from plab.settings import Settings

ADMIN = "bootstrap-admin-token"
REPO = Path(__file__).resolve().parents[2]
EXPERIMENT = {"name": "e", "model": "tiny", "data": {"corpus": "tinyshakespeare"}, "training": {"steps": 40},
              "recipes": ["fp8_tensorwise"], "enqueue": False}


def _api(tmp_path, **over) -> TestClient:
    settings = Settings(home=tmp_path, database_url=f"sqlite:///{tmp_path / 'plab.sqlite'}",
                        broker_url="filesystem://", api_token=ADMIN, data_dir=tmp_path, api_url="http://test", **over)
    return TestClient(create_app(settings, migrate=True))


def _bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def _make(api, name, scope) -> dict:
    r = api.post("/api/v1/tokens", json={"name": name, "scope": scope}, headers=_bearer(ADMIN))
    assert r.status_code == 201, r.text
    return r.json()


def test_scopes_are_ordered_and_enforced(tmp_path):
    api = _api(tmp_path, auth_mode="all")
    read, write, admin = (_make(api, n, n)["token"] for n in ("read", "write", "admin"))
    assert api.get("/api/v1/experiments", headers=_bearer(read)).status_code == 200
    r = api.post("/api/v1/experiments", json=EXPERIMENT, headers=_bearer(read))
    assert r.status_code == 403 and "scope is 'read'" in r.json()["detail"]
    assert api.post("/api/v1/experiments", json=EXPERIMENT, headers=_bearer(write)).status_code == 201
    assert api.get("/api/v1/tokens", headers=_bearer(write)).status_code == 403
    assert api.post("/api/v1/tokens", json={"name": "x", "scope": "admin"}, headers=_bearer(write)).status_code == 403
    listed = api.get("/api/v1/tokens", headers=_bearer(admin))
    assert listed.status_code == 200 and [t["name"] for t in listed.json()] == ["read", "write", "admin"]
    assert all("token" not in t and "token_hash" not in t for t in listed.json())
    # A well-formed but unknown token is a 401 even where reads would be open.
    assert api.get("/api/v1/experiments", headers=_bearer("plab_" + "x" * 43)).status_code == 401
    # Bad input to token creation is a 422 that names the field.
    r = api.post("/api/v1/tokens", json={"name": "bad name!", "scope": "root"}, headers=_bearer(ADMIN))
    assert r.status_code == 422
    assert api.post("/api/v1/tokens", json={"name": "read", "scope": "read"}, headers=_bearer(ADMIN)).status_code == 409


def test_tokens_are_stored_hashed_and_stop_working_when_revoked(tmp_path):
    api = _api(tmp_path)
    made = _make(api, "worker-1", "write")
    raw = made["token"]
    assert raw.startswith("plab_") and len(raw) > 40 and made["prefix"] == raw[:12]
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'plab.sqlite'}")
    with engine.connect() as c:
        rows = [tuple(r) for r in c.execute(sa.text("select * from api_tokens"))]
    assert rows and not any(raw in str(v) for v in rows[0])
    assert api.post("/api/v1/experiments", json=EXPERIMENT, headers=_bearer(raw)).status_code == 201
    assert api.delete(f"/api/v1/tokens/{made['id']}", headers=_bearer(ADMIN)).status_code == 204
    assert api.post("/api/v1/experiments", json=EXPERIMENT, headers=_bearer(raw)).status_code == 401
    assert api.get("/api/v1/tokens", headers=_bearer(ADMIN)).json()[0]["revoked_at"] is not None
    assert api.delete("/api/v1/tokens/999", headers=_bearer(ADMIN)).status_code == 404


def test_the_dashboard_session_cookie_is_httponly_strict_and_needs_csrf_for_writes(tmp_path):
    api = _api(tmp_path)
    write = _make(api, "alice", "write")
    assert api.get("/api/v1/session").json() == {"auth_required": True, "authenticated": False, "scope": None,
                                                  "csrf": None}
    r = api.post("/api/v1/session", headers=_bearer(write["token"]))
    assert r.status_code == 200, r.text
    cookie_header = r.headers["set-cookie"].lower()
    assert "plab_session=" in cookie_header and "httponly" in cookie_header and "samesite=strict" in cookie_header
    assert write["token"] not in r.headers["set-cookie"]
    session = api.get("/api/v1/session").json()    # the test client keeps the cookie, as a browser would
    assert session["authenticated"] and session["scope"] == "write" and session["csrf"]

    assert api.post("/api/v1/experiments", json=EXPERIMENT).status_code == 403      # cookie alone: no CSRF value
    bad = api.post("/api/v1/experiments", json=EXPERIMENT, headers={"X-CSRF-Token": "forged"})
    assert bad.status_code == 403 and "X-CSRF-Token" in bad.json()["detail"]
    ok = api.post("/api/v1/experiments", json=EXPERIMENT, headers={"X-CSRF-Token": session["csrf"]})
    assert ok.status_code == 201, ok.text

    # A tampered cookie proves nothing; the cookie of a revoked token stops working.
    good = api.cookies.get("plab_session")
    api.cookies.set("plab_session", good[:-3] + "AAA")
    assert api.get("/api/v1/session").json()["authenticated"] is False
    api.cookies.set("plab_session", good)
    api.delete(f"/api/v1/tokens/{write['id']}", headers=_bearer(ADMIN))
    assert api.get("/api/v1/session").json()["authenticated"] is False
    assert api.post("/api/v1/experiments", json=EXPERIMENT, headers={"X-CSRF-Token": session["csrf"]}).status_code == 401
    # Signing in needs a bearer token; signing out clears the cookie.
    assert api.post("/api/v1/session").status_code == 401
    assert "plab_session=" in api.delete("/api/v1/session").headers["set-cookie"]


def test_without_a_server_token_nothing_asks_for_one(tmp_path):
    api = TestClient(create_app(Settings(
        home=tmp_path, database_url=f"sqlite:///{tmp_path / 'plab.sqlite'}", broker_url="filesystem://",
        api_token=None, data_dir=tmp_path, api_url="http://test"), migrate=True))
    assert api.get("/api/v1/session").json()["auth_required"] is False
    assert api.post("/api/v1/experiments", json=EXPERIMENT).status_code == 201


def test_plab_token_cli_creates_lists_and_revokes(tmp_path):
    env = dict(os.environ, PLAB_HOME=str(tmp_path), PLAB_DATABASE_URL=f"sqlite:///{tmp_path / 'plab.sqlite'}")

    def plab(*args):
        return subprocess.run([sys.executable, "-m", "plab.cli", "token", *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120)

    made = plab("create", "gpu-worker", "--scope", "write")
    assert made.returncode == 0, made.stderr
    raw = made.stdout.strip().splitlines()[-1]
    assert raw.startswith("plab_")
    assert plab("create", "gpu-worker", "--scope", "write").returncode == 2       # the name is taken
    assert "invalid choice" in plab("create", "x", "--scope", "root").stderr
    listed = plab("list")
    assert "gpu-worker" in listed.stdout and raw not in listed.stdout
    api = _api(tmp_path)
    assert api.post("/api/v1/experiments", json=EXPERIMENT, headers=_bearer(raw)).status_code == 201
    assert plab("revoke", "gpu-worker").returncode == 0
    api.app.state.tokens.forget()
    assert api.post("/api/v1/experiments", json=EXPERIMENT, headers=_bearer(raw)).status_code == 401
    assert plab("revoke", "nobody").returncode == 2


def test_plab_token_cli_takes_the_apis_names_and_revokes_a_name_before_an_id(tmp_path, monkeypatch, capsys):
    from plab.cli import main

    monkeypatch.setenv("PLAB_HOME", str(tmp_path))
    monkeypatch.setenv("PLAB_DATABASE_URL", f"sqlite:///{tmp_path / 'plab.sqlite'}")
    for bad in ("", "a b", "_x", "x" * 101, "tab\there"):
        assert main(["token", "create", bad, "--scope", "read"]) == 2
        assert "a token's name is 1 to 100 letters, digits" in capsys.readouterr().err
    assert main(["token", "create", "12", "--scope", "read"]) == 2
    assert "would read as an id in `plab token revoke`; add a letter, e.g. worker-12" in capsys.readouterr().err

    api = _api(tmp_path)
    alice, bob = _make(api, "alice", "read"), _make(api, "bob", "read")
    named = _make(api, str(alice["id"]), "write")     # the API takes a name of digits
    assert main(["token", "revoke", str(alice["id"])]) == 0  # the token of that name goes, not alice
    assert capsys.readouterr().out.startswith(f"token '{alice['id']}' revoked")
    assert main(["token", "revoke", str(bob["id"])]) == 0    # an id nobody is named after
    assert capsys.readouterr().out == "token 'bob' revoked (running servers stop accepting it within a few seconds)\n"
    assert main(["token", "revoke", str(named["id"] + 100)]) == 2
    revoked = {t["name"]: t["revoked_at"] is not None for t in api.get("/api/v1/tokens", headers=_bearer(ADMIN)).json()}
    assert revoked == {"alice": False, "bob": True, named["name"]: True}
