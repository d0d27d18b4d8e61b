"""What a client is told when its request is not a JSON object, and when the server fails: JSON, in words, with
the fix (a review found "0: JSON decode error", pydantic's "valid dictionary or object to extract fields from" for
a form body, Starlette's "There was an error parsing the body" for bytes that are not UTF-8, and a plain-text 500)."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tests.backend.test_api import make_client


@pytest.fixture
def api(tmp_path):
    return make_client(f"sqlite:///{tmp_path / 'plab.sqlite'}", tmp_path)


@pytest.mark.parametrize("body, content_type, expected", [
    (b'{"name": ', "application/json", "the body is not valid JSON (Expecting value) at character 9: send one JSON "
                                       "object, UTF-8 encoded, with Content-Type: application/json"),
    (b"name=x", "text/plain", "the body must be a JSON object ({...}) sent with Content-Type: application/json"),
    (b"[1, 2]", "application/json", "the body must be a JSON object ({...}) sent with Content-Type: application/json"),
    (b"", "application/json", "the request has no body: send a JSON object with Content-Type: application/json"),
])
def test_a_body_that_is_not_a_json_object_is_told_what_to_send(api, body, content_type, expected):
    r = api.post("/api/v1/experiments", content=body, headers={"Content-Type": content_type})
    assert r.status_code == 422 and r.json()["detail"] == expected


def test_bytes_that_are_not_utf8_say_so(api):
    r = api.post("/api/v1/experiments", content=b'{"name": "\xff"}', headers={"Content-Type": "application/json"})
    assert r.status_code in (400, 422)
    assert "UTF-8" in r.json()["detail"] and "Content-Type: application/json" in r.json()["detail"]


def test_an_unexpected_error_is_a_json_500_without_the_traceback(api):
    app = api.app

    @app.get("/api/v1/boom-for-test")
    def boom():
        raise KeyError("secret-internal-detail")

    r = TestClient(app, raise_server_exceptions=False).get("/api/v1/boom-for-test")
    assert r.status_code == 500 and r.headers["content-type"].startswith("application/json")
    assert r.json()["detail"].startswith("internal error (KeyError); it is logged on the server")
    assert "secret-internal-detail" not in r.text


def test_a_pattern_a_value_breaks_is_said_in_words(api):
    exp = api.post("/api/v1/experiments", json={"name": "e", "model": "tiny", "data": {"corpus": "tinyshakespeare"},
                                               "training": {"steps": 30}, "recipes": ["bf16"], "enqueue": False})
    assert exp.status_code == 201, exp.text
    exp = exp.json()
    r = api.patch(f"/api/v1/experiments/{exp['id']}", json={"tags": ["a,b"]})
    assert r.status_code == 422 and r.json()["detail"] == (
        "tags.0: a tag is one line of free text up to 64 characters: no comma, no control character, not starting "
        "with a blank")
    r = api.post(f"/api/v1/runs/{exp['runs'][0]['id']}/metrics",
                 json={"points": [{"key": "train loss", "step": 1, "value": 1.0}]})
    assert r.status_code == 422 and r.json()["detail"] == (
        "points.0.key: a metric key holds letters, digits and _ . / : - [ ] only, e.g. train/loss")
    assert "pattern" not in r.json()["detail"]
