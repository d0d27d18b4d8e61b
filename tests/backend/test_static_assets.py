"""The dashboard's static files go out gzipped with validators and cache headers, and a person following a wrong
link gets the site's 404 page while API clients keep their JSON errors."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from backend.app import create_app
from frontend.pages import plotly_js_path
from plab.settings import Settings


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    home = tmp_path_factory.mktemp("static")
    settings = Settings(home=home, database_url=f"sqlite:///{home / 'p.sqlite'}", broker_url="filesystem://",
                        api_token=None, data_dir=home, api_url="http://test")
    return TestClient(create_app(settings, migrate=True))


def test_plotly_is_served_gzipped_cached_and_revalidated(client):
    raw_size = plotly_js_path().stat().st_size
    r = client.get("/static/vendor/plotly-cartesian.min.js", headers={"Accept-Encoding": "gzip"})
    assert r.status_code == 200 and r.headers["content-encoding"] == "gzip"
    assert r.num_bytes_downloaded < 0.4 * raw_size and len(r.content) == raw_size  # decoded: the same file
    assert r.headers["cache-control"] == "public, max-age=86400" and r.headers["vary"] == "Accept-Encoding"
    assert r.headers["content-type"].startswith("text/javascript")
    again = client.get("/static/vendor/plotly-cartesian.min.js", headers={"Accept-Encoding": "gzip",
                                                               "If-None-Match": r.headers["etag"]})
    assert again.status_code == 304 and again.content == b""
    plain = client.get("/static/vendor/plotly-cartesian.min.js", headers={"Accept-Encoding": "identity"})
    assert "content-encoding" not in plain.headers and plain.num_bytes_downloaded == raw_size


def test_the_dashboards_own_files_are_gzipped_and_revalidated_every_load(client):
    for path, kind in (("/static/js/experiment.js", "text/javascript"), ("/static/css/dashboard.css", "text/css")):
        r = client.get(path, headers={"Accept-Encoding": "gzip, deflate"})
        assert r.status_code == 200 and r.headers["content-encoding"] == "gzip", path
        assert r.headers["cache-control"] == "no-cache" and r.headers["etag"], path
        assert r.headers["content-type"].startswith(kind), path
        assert client.get(path, headers={"If-None-Match": r.headers["etag"]}).status_code == 304
    assert client.get("/static/js/../../pages.py").status_code == 404  # StaticFiles' own path checks stay


@pytest.mark.parametrize("path", ["/experiments/999", "/experiments/abc", "/runs/12345", "/nowhere"])
def test_missing_pages_are_a_404_page_and_the_api_stays_json(client, path):
    r = client.get(path)
    assert r.status_code == 404 and r.headers["content-type"].startswith("text/html")
    assert 'id="not-found"' in r.text and "Precision Lab" in r.text
    api = client.get("/api/v1/experiments/999")
    assert api.status_code == 404 and api.json() == {"detail": "experiment 999 does not exist"}
