"""The dashboard works with no internet: every script and stylesheet comes from the server itself, and
plotly.js is the vendored cartesian bundle at the `plotly` Python package's plotly.js version."""
from __future__ import annotations

import re
from pathlib import Path

import plotly
import pytest

from frontend.pages import plotly_js_path

pytestmark = pytest.mark.browser


def test_plotly_js_is_served_by_the_server_at_the_plotly_packages_version(server):
    r = server.http.get("/static/vendor/plotly-cartesian.min.js")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/javascript")
    assert r.content == plotly_js_path().read_bytes()
    full = (Path(plotly.__path__[0]) / "package_data" / "plotly.min.js").read_text()[:200]
    version = re.search(r"plotly\.js v(\S+)", full).group(1)
    assert f"plotly.js (cartesian - minified) v{version}\n" in r.text[:200]  # the bundle follows the package


@pytest.mark.parametrize("path", ["/", "/experiments/new", "/runs", "/experiments/1"])
def test_pages_reference_no_external_asset(server, path):
    r = server.http.get(path)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    refs = re.findall(r'(?:src|href)="([^"]+)"', r.text)
    assert refs, "a page without assets would not exercise this test"
    external = [u for u in refs if re.match(r"^(https?:)?//", u)]
    assert external == []
    for ref in refs:
        if ref.startswith("/static/"):
            assert server.http.get(ref).status_code == 200, ref


def test_unknown_experiment_page_id_is_a_404_not_a_page(server):
    assert server.http.get("/experiments/not-an-id").status_code == 404
